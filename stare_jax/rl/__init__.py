"""RL core: advantages, STARE weights, policy losses, diagnostics and the jitted update step."""

from stare_jax.rl.advantages import group_advantages
from stare_jax.rl.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, clipped_surrogate, policy_loss
from stare_jax.rl.settings import RLSettings
from stare_jax.rl.stare import ControllerState, controller_update, init_controller, stare_weights
from stare_jax.rl.train_state import (TrainState, abstract_train_state, create_train_state, make_optimizer,
                                     shard_train_state)
from stare_jax.rl.update import UpdateStep, make_update_step

__all__ = ["group_advantages", "AGGREGATIONS", "KL_ESTIMATORS", "POLICY_LOSSES", "clipped_surrogate", "policy_loss",
           "RLSettings", "ControllerState", "controller_update", "init_controller", "stare_weights", "TrainState",
           "abstract_train_state", "create_train_state", "make_optimizer", "shard_train_state", "UpdateStep",
           "make_update_step"]
