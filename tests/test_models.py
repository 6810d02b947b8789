"""Foundation acceptance: parity with the PyTorch reference, HF round trip, sharded forward."""

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from stare_jax import parallel
from stare_jax.models import CheckpointFormatError, ModelConfig, UnsupportedModelError, from_pretrained, save_pretrained
from stare_jax.models.safetensors_io import SafetensorsReader, write_file
from tests import hf_fixtures


def _max_diff(a, b, mask):
    return float(np.abs(np.asarray(a) - np.asarray(b))[mask > 0].max())


@pytest.mark.parametrize("name", list(hf_fixtures.KINDS))
def test_logits_match_pytorch_reference(tiny_checkpoints, name):
    torch_model = hf_fixtures.hf_model(name)
    ids, mask, pos = hf_fixtures.left_padded_batch()
    ref = hf_fixtures.torch_logits(torch_model, ids, mask, pos)
    policy = from_pretrained(tiny_checkpoints[name])
    out = policy(ids, mask)
    assert out.dtype == np.float32 and out.shape == ref.shape
    assert _max_diff(out, ref, mask) <= 1e-4


def test_fixture_covers_families_tying_and_gqa(tiny_checkpoints):
    cfgs = {n: json.load(open(os.path.join(p, "config.json"))) for n, p in tiny_checkpoints.items()}
    assert {c["architectures"][0] for c in cfgs.values()} == {
        "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
    assert {c["tie_word_embeddings"] for c in cfgs.values()} == {True, False}
    assert all(c["num_key_value_heads"] < c["num_attention_heads"] for c in cfgs.values())
    llama = ModelConfig.from_hf_dict(cfgs["llama"])
    assert llama.rope_scaling_dict["rope_type"] == "llama3" and llama.rope_theta == 500000.0


def test_legacy_and_new_rope_keys_agree():
    base = dict(architectures=["Qwen2ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=2)
    legacy = ModelConfig.from_hf_dict(dict(base, rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}))
    new = ModelConfig.from_hf_dict(dict(base, rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}))
    assert legacy == new and legacy.rope_theta == 1e6 and new.rope_scaling_dict["factor"] == 2.0
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_hf_dict(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict(dict(base, architectures=["GPT2LMHeadModel"]))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_save_pretrained_round_trip_through_transformers(tiny_checkpoints, tmp_path, name):
    import torch
    import transformers

    policy = from_pretrained(tiny_checkpoints[name])
    out = str(tmp_path / "export")
    save_pretrained(policy, out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, mask, pos = hf_fixtures.left_padded_batch(seed=1)
    ref = hf_fixtures.torch_logits(reloaded, ids, mask, pos)
    assert _max_diff(policy(ids, mask), ref, mask) <= 1e-4


def test_sharded_checkpoint_with_index_loads(tiny_checkpoints, tmp_path):
    policy = from_pretrained(tiny_checkpoints["qwen3"])
    out = str(tmp_path / "sharded")
    save_pretrained(policy, out, max_shard_bytes=20_000)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    reloaded = from_pretrained(out)
    ids, mask, _ = hf_fixtures.left_padded_batch(seed=2)
    np.testing.assert_array_equal(np.asarray(reloaded(ids, mask)), np.asarray(policy(ids, mask)))


def test_bfloat16_switch_runs_and_stays_close(tiny_checkpoints):
    ids, mask, _ = hf_fixtures.left_padded_batch()
    f32 = np.asarray(from_pretrained(tiny_checkpoints["qwen2"])(ids, mask))
    policy = from_pretrained(tiny_checkpoints["qwen2"], dtype="bfloat16")
    assert policy.model.embed[...].dtype == jax.numpy.bfloat16
    bf16 = policy(ids, mask)
    assert bf16.dtype == np.float32
    assert _max_diff(bf16, f32, mask) < 0.1


def test_unrolled_layers_and_explicit_matmul_gradient_match(tiny_checkpoints):
    """model.scan_layers=False gives the scanned model's logits and gradients, and `dense`'s
    hand-written backward gives autodiff's gradients of the plain einsum."""
    from flax import nnx

    from stare_jax.models.decoder import dense

    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(9, 5, 2), seed=1)
    scanned = from_pretrained(tiny_checkpoints["qwen2"]).model
    unrolled = from_pretrained(tiny_checkpoints["qwen2"], scan_layers=False).model
    assert _max_diff(unrolled(ids, mask), scanned(ids, mask), mask) <= 1e-6

    def grads(model):
        loss = lambda m: (m(ids, mask) * mask[..., None]).sum()
        return jax.tree.leaves(nnx.state(nnx.grad(loss)(model), nnx.Param))

    for a, b in zip(grads(unrolled), grads(scanned)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)

    h = jax.random.normal(jax.random.key(0), (3, 5, 8))
    w = jax.random.normal(jax.random.key(1), (8, 6))
    c = jax.random.normal(jax.random.key(2), (3, 5, 6))
    ours = jax.grad(lambda h, w: (dense(h, w, jax.numpy.float32) * c).sum(), argnums=(0, 1))(h, w)
    plain = jax.grad(lambda h, w: (jax.numpy.einsum("btd,df->btf", h, w) * c).sum(), argnums=(0, 1))(h, w)
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_remat_policies_give_the_same_gradients_and_projections_are_not_recomputed(tiny_checkpoints):
    """Rematerialised layers give the plain model's gradients under every `remat_saves` policy;
    "nothing" repeats every matmul of the layer the backward needs (all but the down projection,
    whose output only feeds the residual sum), "mlp" only the attention half's four (q/k/v, scores, weighted sum of values, o), "projections" only attention's two (scores and
    the weighted sum of values), counted in the lowered program."""
    import re

    from flax import nnx

    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(9, 5, 2), seed=1)
    loss = lambda m: (m(ids, mask) * mask[..., None]).sum()  # noqa: E731

    def grads_and_matmuls(**kw):
        model = from_pretrained(tiny_checkpoints["qwen2"], load_tokenizer=False, **kw).model
        graphdef, state = nnx.split(model)
        grad = jax.jit(jax.grad(lambda s: loss(nnx.merge(graphdef, s))))
        matmuls = len(re.findall(r"stablehlo.dot_general", grad.lower(state).as_text()))
        return jax.tree.leaves(nnx.state(nnx.grad(loss)(model), nnx.Param)), matmuls

    plain, n_plain = grads_and_matmuls()
    whole, n_whole = grads_and_matmuls(remat=True)
    mlp, n_mlp = grads_and_matmuls(remat=True, remat_saves="mlp")
    saved, n_saved = grads_and_matmuls(remat=True, remat_saves="projections")
    assert n_saved == n_plain + 2 and n_mlp == n_plain + 4 and n_whole == n_plain + 5, (n_plain, n_saved, n_mlp, n_whole)
    for a, b, c, d in zip(plain, whole, saved, mlp):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(d), np.asarray(a), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="remat_saves"):
        from_pretrained(tiny_checkpoints["qwen2"], load_tokenizer=False, remat=True, remat_saves="dots")


