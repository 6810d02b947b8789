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
from stare_jax.models.attention import grouped_response_attention
from stare_jax.models.blockwise_attention import MASK_VALUE, causal_attention, grouped_causal_attention
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


def _grouped_inputs(B=2, G=3, P=7, R=37, H=4, K=2, hd=8, seed=0, dtype=jnp.float32):
    """Grouped-update attention inputs: prompt 0 left-padded by 3, response 1 ending at 20, response
    4 at 5, response 5 with a masked token inside (position 9)."""
    rs = np.random.default_rng(seed)
    N = B * G
    f = lambda *shape: jnp.asarray(rs.normal(size=shape), dtype)  # noqa: E731
    q, kr, vr, kp, vp = f(N, R, H, hd), f(N, R, K, hd), f(N, R, K, hd), f(B, P, K, hd), f(B, P, K, hd)
    prompt_valid = np.ones((B, P), np.float32)
    prompt_valid[0, :3] = 0
    response_valid = np.ones((N, R), np.float32)
    response_valid[1, 20:] = 0
    response_valid[4, 5:] = 0
    response_valid[5, 9] = 0
    return q, kp, vp, kr, vr, jnp.asarray(prompt_valid), jnp.asarray(response_valid)


def _kept(q, kp, vp, kr, vr, prompt_valid, response_valid):
    """The grouped update's form below the block (`grouped_response_attention`, additive masks)."""
    prompt_bias = jnp.where(prompt_valid > 0, 0.0, MASK_VALUE).astype(jnp.float32)
    return grouped_response_attention(q, kp, vp, kr, vr, prompt_bias, causal_bias(response_valid, q.shape[1])[:, 0, 0])


@pytest.mark.parametrize("block", [4, 16, 36, 64])
def test_grouped_blockwise_attention_equals_the_kept_form_with_its_gradients(block):
    """The grouped update's response attention in flash blocks (the shared prompt as the first key
    block) gives the outputs and the q / prompt k, v / response k, v gradients of
    `grouped_response_attention` at every block size (R = 37 not a multiple of it), with a
    left-padded prompt, responses ending early, a masked token inside a response and GQA; a masked
    key (prompt padding, response tokens after the end) is never read."""
    args = _grouped_inputs()
    q, kp, vp, kr, vr, pv, rv = args
    blocks = lambda q, kp, vp, kr, vr: grouped_causal_attention(q, kp, vp, pv, kr, vr, rv, block)  # noqa: E731
    kept = lambda q, kp, vp, kr, vr: _kept(q, kp, vp, kr, vr, pv, rv)  # noqa: E731
    out, ref = blocks(*args[:5]), kept(*args[:5])
    assert out.shape == ref.shape == (6, 37, 4, 8) and out.dtype == jnp.float32
    assert float(jnp.abs(out - ref).max()) <= 2e-6
    cot = jnp.asarray(np.random.default_rng(1).normal(size=out.shape), jnp.float32)
    got, want = jax.vjp(blocks, *args[:5])[1](cot), jax.vjp(kept, *args[:5])[1](cot)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert float(jnp.abs(g - w).max()) <= 1e-5 * max(1.0, float(jnp.abs(w).max()))
    assert float(jnp.abs(got[1][0, :3]).max()) == 0.0  # no gradient reaches the prompt's padding keys
    moved = blocks(q, kp.at[0, :3].add(100.0), vp.at[0, :3].add(100.0), kr.at[1, 20:].add(100.0),
                   vr.at[4, 5:].add(100.0).at[5, 9].add(100.0))
    assert float(jnp.abs(moved - out).max()) == 0.0


def test_grouped_blockwise_attention_keeps_the_input_dtypes_in_bfloat16():
    args = _grouped_inputs(seed=4, dtype=jnp.bfloat16)
    pv, rv = args[5:]
    out = grouped_causal_attention(*args[:3], pv, *args[3:5], rv, 8)
    assert out.dtype == jnp.float32 and float(jnp.abs(out - _kept(*args)).max()) <= 3e-2
    grads = jax.grad(lambda *a: grouped_causal_attention(*a[:3], pv, *a[3:], rv, 8).sum(),
                     argnums=(0, 1, 2, 3, 4))(*args[:5])
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 5
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)


