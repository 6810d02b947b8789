"""Chunked log-probs / entropy against the naive full-vocabulary computation, the quadrant
diagnostics on a toy softmax policy, and the memory footprint of the compiled update step."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from stare_jax import parallel
from stare_jax.models import Decoder, ModelConfig
from stare_jax.rl import create_train_state, logprobs, make_update_step
from stare_jax.rl.diagnostics import QUADRANTS, quadrant_diagnostics, quadrant_masks
from stare_jax.rl.logprobs import naive_token_stats, token_stats
from stare_jax.rl.stare import stare_weights


@pytest.mark.parametrize("chunk,temperature", [(16, 1.0), (32, 0.7), (97, 1.0), (1000, 1.3)])
def test_chunked_matches_naive_values_and_gradients(chunk, temperature):
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (3, 7, 8)) * 1.5
    w = jax.random.normal(k[1], (8, 97))  # 97 is prime: no chunk size divides it
    t = jax.random.randint(k[2], (3, 7), 0, 97)
    got = jax.jit(lambda h, w: token_stats(h, w, t, chunk_size=chunk, temperature=temperature, with_pi2=True))(h, w)
    want = naive_token_stats(h @ w, t, temperature=temperature)
    for name, a, b in zip(("log_probs", "entropy", "pi2_dev"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5, err_msg=name)

    def objective(stats):
        return jnp.sum(0.3 * stats.log_probs - 0.7 * stats.entropy)
    g_chunk = jax.jit(jax.grad(lambda h, w: objective(token_stats(h, w, t, chunk_size=chunk,
                                                                   temperature=temperature)), (0, 1)))(h, w)
    g_naive = jax.grad(lambda h, w: objective(naive_token_stats(h @ w, t, temperature=temperature)), (0, 1))(h, w)
    for a, b in zip(g_chunk, g_naive):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)


def test_quadrant_diagnostics_predict_the_entropy_change_of_an_sgd_step():
    """Toy softmax policy (logits z as parameters, one sampled token per position): after a small SGD
    step on -(1/N) sum w A log pi, each quadrant's measured entropy change has the predicted sign,
    and the total is within 10% of the prediction."""
    T, V = 400, 12
    rs = np.random.RandomState(0)
    z = rs.randn(T, V).astype(np.float32) * 1.5
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    tokens = np.array([rs.choice(V, p=row) for row in p], np.int32)
    adv = (rs.choice([-1.0, 1.0], T) * rs.uniform(0.5, 1.5, T)).astype(np.float32)
    mask = np.ones(T, np.float32)

    stats = token_stats(jnp.asarray(z)[None], jnp.eye(V), jnp.asarray(tokens)[None], chunk_size=5, with_pi2=True)
    weights = stare_weights(stats.log_probs, adv[None], mask[None], top_p_ratio=0.3, w=1.5, m=0.5, variant="C2",
                            gate_on=True)
    diag = quadrant_diagnostics(stats.log_probs, stats.entropy, stats.pi2_dev, adv[None], weights, mask[None])
    assert abs(sum(float(diag[f"quad_{q}_frac"]) for q in QUADRANTS) - 1.0) < 1e-6

    def loss(z):
        lp = jax.nn.log_softmax(z, -1)[jnp.arange(T), tokens]
        return -jnp.sum(weights[0] * adv * lp) / T

    eta = 0.02 * T  # moves each position's logits by about 0.02
    z_new = z - eta * np.asarray(jax.grad(loss)(jnp.asarray(z)))
    dh = np.asarray(naive_token_stats(jnp.asarray(z_new), tokens).entropy - naive_token_stats(jnp.asarray(z),
                                                                                              tokens).entropy)
    quads = quadrant_masks(stats.log_probs[0], stats.entropy[0], adv, mask)
    for q in QUADRANTS:
        measured = dh[np.asarray(quads[q])].sum()  # summed over the quadrant's positions
        predicted = eta * float(diag[f"quad_{q}_dH"])
        assert np.sign(measured) == np.sign(predicted) != 0, (q, measured, predicted)
    measured_total = dh.sum()
    predicted_total = eta * float(diag["quad_total_dH"])
    assert abs(measured_total - predicted_total) <= 0.1 * abs(predicted_total), (measured_total, predicted_total)
    # the majority quadrants lower (A>0, low s) and raise (A<0, low s) the entropy, as in DESIGN.md
    assert float(diag["quad_pos_low_dH"]) < 0 < float(diag["quad_neg_low_dH"])
    assert float(diag["quad_pos_high_dH"]) > 0 > float(diag["quad_neg_high_dH"])


def _largest_arrays(hlo_text: str):
    """(element count, text) of every array shape in an HLO module, largest first."""
    found = []
    for m in re.finditer(r"\b(f64|f32|bf16|f16|s32|u32|pred)\[([0-9,]*)\]", hlo_text):
        dims = [int(d) for d in m.group(2).split(",") if d]
        found.append((int(np.prod(dims)) if dims else 1, m.group(0)))
    return sorted(set(found), reverse=True)


def test_compiled_update_step_never_holds_full_vocabulary_logits():
    V, B, T, P_len, chunk = 151_936, 8, 1024, 16, 8192
    cfg = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=V, hidden_size=16, intermediate_size=32,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    config = ml_collections.ConfigDict({"loss": {"name": "stare"}, "model": {"vocab_chunk": chunk},
                                        "rollout": {"group_size": 8}})
    mesh = parallel.make_mesh(devices=jax.devices()[:1])  # per-device = global sizes: the strictest check
    abstract = nnx.eval_shape(lambda: create_train_state(Decoder(cfg, rngs=nnx.Rngs(0)), config))
    step = make_update_step(config, mesh, abstract)
    S = jax.ShapeDtypeStruct
    batch = dict(input_ids=S((B, P_len + T), jnp.int32), attention_mask=S((B, P_len + T), jnp.int32),
                 response_mask=S((B, T), jnp.float32), old_log_probs=S((B, T), jnp.float32),
                 rewards=S((B,), jnp.float32))
    compiled = step.lower(nnx.state(abstract), batch, jax.eval_shape(lambda: jax.random.key(0))).compile()
    mem = compiled.memory_analysis()
    full = B * T * V
    print(f"\nupdate step V={V} B={B} T={T} chunk={chunk}: argument {mem.argument_size_in_bytes / 2**20:.1f} MiB, "
          f"output {mem.output_size_in_bytes / 2**20:.1f} MiB, alias {mem.alias_size_in_bytes / 2**20:.1f} MiB, "
          f"temp {mem.temp_size_in_bytes / 2**20:.1f} MiB (CPU estimate); one f32 [B,T,V] would be "
          f"{full * 4 / 2**20:.1f} MiB")
    largest = _largest_arrays(compiled.as_text())
    print(f"largest HLO arrays: {largest[:3]}")
    assert largest[0][0] < full, largest[0]
    assert largest[0][0] <= B * T * chunk, largest[0]  # at most one chunk of logits
    # parameters + Adam moments + batch are the only arguments: no logits-sized input either
    assert mem.argument_size_in_bytes < 0.2 * full * 4
    assert mem.temp_size_in_bytes < full * 4


@pytest.mark.parametrize("with_pi2", [False, True])
def test_cpu_moments_run_as_single_output_reductions_with_the_one_reduce_sums(with_pi2):
    """XLA:CPU does not vectorise a multi-output reduce, so on the CPU the chunk's moments are one
    reduce per sum; the sums equal the one variadic reduce's to float32 rounding."""
    z = 4.0 * jax.random.normal(jax.random.key(3), (64, 384), jnp.float32)
    m = jnp.max(z, axis=1)
    cpu = jax.jit(lambda z, m: logprobs._moments(z, m, with_pi2)).lower(z, m).compile()
    one = jax.jit(lambda z, m: logprobs._moments_one_reduce(z, m, with_pi2))(z, m)
    got = cpu(z, m)
    assert len(got) == len(one) == (4 if with_pi2 else 2)
    for a, b in zip(got, one):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=0)
    hlo = cpu.as_text()
    roots = re.findall(r"ROOT %\S+ = (\([^)]*\)|\S+) reduce\(", hlo)
    assert len(roots) >= len(got), roots  # each sum its own reduce ...
    assert not [r for r in roots if r.startswith("(")], roots  # ... none with several outputs


