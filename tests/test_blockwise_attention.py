"""Blockwise causal self-attention (`models.blockwise_attention`, `model.attention_block`): the
values and gradients of the whole-matrix form, through the decoder, the grouped update, a sharded
mesh and the sampler's prefill, without a [T, T] buffer in the compiled program."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stare_jax import parallel
from stare_jax.models import from_pretrained
from stare_jax.models.blockwise_attention import causal_attention
from stare_jax.models.decoder import _attend, causal_bias, positions_from_mask
from tests import hf_fixtures
from tests.e2e_helpers import QUICKSTART, ROOT, subprocess_env


def _dense(q, k, v, key_valid):
    """`_attend` with the causal and key-validity bias of `Decoder.hidden_states` (no cache)."""
    return _attend(q, k, v, causal_bias(key_valid, q.shape[1]), q.dtype)


def _inputs(B=3, T=37, H=4, K=2, hd=8, lengths=(37, 20, 5), seed=0):
    rs = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rs.normal(size=s), jnp.float32) for s in ((B, T, H, hd), (B, T, K, hd), (B, T, K, hd)))
    valid = np.zeros((B, T), np.float32)
    for b, n in enumerate(lengths):
        valid[b, T - n:] = 1  # left padding, as the pipeline writes prompts
    return q, k, v, jnp.asarray(valid)


@pytest.mark.parametrize("block", [4, 16, 36, 64])
def test_blockwise_attention_equals_the_whole_matrix_with_its_gradients(block):
    """Every block size, with T = 37 not a multiple of it (padded keys masked), left-padded rows,
    grouped-query heads: the same outputs and q/k/v gradients as autodiff of the whole-matrix form
    at every query with a real key before it (a cotangent of zero on the padding queries, which
    read a different average in each form and which nothing downstream reads)."""
    q, k, v, valid = _inputs()
    real = valid[:, :, None, None, None]
    out = causal_attention(q, k, v, valid, block)
    ref = _dense(q, k, v, valid)
    assert out.shape == ref.shape == (3, 37, 2, 2, 8) and out.dtype == jnp.float32
    assert float(jnp.abs((out - ref) * real).max()) <= 2e-6
    cot = jnp.asarray(np.random.default_rng(1).normal(size=out.shape), jnp.float32) * real
    got = jax.vjp(lambda *a: causal_attention(*a, valid, block), q, k, v)[1](cot)
    want = jax.vjp(lambda *a: _dense(*a, valid), q, k, v)[1](cot)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert float(jnp.abs(g - w).max()) <= 1e-5 * max(1.0, float(jnp.abs(w).max()))
    # a key that is not real is never attended: changing its value changes no real query's output
    moved = v.at[2, :32].add(100.0)  # row 2 has 5 real tokens, at positions 32..36
    assert float(jnp.abs((causal_attention(q, k, moved, valid, block) - out) * real).max()) == 0.0


def test_blockwise_attention_keeps_the_input_dtypes_in_bfloat16():
    q, k, v, valid = _inputs(seed=4)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = causal_attention(q, k, v, valid, 8)
    ref = _dense(q, k, v, valid)
    real = valid[:, :, None, None, None]
    assert out.dtype == jnp.float32 and float(jnp.abs((out - ref) * real).max()) <= 3e-2
    grads = jax.grad(lambda q, k, v: (causal_attention(q, k, v, valid, 8) * real).sum(), argnums=(0, 1, 2))(q, k, v)
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3 and all(bool(jnp.isfinite(g.astype(jnp.float32)).all())
                                                                   for g in grads)


def test_the_compiled_blockwise_backward_holds_no_score_matrix():
    """The point of the blocks: jit(grad) at T = 2,048 holds no [T, T] buffer. XLA's temporary
    memory of the blockwise program stays under a quarter of one head's score matrix, while the
    whole-matrix program's holds at least one (so the check can fail)."""
    B, T, H, K, hd = 1, 2048, 2, 1, 16
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((B, T, H, hd), (B, T, K, hd), (B, T, K, hd)))
    valid = jax.ShapeDtypeStruct((B, T), jnp.float32)

    def temp_bytes(attend):
        loss = lambda q, k, v, valid: attend(q, k, v, valid).sum()  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, valid).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one_matrix = T * T * 4
    assert temp_bytes(_dense) >= one_matrix
    assert temp_bytes(lambda *a: causal_attention(*a, 128)) < one_matrix / 4


@pytest.mark.parametrize("name", list(hf_fixtures.KINDS))
def test_blockwise_decoder_logits_match_pytorch_reference(tiny_checkpoints, name):
    """`attention_block = 4` on 9-position left-padded rows (three blocks, the last padded) gives
    the `transformers` reference's logits, as the whole-matrix form does; at 0 the decoder forms the
    whole matrix, and a sequence no longer than the block does too."""
    torch_model = hf_fixtures.hf_model(name)
    ids, mask, pos = hf_fixtures.left_padded_batch()
    ref = hf_fixtures.torch_logits(torch_model, ids, mask, pos)
    blockwise = from_pretrained(tiny_checkpoints[name], attention_block=4, load_tokenizer=False)
    assert blockwise.model.self_attention_block(9) == 4 and blockwise.model.self_attention_block(4) == 0
    out = np.asarray(blockwise(ids, mask))
    assert np.abs(out - ref)[mask > 0].max() <= 1e-4
    whole = np.asarray(from_pretrained(tiny_checkpoints[name], attention_block=0, load_tokenizer=False)(ids, mask))
    assert np.abs(out - whole)[mask > 0].max() <= 1e-5
    with pytest.raises(ValueError, match="attention_block"):
        from_pretrained(tiny_checkpoints[name], attention_block=-1, load_tokenizer=False)