def test_saves_in_only_the_last_layers_split_the_loop_and_keep_the_gradients(tiny_checkpoints):
    """`remat_saves_layers = k` keeps what `remat_saves` names in the last k layers only: the
    gradients equal the plain model's, and the lowered program holds two layer loops, one body of
    each kind (more matmuls in the text than either single-loop program); k = 0 is whole-layer
    remat and k >= depth every layer's, each one loop."""
    import re

    from flax import nnx

    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(9, 5, 2), seed=1)
    loss = lambda m: (m(ids, mask) * mask[..., None]).sum()  # noqa: E731

    def lowered(**kw):
        model = from_pretrained(tiny_checkpoints["qwen2"], load_tokenizer=False, remat=True, **kw).model
        graphdef, state = nnx.split(model)
        text = jax.jit(jax.grad(lambda s: loss(nnx.merge(graphdef, s)))).lower(state).as_text()
        grads = jax.tree.leaves(nnx.state(nnx.grad(loss)(model), nnx.Param))
        return grads, len(re.findall(r"stablehlo.dot_general", text)), len(re.findall(r"stablehlo.while", text))

    plain = jax.tree.leaves(nnx.state(nnx.grad(loss)(
        from_pretrained(tiny_checkpoints["qwen2"], load_tokenizer=False).model), nnx.Param))
    whole, n_whole, loops_whole = lowered()
    mlp, n_mlp, loops_mlp = lowered(remat_saves="mlp")
    split, n_split, loops_split = lowered(remat_saves="mlp", remat_saves_layers=1)
    none_kept, n_none, _ = lowered(remat_saves="mlp", remat_saves_layers=0)
    all_kept, n_all, _ = lowered(remat_saves="mlp", remat_saves_layers=5)
    assert (n_none, n_all) == (n_whole, n_mlp)
    assert n_split > n_whole > n_mlp, (n_split, n_whole, n_mlp)  # a scanned body's matmuls appear once
    assert loops_split == 2 * loops_whole and loops_mlp == loops_whole, (loops_split, loops_whole, loops_mlp)
    for grads in (whole, mlp, split, none_kept, all_kept):
        for a, b in zip(grads, plain):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="remat_saves_layers"):
        from_pretrained(tiny_checkpoints["qwen2"], load_tokenizer=False, remat=True, remat_saves_layers=-2)