@pytest.mark.parametrize("chunk", [32, 97])
def test_bfloat16_compute_matches_float32_within_bf16_rounding(chunk):
    """compute_dtype=bfloat16 (the bf16 switch): the logits matmuls in bf16 with float32 accumulation
    give values and gradients within bf16 rounding of the float32 ones, in the inputs' dtypes."""
    k = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(k[0], (2, 5, 16))
    w = jax.random.normal(k[1], (16, 97)) * 0.3
    t = jax.random.randint(k[2], (2, 5), 0, 97)

    def run(h, w, dtype):
        f = lambda h, w: token_stats(h, w, t, chunk_size=chunk, compute_dtype=dtype)  # noqa: E731
        stats = jax.jit(f)(h, w)
        grads = jax.jit(jax.grad(lambda h, w: jnp.sum(f(h, w).log_probs - 0.5 * f(h, w).entropy), (0, 1)))(h, w)
        return stats, grads
    (s32, g32), (s16, g16) = run(h, w, None), run(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16), jnp.bfloat16)
    assert g16[0].dtype == g16[1].dtype == jnp.bfloat16 and s16.log_probs.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(s16.log_probs), np.asarray(s32.log_probs), atol=0.05)
    np.testing.assert_allclose(np.asarray(s16.entropy), np.asarray(s32.entropy), atol=0.05)
    for a, b in zip(g16, g32):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), atol=0.05 * float(jnp.abs(b).max()))