def test_blockwise_gradients_through_the_rematerialised_decoder(tiny_checkpoints):
    """Every parameter's gradient of a loss on the real positions' logits, each layer
    rematerialised: blockwise (block 4) equals the whole-matrix form."""
    from flax import nnx

    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(9, 6, 3), seed=5)
    weights = np.random.default_rng(6).normal(size=(3, 9, 1)).astype(np.float32) * mask[:, :, None]
    loss = lambda m: (m(ids, mask) * weights).sum()  # noqa: E731

    def grads(block):
        model = from_pretrained(tiny_checkpoints["qwen2"], attention_block=block, remat=True, load_tokenizer=False).model
        return jax.tree.leaves(nnx.state(nnx.grad(loss)(model), nnx.Param))

    for got, want in zip(grads(4), grads(0)):
        assert float(jnp.abs(got - want).max()) <= 1e-5 * max(1.0, float(jnp.abs(want).max()))


def test_blockwise_prompts_in_the_grouped_forward_and_on_a_data_parallel_mesh(tiny_checkpoints):
    """The update's grouped forward with its prompts' self-attention in blocks (prompts of 7
    positions, block 4) equals the whole-matrix model; so do the logits of a 2-device data-parallel
    mesh, where the layer stack runs per device, and of a data x fsdp x tensor = 2 x 2 x 2 mesh,
    whose heads are split over "tensor"."""
    prompt_ids, prompt_mask, _ = hf_fixtures.left_padded_batch(lengths=(7, 3, 1), total=7, seed=2)
    G, R = 2, 32
    rs = np.random.RandomState(3)
    response_mask = np.ones((3 * G, R), np.int64)
    response_mask[1, 5:] = 0
    response_ids = np.where(response_mask > 0, rs.randint(3, hf_fixtures.VOCAB, (3 * G, R)), 0)
    whole = from_pretrained(tiny_checkpoints["llama"], attention_block=0, load_tokenizer=False).model
    blocks = from_pretrained(tiny_checkpoints["llama"], attention_block=4, load_tokenizer=False).model
    for a, b, m in zip(whole.grouped_hidden_states(prompt_ids, prompt_mask, response_ids, response_mask),
                       blocks.grouped_hidden_states(prompt_ids, prompt_mask, response_ids, response_mask),
                       (prompt_mask, response_mask)):
        assert np.abs(np.asarray(a) - np.asarray(b))[m > 0].max() <= 1e-5

    mesh = parallel.make_mesh(data=2, devices=jax.devices()[:2])
    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(9, 5, 2, 7), seed=3)
    sharded = from_pretrained(tiny_checkpoints["llama"], attention_block=4, mesh=mesh, load_tokenizer=False)
    assert sharded.model._per_device(ids.shape[0])  # the per-device layer stack is what runs
    ref = np.asarray(from_pretrained(tiny_checkpoints["llama"], attention_block=0, load_tokenizer=False)(ids, mask))
    for mesh in (mesh, parallel.make_mesh(data=2, fsdp=2, tensor=2)):
        sharded = from_pretrained(tiny_checkpoints["llama"], attention_block=4, mesh=mesh, load_tokenizer=False)
        batch = parallel.shard_batch({"ids": ids, "mask": mask}, mesh)
        out = np.asarray(sharded(batch["ids"], batch["mask"]))
        assert np.abs(out - ref)[mask > 0].max() <= 1e-5


def test_blockwise_prefill_samples_the_same_greedy_responses(tiny_checkpoints):
    """The sampler's prefill fills a cache of the prompt's length from slot 0, so it runs blockwise
    too: greedy responses equal the whole-matrix model's token for token, log-probs within 1e-5."""
    from stare_jax.rollout import generate

    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(9, 5, 2), seed=7)
    results = [generate(from_pretrained(tiny_checkpoints["qwen3"], attention_block=block, load_tokenizer=False),
                        ids, mask, rng=None, group_size=2, max_new_tokens=6, greedy=True)
               for block in (0, 4)]
    whole, blocks = results
    np.testing.assert_array_equal(np.asarray(whole.tokens), np.asarray(blocks.tokens))
    np.testing.assert_allclose(np.asarray(whole.log_probs), np.asarray(blocks.log_probs), atol=1e-5)


def test_attention_block_is_a_validated_resumable_config_key(tmp_path):
    """`model.attention_block` below 0 is refused with one line and exit 2 before anything runs; the
    key changes only the rounding of long sequences, so a run may resume under another value (and a
    run saved before the key existed resumes under the default)."""
    r = subprocess.run([sys.executable, "-m", "stare_jax.train", "--config", QUICKSTART, "--workdir",
                        str(tmp_path / "w"), "--config.model.attention_block=-1"], cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "model.attention_block" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    from stare_jax.checkpoint import RESUMABLE_CHANGES

    assert "model.attention_block" in RESUMABLE_CHANGES


def test_bench_attention_times_both_forms_and_reads_their_memory():
    import json
    import os

    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_attention.py"), "--lengths", "256",
                        "--blocks", "32,256", "--rounds", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8"],
                       cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(x) for x in r.stdout.strip().splitlines()]
    rows, summary = lines[:-1], lines[-1]
    assert [row["form"] for row in rows] == ["whole", "block32"]  # a block not below the length is skipped
    assert all(len(row["times_s"]) == 2 and row["median_s"] > 0 for row in rows)
    assert rows[1]["max_grad_diff_vs_whole"] <= 1e-4 and rows[1]["temp_mib"] < rows[0]["temp_mib"]
    assert summary["summary"] and summary["host_cpu"] and len(summary["rows"]) == 2
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_attention.py"), "--lengths", "0"],
                         cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--lengths" in bad.stderr.strip().splitlines()[-1]
