"""The RL train state: policy, AdamW state, STARE controller, step counter, optional reference.

`TrainState` is an NNX module, so `nnx.state(train_state)` is the whole checkpointable state
(Orbax `PyTreeSave` takes it as is) and `nnx.split` / `nnx.merge` give the pure form the jitted
update step works on. Paths: `model/...`, `optimizer/step`, `optimizer/opt_state/...`,
`controller/{w,m,gate_on,last_entropy}`, `step`, and `ref_model/...` when a frozen reference
policy is held for a KL penalty (it is never differentiated nor updated).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from stare_jax import parallel
from stare_jax.rl.settings import OptimSettings, RLSettings
from stare_jax.rl.stare import ControllerState, init_controller


class ControllerVariable(nnx.Variable):
    """A scalar of the STARE controller state (checkpointed with the train state)."""


class StepCounter(nnx.Variable):
    """The number of update steps taken (one per batch, skipped steps included)."""


class Controller(nnx.Module):
    """Holds a `ControllerState` as NNX variables: w, m (float32), gate_on (bool), last_entropy (float32)."""

    def __init__(self, state: ControllerState):
        self.w = ControllerVariable(jnp.asarray(state.w, jnp.float32))
        self.m = ControllerVariable(jnp.asarray(state.m, jnp.float32))
        self.gate_on = ControllerVariable(jnp.asarray(state.gate_on, bool))
        self.last_entropy = ControllerVariable(jnp.asarray(state.last_entropy, jnp.float32))

    def get(self) -> ControllerState:
        """The current controller state as a pure pytree."""
        return ControllerState(w=self.w[...], m=self.m[...], gate_on=self.gate_on[...],
                               last_entropy=self.last_entropy[...])

    def set(self, state: ControllerState) -> None:
        """Overwrites the held state."""
        self.w[...] = jnp.asarray(state.w, jnp.float32)
        self.m[...] = jnp.asarray(state.m, jnp.float32)
        self.gate_on[...] = jnp.asarray(state.gate_on, bool)
        self.last_entropy[...] = jnp.asarray(state.last_entropy, jnp.float32)


class TrainState(nnx.Module):
    """Policy + `nnx.Optimizer(model, tx, wrt=nnx.Param)` + controller + step (+ frozen reference)."""

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *, controller: ControllerState,
                 ref_model: nnx.Module | None = None):
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        self.controller = Controller(controller)
        self.step = StepCounter(jnp.asarray(0, jnp.int32))
        self.ref_model = ref_model

    def controller_state(self) -> ControllerState:
        """The STARE controller state (a pure pytree of scalars)."""
        return self.controller.get()


def learning_rate_schedule(settings: OptimSettings):
    """lr(count) = lr * min(1, (count + 1) / warmup_steps), or the constant lr without warmup."""
    lr, warmup = float(settings.lr), int(settings.warmup_steps)
    if warmup <= 0:
        return lambda count: jnp.asarray(lr, jnp.float32)
    return lambda count: jnp.float32(lr) * jnp.minimum(1.0, (jnp.asarray(count, jnp.float32) + 1.0) / warmup)


def make_optimizer(settings: OptimSettings) -> optax.GradientTransformation:
    """optax.chain(clip_by_global_norm(grad_clip), adamw(lr schedule, b1, b2, eps, weight_decay))."""
    return optax.chain(
        optax.clip_by_global_norm(settings.grad_clip),
        optax.adamw(learning_rate_schedule(settings), b1=settings.b1, b2=settings.b2, eps=settings.eps,
                    weight_decay=settings.weight_decay),
    )


def train_state_shardings(state, mesh: Mesh):
    """NamedShardings for a train state's pure state (or abstract state): the parameter partition
    rules of `stare_jax.parallel` for the model, its Adam moments and the reference model;
    scalars replicated."""
    return parallel.param_shardings(state, mesh)


def abstract_train_state(train_state: TrainState, mesh: Mesh):
    """`jax.ShapeDtypeStruct`s (with the train-state shardings) of `nnx.state(train_state)`: the
    restore target for an Orbax `PyTreeRestore` onto `mesh`."""
    state = nnx.state(train_state)
    shardings = train_state_shardings(state, mesh)
    return jax.tree_util.tree_map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, shardings)


def shard_train_state(train_state: TrainState, mesh: Mesh) -> TrainState:
    """Places every array of `train_state` by `train_state_shardings` (in place; returns it)."""
    state = nnx.state(train_state)
    shardings = train_state_shardings(state, mesh)
    if jax.process_count() == 1:
        placed = jax.device_put(state, shardings)
    else:
        # Multi-process: parameters are already global arrays; freshly initialised scalars (step,
        # controller) are process-local values, identical everywhere by construction, placed
        # without device_put's cross-process equality check (which NaN initial values fail).
        def place(x, sh):
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return x if x.sharding == sh else jax.device_put(x, sh)
            return parallel.host_to_global(np.asarray(x), sh)

        placed = jax.tree_util.tree_map(place, state, shardings)
    nnx.update(train_state, placed)
    return train_state


def create_train_state(model: nnx.Module, config, *, mesh: Mesh | None = None, ref_model: nnx.Module | None = None,
                       controller: ControllerState | None = None) -> TrainState:
    """A fresh train state for `model` (e.g. from `stare_jax.models.build_model(cfg, mesh=mesh)`).

    `config` is the ml_collections config (or an `RLSettings`). The optimizer is `make_optimizer`
    of its `optim.*` keys, the controller starts from `stare.w`, `stare.m`, gate off. With a mesh,
    every array (Adam moments included) is placed by the partition rules. `ref_model` is kept only
    when `loss.kl_type` is not "none" (it is then required).
    """
    settings = config if isinstance(config, RLSettings) else RLSettings.from_config(config)
    if settings.loss.uses_reference and ref_model is None:
        raise ValueError(f"loss.kl_type={settings.loss.kl_type!r} needs a reference model (ref_model=...)")
    ts = TrainState(model, make_optimizer(settings.optim),
                    controller=controller if controller is not None else init_controller(settings.stare),
                    ref_model=ref_model if settings.loss.uses_reference else None)
    if mesh is not None:
        shard_train_state(ts, mesh)
    return ts