def _while_computations(hlo: str) -> dict:
    """name -> text of every computation that some while loop of `hlo` uses as its body or its
    condition (evaluated every trip too), followed by the text of the fused computations it calls
    (`calls=`), so an op fused away is still found."""
    loops = {name for part in ("body", "condition") for name in re.findall(rf"\bwhile\(.*?\b{part}=%?([\w.\-]+)", hlo)}
    comps, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" " * 2):
            name, lines = head.group(1), []
        elif line.strip() == "}" and name is not None:
            comps[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)

    def with_called(name, seen):
        text = comps.get(name, "")
        for called in re.findall(r"\bcalls=%?([\w.\-]+)", text):
            if called not in seen:
                seen.add(called)
                text += "\n" + with_called(called, seen)
        return text

    return {b: with_called(b, {b}) for b in loops}


@pytest.mark.parametrize("chunk", [16, 97 - 40])
def test_data_parallel_dw_partial_sums_match_and_leave_the_loop_free_of_collectives(chunk):
    """On a data-parallel mesh the vocabulary pass's dW is summed per device and reduced once after
    the backward loop: the same gradients as the replicated accumulation (and the naive pass), and
    no all-reduce inside any while loop of the compiled gradient."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = parallel.make_mesh(data=4, devices=jax.devices()[:4])
    partials = parallel.partial_sum_sharding(mesh)
    assert partials is not None and partials.spec == P("data")
    assert parallel.partial_sum_sharding(parallel.make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])) is None
    k = jax.random.split(jax.random.key(1), 3)
    h = jax.device_put(jax.random.normal(k[0], (8, 5, 8)), NamedSharding(mesh, P("data")))
    w = jax.device_put(jax.random.normal(k[1], (8, 97)), NamedSharding(mesh, P()))
    t = jax.device_put(jax.random.randint(k[2], (8, 5), 0, 97), NamedSharding(mesh, P("data")))

    def grad_fn(partials):
        def loss(h, w):
            s = token_stats(h, w, t, chunk_size=chunk, partials=partials)
            return jnp.sum(0.3 * s.log_probs - 0.7 * s.entropy)
        return jax.jit(jax.grad(loss, (0, 1)))

    got, plain = grad_fn(partials)(h, w), grad_fn(None)(h, w)
    want = jax.grad(lambda h, w: jnp.sum(0.3 * naive_token_stats(h @ w, t).log_probs
                                         - 0.7 * naive_token_stats(h @ w, t).entropy), (0, 1))(h, w)
    for a, b, c in zip(got, plain, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=0, atol=1e-5)

    def loop_collectives(partials):
        hlo = grad_fn(partials).lower(h, w).compile().as_text()
        loops = _while_computations(hlo)
        assert loops, "expected the chunked vocabulary loops"
        return sum(len(re.findall(r"\ball-reduce(?:-start)?\(", b)) for b in loops.values())

    assert loop_collectives(None) > 0  # the replicated accumulation all-reduces inside the loop
    assert loop_collectives(partials) == 0


@pytest.mark.parametrize("chunk", [16, 49])
def test_kept_logits_give_the_recomputed_gradients_with_one_product_fewer(chunk):
    """`keep_logits_mb` keeps each chunk's logits for the backward when they fit the bound
    (`kept_logits_mib`): the backward then has one [M, D] x [D, C] product fewer, and the values and
    gradients are the recomputing pass's (to float32 rounding: XLA may fuse the two products
    differently). Just below the bound nothing is kept."""
    V = 97  # prime: the last chunk overlaps an earlier one, whose columns the kept logits mask
    k = jax.random.split(jax.random.key(1), 3)
    h = jax.random.normal(k[0], (3, 7, 8)) * 1.5
    w = jax.random.normal(k[1], (8, V))
    t = jax.random.randint(k[2], (3, 7), 0, V)
    need = logprobs.kept_logits_mib(3, 7, V, chunk)
    assert need == 3 * 7 * (-(-V // chunk) * chunk) * 4 / 2**20

    def run(mb):
        def objective(h, w):
            s = token_stats(h, w, t, chunk_size=chunk, temperature=0.7, keep_logits_mb=mb)
            return jnp.sum(0.3 * s.log_probs - 0.7 * s.entropy), s
        fn = jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))
        return fn(h, w), fn.lower(h, w).as_text().count("stablehlo.dot_general")

    ((_, stats0), grads0), dots0 = run(0)
    ((_, stats_kept), grads_kept), dots_kept = run(need)
    _, dots_below = run(need * 0.999)
    assert dots_kept == dots0 - 1 and dots_below == dots0
    forward_only = [jax.jit(lambda h, w, mb=mb: token_stats(h, w, t, chunk_size=chunk, keep_logits_mb=mb)).lower(h, w)
                    .as_text() for mb in (0, need)]
    assert forward_only[0] == forward_only[1]  # nothing kept without a backward pass
    for a, b in zip(stats0[:2], stats_kept[:2]):  # log-probs and entropy (Q is not asked for)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    want = jax.grad(lambda h, w: jnp.sum(0.3 * naive_token_stats(h @ w, t, temperature=0.7).log_probs
                                         - 0.7 * naive_token_stats(h @ w, t, temperature=0.7).entropy), (0, 1))(h, w)
    for a, b, c in zip(grads_kept, grads0, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=0, atol=1e-5)


def test_kept_logits_bound_divides_by_the_devices_splitting_the_rows_fsdp_included():
    """What a device keeps is its share of the rows: `row_shards` (data x fsdp) divides the bound's
    count, so a bound between one device's share and the whole keeps the logits with the rows split
    and not without; the update passes its mesh's data x fsdp (an FSDP mesh, whose dW has no
    per-device partial sums, counts its devices too)."""
    from stare_jax.rl import update as update_lib
    from tests.test_rl_update import fresh_state, make_config

    V, chunk = 97, 16
    k = jax.random.split(jax.random.key(2), 3)
    h, w = jax.random.normal(k[0], (4, 5, 8)), jax.random.normal(k[1], (8, V))
    t = jax.random.randint(k[2], (4, 5), 0, V)
    share = logprobs.kept_logits_mib(4, 5, V, chunk, 2)
    assert share == logprobs.kept_logits_mib(4, 5, V, chunk) / 2

    def dots(row_shards):
        fn = jax.grad(lambda h, w: jnp.sum(token_stats(h, w, t, chunk_size=chunk, keep_logits_mb=share,
                                                        row_shards=row_shards).log_probs), (0, 1))
        return jax.jit(fn).lower(h, w).as_text().count("stablehlo.dot_general")

    assert dots(2) == dots(1) - 1
    for axes in ({"fsdp": 2}, {"data": 2}):
        mesh = parallel.make_mesh(**axes, devices=jax.devices()[:2])
        assert update_lib._row_shards(fresh_state(make_config(), mesh).model) == 2, axes


def test_kept_logits_bound_counts_a_device_s_rows_and_reaches_the_update_step():
    """The bound is per device (the rows of a data-parallel mesh split the logits); the update step
    takes it from `model.vocab_keep_logits_mb` (its compiled backward loses the recomputing
    product) and gives the same metrics and parameters to float32 rounding; a negative bound is
    refused."""
    from stare_jax.rl import RLSettings
    from tests.test_rl_update import fresh_state, make_batch, make_config, update_once

    mesh = parallel.make_mesh(data=2, devices=jax.devices()[:2])
    assert logprobs.kept_logits_mib(4, 10, 100, 16, 2) == 4 * 10 * 112 * 4 / 2 / 2**20
    assert logprobs.kept_logits_mib(3, 10, 100, 16, 2) == 3 * 10 * 112 * 4 / 2**20  # 3 rows: not split
    assert logprobs.kept_logits_mib(8, 10, 100, 16, 4) == 8 * 10 * 112 * 4 / 4 / 2**20  # data x fsdp = 4

    batch = make_batch()
    dots, metrics, params = {}, {}, {}
    for mb in (0, 1):  # 8 x 6 tokens x 64 columns of float32 split over 2 devices: well under 1 MiB
        config = make_config(**{"model.vocab_keep_logits_mb": mb})
        ts = fresh_state(config, mesh)
        lowered = make_update_step(config, mesh, ts).lower(nnx.state(ts), parallel.shard_batch(batch, mesh),
                                                            jax.random.key(0))
        dots[mb] = lowered.as_text().count("stablehlo.dot_general")
        _, metrics[mb], params[mb] = update_once(config, mesh, batch)
    assert dots[1] < dots[0]
    assert metrics[0].keys() == metrics[1].keys()
    for key in metrics[0]:
        np.testing.assert_allclose(metrics[1][key], metrics[0][key], rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree_util.tree_leaves(params[0]), jax.tree_util.tree_leaves(params[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="vocab_keep_logits_mb"):
        RLSettings.from_config(make_config(**{"model.vocab_keep_logits_mb": -1}))
