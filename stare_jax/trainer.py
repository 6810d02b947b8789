"""The main job: one train loop over rollout -> rewards -> dynamic sampling -> update -> log -> save.

Everything heavy is jitted elsewhere (the sampler in `rollout`, the update step in `rl.update`);
this module orchestrates it and owns the side effects: files, checkpoints, the verifier pool.

Determinism: all randomness of step s comes from `fold_in(key(seed), s)`, and the data position
is checkpointed, so a run resumed from step s produces exactly the metrics of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stare_jax import checkpoint as ckpt_lib
from stare_jax import parallel
from stare_jax.dynamic_sampling import DynamicSamplingError, GroupBuffer, groups_with_spread
from stare_jax.models import Policy, from_pretrained
from stare_jax.writers import MetricsWriter, Progress, truncate_jsonl

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    """Everything a running job holds."""

    config: Any
    workdir: str
    mesh: Any
    policy: Policy
    tokenizer: Any
    eos_ids: tuple
    pad_id: int


# ----------------------------------------------------------------------------- set-up

def prepare_policy(config, workdir: str, mesh) -> Policy:
    """Loads the policy to train: `model.path`, or the embedded tiny model (created and warm-started
    in the workdir on first use, then reused)."""
    dtype, pdtype = config.model.dtype, config.model.param_dtype
    if config.model.path:
        return from_pretrained(config.model.path, dtype=dtype, param_dtype=pdtype, mesh=mesh, remat=config.model.remat)
    from stare_jax.tasks import embedded

    base = os.path.join(workdir, "model", "init")
    e = config.model.embedded
    if jax.process_index() == 0:
        embedded.create_embedded_model(base, hidden_size=e.hidden_size, num_layers=e.num_layers,
                                       num_heads=e.num_heads, num_kv_heads=e.num_kv_heads,
                                       intermediate_size=e.intermediate_size, seed=config.seed)
    _barrier("embedded-model")
    if config.warmstart.steps <= 0:
        return from_pretrained(base, dtype=dtype, param_dtype=pdtype, mesh=mesh, remat=config.model.remat)
    warm = os.path.join(workdir, "model", "warmstart")
    done = os.path.join(warm, "warmstart.json")
    if not os.path.exists(done):
        _run_warmstart(config, base, warm, mesh)
    return from_pretrained(warm, dtype=dtype, param_dtype=pdtype, mesh=mesh, remat=config.model.remat)


def _run_warmstart(config, base: str, out: str, mesh) -> None:
    from stare_jax import warmstart
    from stare_jax.models import save_pretrained
    from stare_jax.tasks import countdown

    policy = from_pretrained(base, mesh=mesh)
    tok = policy.tokenizer
    ccfg = countdown_config(config)
    problems = countdown.generate_problems(config.seed + 7919, config.warmstart.num_examples, config=ccfg,
                                           split="warmstart")
    eos = tok.eos_token_id
    pairs = [(encode(tok, p.prompt), encode(tok, ref) + [eos]) for p, ref in problems]
    data = warmstart.pack_examples(pairs, config.data.max_prompt_len, config.rollout.max_new_tokens,
                                   pad_id=tok.pad_token_id or 0)
    t0 = time.time()
    losses = warmstart.supervised_train(policy.model, data, steps=config.warmstart.steps,
                                        batch_size=config.warmstart.batch_size, lr=config.warmstart.lr,
                                        seed=config.seed, mesh=mesh)
    if jax.process_index() == 0:
        save_pretrained(policy, out)
        ckpt_lib.write_json_atomic(os.path.join(out, "warmstart.json"), {
            "steps": config.warmstart.steps, "final_loss": losses[-1], "seconds": time.time() - t0})
    _barrier("warmstart")
    log.info("warm start: %d steps, loss %.3f -> %.3f (%.0fs)", len(losses), losses[0], losses[-1], time.time() - t0)


def countdown_config(config):
    """The task generator's difficulty knobs from the config's data section."""
    from stare_jax.tasks import countdown

    d = config.data
    return countdown.CountdownConfig(min_numbers=d.countdown_min_numbers, max_numbers=d.countdown_max_numbers,
                                     max_number=d.countdown_max_number, max_target=d.countdown_max_target)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