def test_rope_table_rows_equal_the_direct_angles(tiny_checkpoints):
    """`rope_angles` read from a `rope_table` gives bitwise the angles computed from the positions
    (the table is an optimisation), under jit, for each family's RoPE scaling."""
    import jax.numpy as jnp

    from stare_jax.models.decoder import rope_angles, rope_table

    positions = jnp.asarray(np.random.RandomState(0).randint(0, 40, (3, 7)), jnp.int32)
    for name in ("llama", "qwen2", "qwen3"):
        cfg = from_pretrained(tiny_checkpoints[name], load_tokenizer=False).model.config
        direct = jax.jit(lambda p: rope_angles(cfg, p))(positions)
        looked_up = jax.jit(lambda p: rope_angles(cfg, p, rope_table(cfg, 40)))(positions)
        for a, b in zip(direct, looked_up):
            assert a.shape == (3, 7, cfg.head_dim // 2)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hand_written_norm_and_bias_gradients_match_autodiff():
    """`rms_norm` and `dense_bias` have hand-written backward passes (weight and bias gradients as
    matmul column sums); they equal autodiff of the plain formulas, in float32 and bfloat16."""
    import jax.numpy as jnp

    from stare_jax.models.decoder import dense_bias, rms_norm

    def plain_norm(x, w, eps=1e-6):
        xf = x.astype(jnp.float32)
        return w.astype(x.dtype) * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype)

    keys = jax.random.split(jax.random.key(3), 6)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        x = (3.0 * jax.random.normal(keys[0], (4, 7, 16))).astype(dtype)
        w = (1.0 + 0.1 * jax.random.normal(keys[1], (16,))).astype(dtype)
        c = jax.random.normal(keys[2], (4, 7, 16)).astype(dtype)
        np.testing.assert_array_equal(np.asarray(rms_norm(x, w, 1e-6), np.float32),
                                      np.asarray(plain_norm(x, w), np.float32))
        ours = jax.grad(lambda x, w: (rms_norm(x, w, 1e-6).astype(jnp.float32) * c).sum(), argnums=(0, 1))(x, w)
        # The reference runs in float32 on the same (rounded) inputs: autodiff in bfloat16 would sum
        # the weight gradient in bfloat16, less exactly than the float32 column sum does.
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        ref = jax.grad(lambda x, w: (plain_norm(x, w) * f32(c)).sum(), argnums=(0, 1))(f32(x), f32(w))
        for a, b in zip(ours, ref):
            scale = float(np.abs(np.asarray(b)).max())
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), rtol=tol, atol=tol * scale)

    h = jax.random.normal(keys[3], (3, 5, 8))
    wb = jax.random.normal(keys[4], (8, 6))
    b = jax.random.normal(keys[5], (6,))
    c = jax.random.normal(keys[2], (3, 5, 6))
    ours = jax.grad(lambda h, w, b: (dense_bias(h, w, b, jnp.float32) * c).sum(), argnums=(0, 1, 2))(h, wb, b)
    ref = jax.grad(lambda h, w, b: ((jnp.einsum("btd,df->btf", h, w) + b) * c).sum(), argnums=(0, 1, 2))(h, wb, b)
    for a, r in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_bfloat16_projection_rounds_once_with_a_float32_weight_gradient(monkeypatch):
    """`project` in bfloat16: float32 accumulation and one rounding (the float32 product cast to
    bfloat16, bit for bit). Where the product rounds its own result (an accelerator; here with
    `CPU_FLOAT32_PRODUCTS` off, as in the dry run) no float32 [..., F] array is made and cast; on a
    CPU backend the product returns float32 and is cast after it (`product_dtype`: that form
    reaches YNNPACK's bf16 kernels), with the same values. The float32 weight's gradient is
    accumulated and returned in float32 (not rounded through bfloat16), with or without a bias; in
    float32 nothing is cast at all."""
    import jax.numpy as jnp

    from stare_jax.models import products
    from stare_jax.models.decoder import project

    keys = jax.random.split(jax.random.key(5), 4)
    h = jax.random.normal(keys[0], (3, 5, 64)).astype(jnp.bfloat16)
    w = 0.1 * jax.random.normal(keys[1], (64, 48))
    b = jax.random.normal(keys[2], (48,))
    c = jax.random.normal(keys[3], (3, 5, 48)).astype(jnp.bfloat16)
    want = jnp.einsum("btd,df->btf", h, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    assert jax.default_backend() == "cpu" and products.product_dtype(jnp.bfloat16) == jnp.float32
    assert products.product_dtype(jnp.float32) == jnp.float32
    for on_cpu in (True, False):
        monkeypatch.setattr(products, "CPU_FLOAT32_PRODUCTS", on_cpu)
        y = project(h, w, None, jnp.bfloat16)
        assert y.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32))
        jaxpr = str(jax.make_jaxpr(lambda h, w: project(h, w, None, jnp.bfloat16))(h, w))
        if on_cpu:
            assert "preferred_element_type=float32" in jaxpr and "f32[3,5,48]" in jaxpr
        else:
            assert "preferred_element_type=bfloat16" in jaxpr and "f32[3,5,48]" not in jaxpr
        for bias in (None, b):
            dh, dw = jax.grad(lambda h, w: (project(h, w, bias, jnp.bfloat16).astype(jnp.float32) * c).sum(),
                              argnums=(0, 1))(h, w)
            exact = jnp.einsum("btd,btf->df", h.astype(jnp.float32), c.astype(jnp.float32))
            assert dw.dtype == jnp.float32 and dh.dtype == jnp.bfloat16
            np.testing.assert_allclose(np.asarray(dw), np.asarray(exact), rtol=1e-5, atol=1e-5)
            # the bfloat16 rounding of the weight gradient the cast-then-project form made is gone
            assert float(jnp.abs(dw - dw.astype(jnp.bfloat16).astype(jnp.float32)).max()) > 0
            dh_want = jnp.einsum("btf,df->btd", c, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
            np.testing.assert_array_equal(np.asarray(dh, np.float32),
                                          np.asarray(dh_want.astype(jnp.bfloat16), np.float32))
    f32 = str(jax.make_jaxpr(lambda h, w: project(h, w, None, jnp.float32))(h.astype(jnp.float32), w))
    assert "convert_element_type" not in f32


def test_swiglu_backward_matches_autodiff():
    """`swiglu` recomputes sigmoid(g) in its hand-written backward; values and the gradient of
    gate_up equal autodiff of silu(g) * u, in float32 and bfloat16, also under jit."""
    import jax.numpy as jnp

    from stare_jax.models.decoder import swiglu

    def plain(gu):
        g, u = jnp.split(gu.astype(jnp.float32), 2, axis=-1)
        return jax.nn.silu(g) * u

    k1, k2 = jax.random.split(jax.random.key(5))
    for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        gu = (4.0 * jax.random.normal(k1, (3, 5, 2 * 12))).astype(dtype)
        c = jax.random.normal(k2, (3, 5, 12))
        np.testing.assert_allclose(np.asarray(swiglu(gu), np.float32), np.asarray(plain(gu).astype(dtype), np.float32),
                                   rtol=tol, atol=tol)
        ours = jax.jit(jax.grad(lambda gu: (swiglu(gu).astype(jnp.float32) * c).sum()))(gu)
        ref = jax.grad(lambda gu: (plain(gu) * c).sum())(gu.astype(jnp.float32))
        assert ours.dtype == dtype and ours.shape == gu.shape
        scale = float(np.abs(np.asarray(ref)).max())
        np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(ref), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("R", [5, 64, 128])
def test_grouped_response_attention_matches_plain_softmax_and_gradients(R):
    """`grouped_response_attention` (head-major, blockwise causal, hand-written VJP) equals the plain
    formula softmax([q k_p^T, q k_r^T] / sqrt(hd) + masks) [v_p; v_r] and its autodiff gradients,
    with padded prompts, responses masked after an early EOS, 1, 2 and 4 query blocks, and in
    bfloat16 within bfloat16 rounding."""
    import jax.numpy as jnp

    from stare_jax.models.attention import grouped_response_attention, query_blocks

    assert [query_blocks(n) for n in (5, 64, 96, 128, 256, 1024)] == [1, 2, 2, 4, 8, 8]
    B, G, P, K, Q, hd = 2, 3, 5, 2, 2, 8
    N, H = B * G, K * Q
    rs = np.random.RandomState(R)
    q, kr, vr = (jnp.asarray(rs.randn(N, R, n, hd), jnp.float32) for n in (H, K, K))
    kp, vp = (jnp.asarray(rs.randn(B, P, K, hd), jnp.float32) for _ in range(2))
    prompt_mask = np.ones((B, P), bool)
    prompt_mask[0, :2] = False
    response_mask = np.ones((N, R), bool)
    response_mask[1, R // 2:] = False
    prompt_bias = jnp.where(prompt_mask, 0.0, -1e30).astype(jnp.float32)
    causal = np.arange(R)[None, :] <= np.arange(R)[:, None]
    response_bias = jnp.where(causal[None] & response_mask[:, None, :], 0.0, -1e30).astype(jnp.float32)

    def plain(q, kp, vp, kr, vr):
        kp_rows, vp_rows = (jnp.repeat(x, G, axis=0) for x in (kp, vp))          # [N, P, K, hd]
        keys = jnp.repeat(jnp.concatenate([kp_rows, kr], 1), Q, axis=2)           # [N, P+R, H, hd]
        values = jnp.repeat(jnp.concatenate([vp_rows, vr], 1), Q, axis=2)
        bias = jnp.concatenate([jnp.broadcast_to(jnp.repeat(prompt_bias, G, 0)[:, None, :], (N, R, P)),
                                response_bias], axis=-1)                        # [N, R, P+R]
        s = jnp.einsum("nthd,nshd->nhts", q, keys) * hd ** -0.5 + bias[:, None]
        return jnp.einsum("nhts,nshd->nthd", jax.nn.softmax(s, axis=-1), values)

    weights = jnp.asarray(rs.randn(N, R, H, hd), jnp.float32)
    args = (q, kp, vp, kr, vr)
    ours = jax.jit(lambda *a: grouped_response_attention(*a, prompt_bias, response_bias))
    np.testing.assert_allclose(np.asarray(ours(*args)), np.asarray(plain(*args)), atol=1e-5)
    loss = lambda f: jax.jit(jax.grad(lambda *a: (f(*a) * weights).sum(), argnums=range(5)))  # noqa: E731
    for got, want in zip(loss(ours)(*args), loss(plain)(*args)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4 * float(jnp.abs(want).max()))
    low = ours(*(a.astype(jnp.bfloat16) for a in args))
    assert low.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(low), np.asarray(plain(*args)), atol=5e-2)
    low_grads = loss(ours)(*(a.astype(jnp.bfloat16) for a in args))
    assert [g.dtype for g in low_grads] == [jnp.bfloat16] * 5


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_grouped_forward_matches_the_repeated_prompt_forward(tiny_checkpoints, name, scan_layers):
    """`grouped_hidden_states` (each prompt once, its G responses attending to it) equals
    `hidden_states` over the batch with every prompt repeated G times, on left-padded prompts and
    responses that end early (masked tail)."""
    from stare_jax.models.decoder import positions_from_mask

    model = from_pretrained(tiny_checkpoints[name], scan_layers=scan_layers).model
    prompt_ids, prompt_mask, _ = hf_fixtures.left_padded_batch(lengths=(7, 3, 1), total=7, seed=2)
    G, R = 3, 64  # two causal query blocks in the responses' attention
    rs = np.random.RandomState(3)
    response_mask = np.ones((3 * G, R), np.int64)
    response_mask[1, 2:] = 0
    response_mask[4, 1:] = 0
    response_ids = np.where(response_mask > 0, rs.randint(3, hf_fixtures.VOCAB, (3 * G, R)), 0)
    ids = np.concatenate([np.repeat(prompt_ids, G, 0), response_ids], 1)
    mask = np.concatenate([np.repeat(prompt_mask, G, 0), response_mask], 1)
    full, _ = model.hidden_states(ids, positions_from_mask(mask), mask)
    prompt_h, response_h = model.grouped_hidden_states(prompt_ids, prompt_mask, response_ids, response_mask)
    assert prompt_h.shape == (3, 7, full.shape[-1]) and response_h.shape == (3 * G, R, full.shape[-1])
    full = np.asarray(full)
    assert _max_diff(response_h, full[:, 7:], response_mask) <= 1e-5
    assert _max_diff(prompt_h, full[::G, :7], prompt_mask) <= 1e-5
    with pytest.raises(ValueError, match="groups"):
        model.grouped_hidden_states(prompt_ids, prompt_mask, response_ids[:-1], response_mask[:-1])


def test_sharded_forward_matches_single_device(tiny_checkpoints):
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(9, 5, 2, 7), seed=3)
    single = from_pretrained(tiny_checkpoints["qwen3"])
    sharded = from_pretrained(tiny_checkpoints["qwen3"], mesh=mesh)
    m = sharded.model
    # The arrays really are sharded as PARAM_RULES say.
    # vocab 97 is not divisible by tensor=2, so the embedding rule falls back to fsdp only.
    assert m.embed[...].sharding.spec == P(None, "fsdp")
    assert m.layers.wq[...].sharding.spec == P(None, "fsdp", "tensor")
    assert m.layers.wo[...].sharding.spec == P(None, "tensor", "fsdp")
    assert m.layers.w_down[...].sharding.spec == P(None, "tensor", "fsdp")
    assert m.lm_head[...].sharding.spec == P("fsdp", None)
    assert all(axis is None for axis in m.layers.q_norm[...].sharding.spec)  # replicated
    shard_shape = m.layers.w_gate[...].addressable_shards[0].data.shape
    assert shard_shape == (2, 32 // 2, 48 // 2)
    batch = parallel.shard_batch({"ids": ids, "mask": mask}, mesh)
    out = sharded(batch["ids"], batch["mask"])
    ref = single(ids, mask)
    assert _max_diff(out, ref, mask) <= 1e-5


def test_partition_rule_falls_back_when_not_divisible():
    mesh = parallel.make_mesh(data=1, fsdp=2, tensor=4)
    assert parallel.spec_for_param("layers/wq", (2, 6, 8), mesh) == P(None, "fsdp", "tensor")
    assert parallel.spec_for_param("layers/wq", (2, 5, 6), mesh) == P(None, None, None)
    assert parallel.spec_for_param("opt_state/0/mu/layers/wq", (2, 6, 8), mesh) == P(None, "fsdp", "tensor")


def test_missing_and_misshapen_tensors_are_named(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["qwen2"]
    reader = SafetensorsReader([os.path.join(src, "model.safetensors")])
    tensors = {k: np.array(reader.get(k)) for k in reader.keys()}
    cfg = open(os.path.join(src, "config.json")).read()

    def write(name, ts):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(cfg)
        write_file(str(d / "model.safetensors"), ts)
        return str(d)

    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(CheckpointFormatError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*missing"):
        from_pretrained(write("missing", missing))
    bad = dict(tensors)
    bad["model.layers.0.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(CheckpointFormatError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*shape"):
        from_pretrained(write("bad", bad))
    extra = dict(tensors, **{"model.layers.0.self_attn.extra.weight": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointFormatError, match="unexpected"):
        from_pretrained(write("extra", extra))
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    (trunc / "config.json").write_text(cfg)
    blob = open(os.path.join(src, "model.safetensors"), "rb").read()
    (trunc / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="past the end|truncated"):
        from_pretrained(str(trunc))


def test_a_damaged_config_json_is_named_with_its_cause(tiny_checkpoints, tmp_path):
    """`load_config`: a config.json that is not JSON, not an object, or has a malformed or missing
    field raises ModelDirectoryError naming the file; an unsupported architecture keeps its own error."""
    from stare_jax.models import MODEL_INPUT_ERRORS, ModelDirectoryError, load_config

    cfg = json.load(open(os.path.join(tiny_checkpoints["qwen2"], "config.json")))
    cases = [("{bad", ModelDirectoryError, "cannot be read as JSON"), ("[1]", ModelDirectoryError, "not a JSON object"),
             (json.dumps(dict(cfg, num_attention_heads="abc")), ModelDirectoryError, "malformed.*'abc'"),
             (json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}), ModelDirectoryError, "hidden_size"),
             (json.dumps(dict(cfg, architectures=["GPT2LMHeadModel"])), UnsupportedModelError, "GPT2LMHeadModel")]
    for i, (text, error, match) in enumerate(cases):
        d = tmp_path / f"m{i}"
        d.mkdir()
        (d / "config.json").write_text(text)
        with pytest.raises(error, match=match) as info:
            load_config(str(d))
        assert isinstance(info.value, MODEL_INPUT_ERRORS)
        assert error is UnsupportedModelError or str(d / "config.json") in str(info.value)
        assert "\n" not in str(info.value)
