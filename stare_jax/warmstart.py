"""Warm start: a short supervised phase on reference solutions before RL.

RL from verifiable rewards needs a policy that is sometimes right: a random tiny model never
solves a countdown problem, so every group has equal rewards and GRPO has no signal. This phase
trains the policy with teacher forcing, loss = mean over answer tokens of -log pi(y_t | x, y_<t),
on (prompt, reference answer + EOS) pairs, and is stopped early enough that accuracy stays well
below 100% (the run's config chooses the step count).
"""

from __future__ import annotations

import logging
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from stare_jax import parallel
from stare_jax.models.decoder import Decoder

log = logging.getLogger(__name__)


def pack_examples(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], prompt_len: int, answer_len: int,
                  pad_id: int = 0) -> dict[str, np.ndarray]:
    """Left-pads prompts to `prompt_len` and right-pads answers to `answer_len`.

    Returns input_ids / attention_mask [N, P + A] and loss_mask [N, P + A] (1 on answer tokens).
    Pairs longer than the budget raise ValueError.
    """
    n = len(pairs)
    ids = np.full((n, prompt_len + answer_len), pad_id, np.int32)
    attn = np.zeros_like(ids)
    loss = np.zeros_like(ids)
    for i, (p, a) in enumerate(pairs):
        if len(p) > prompt_len or len(a) > answer_len:
            raise ValueError(f"example {i}: prompt {len(p)} / answer {len(a)} tokens exceed {prompt_len}/{answer_len}")
        ids[i, prompt_len - len(p):prompt_len] = p
        ids[i, prompt_len:prompt_len + len(a)] = a
        attn[i, prompt_len - len(p):prompt_len + len(a)] = 1
        loss[i, prompt_len:prompt_len + len(a)] = 1
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}


def sequence_loss(model: Decoder, input_ids, attention_mask, loss_mask) -> jax.Array:
    """Mean next-token cross-entropy over positions whose TARGET token has loss_mask 1."""
    logits = model(input_ids, attention_mask)[:, :-1]
    targets = input_ids[:, 1:]
    weights = loss_mask[:, 1:].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def supervised_train(model: Decoder, data: dict[str, np.ndarray], *, steps: int, batch_size: int, lr: float,
                     seed: int, mesh=None, log_every: int = 50) -> list[float]:
    """Runs `steps` AdamW steps (cosine decay to 10% of `lr`) on random minibatches of `data`, updating
    `model` in place; returns the loss of every step."""
    schedule = optax.cosine_decay_schedule(lr, max(steps, 1), alpha=0.1)
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.0), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(sequence_loss)(model, batch["input_ids"], batch["attention_mask"],
                                                         batch["loss_mask"])
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)
    n = len(data["input_ids"])
    losses = []
    for i in range(steps):
        idx = rng.choice(n, size=batch_size, replace=n < batch_size)
        batch = {k: v[idx] for k, v in data.items()}
        if mesh is not None:
            batch = parallel.shard_batch(batch, mesh)
        losses.append(float(step(model, optimizer, batch)))
        if log_every and (i + 1) % log_every == 0:
            log.info("warm start step %d/%d: loss %.4f", i + 1, steps, losses[-1])
    return losses