def test_the_compiled_grouped_blockwise_backward_holds_no_response_score_matrix():
    """jit(grad) of the grouped response attention at R = 2,048 (one prompt of 64, G = 2 responses
    of 2 heads): the flash blocks' XLA temporary memory stays under a quarter of one response's
    [H, R, R] scores, while the kept form's (probabilities of up to 8 causal blocks, the [N, R, R]
    mask) holds more than all of them."""
    B, G, P, R, H, K, hd = 1, 2, 64, 2048, 2, 1, 16
    N = B * G
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (spec(N, R, H, hd), spec(B, P, K, hd), spec(B, P, K, hd), spec(N, R, K, hd), spec(N, R, K, hd),
            spec(B, P), spec(N, R))

    def temp_bytes(attend):
        loss = lambda *a: attend(*a).sum()  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one_response = H * R * R * 4
    blocks = lambda q, kp, vp, kr, vr, pv, rv: grouped_causal_attention(q, kp, vp, pv, kr, vr, rv, 256)  # noqa: E731
    assert temp_bytes(blocks) < one_response / 4
    assert temp_bytes(_kept) >= N * one_response


@pytest.mark.parametrize("layout,pack", [("data2", 1), ("data2_fsdp2", 0)])
def test_grouped_response_blocks_give_the_update_of_the_kept_form(layout, pack):
    """The update step whose responses (R = 16) attend in blocks of 4, packed on a 2-device
    data-parallel mesh (the per-device layer stack) and padded on a data x fsdp = 2 x 2 mesh: the
    metrics and updated parameters of the same step with `attention_block` = 0."""
    from stare_jax.models import build_model
    from stare_jax.rl import create_train_state, make_update_step
    from tests.test_packing import long_batch
    from tests.test_rl_update import CFG, assert_trees_close, make_config, params_of

    mesh = (parallel.make_mesh(data=2, devices=jax.devices()[:2]) if layout == "data2" else
            parallel.make_mesh(data=2, fsdp=2, tensor=1, devices=jax.devices()[:4]))
    batch = long_batch()

    def update(block, pack):
        config = make_config(**{"update.pack_tokens": pack})
        ts = create_train_state(build_model(CFG, mesh=mesh, seed=0, attention_block=block), config, mesh=mesh)
        step = make_update_step(config, mesh, ts)
        ts, m = step(ts, parallel.shard_batch(batch, mesh), jax.random.key(0), packing=step.packing(batch))
        return {k: float(v) for k, v in m.items()}, params_of(ts)

    (m_blocks, p_blocks), (m_kept, p_kept) = update(4, pack), update(0, pack)
    for k in m_kept:
        np.testing.assert_allclose(m_blocks[k], m_kept[k], atol=2e-6, rtol=5e-5, err_msg=k)
    assert m_kept["loss"] != 0.0 and m_kept["grad_norm"] > 0.0
    assert_trees_close(p_blocks, p_kept, atol=5e-6)


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
    assert rows[1]["max_grad_diff_vs_reference"] <= 1e-4 and rows[1]["temp_mib"] < rows[0]["temp_mib"]
    assert summary["summary"] and summary["host_cpu"] and len(summary["rows"]) == 2
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_attention.py"), "--lengths", "0"],
                         cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--lengths" in bad.stderr.strip().splitlines()[-1]


def test_the_configs_attention_block_default_is_the_decoders():
    """`model.attention_block`'s default in config.py (which imports no JAX) and the decoder's and
    loaders' `DEFAULT_ATTENTION_BLOCK` name the same block, so a model built outside the trainer
    attends as a trained one does."""
    from stare_jax import config as config_lib
    from stare_jax.models.decoder import DEFAULT_ATTENTION_BLOCK

    assert config_lib.default_config().model.attention_block == DEFAULT_ATTENTION_BLOCK
