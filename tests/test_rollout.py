"""Acceptance tests of the grouped KV-cache sampler (`stare_jax.rollout.generate`, issue 3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stare_jax import parallel
from stare_jax.models import from_pretrained
from stare_jax.rollout import generate, sampler
from tests import hf_fixtures

EOS = 2
PAD = 0


@pytest.fixture(scope="module")
def policies(tiny_checkpoints):
    """{family: Policy} on one device, loaded from the tiny HF checkpoints."""
    return {name: from_pretrained(path, load_tokenizer=False) for name, path in tiny_checkpoints.items()}


def prompts():
    """A left-padded batch of three prompts of lengths 9, 5 and 2."""
    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(9, 5, 2), total=9)
    return ids.astype(np.int32), mask.astype(np.int32)


def teacher_forced_log_probs(policy, result):
    """log softmax(policy(tokens, attention_mask)) at each response token, [N, R]."""
    logits = policy(result.tokens, result.attention_mask)
    log_probs = jax.nn.log_softmax(logits[:, result.prompt_len - 1:-1], axis=-1)
    return np.asarray(jnp.take_along_axis(log_probs, result.response_ids[..., None], axis=-1)[..., 0])


def assert_stop_semantics(result, eos_ids, pad_id):
    """response_mask is 1 up to and including the first EOS; ids are the pad id and log-probs 0
    after it; truncated means no EOS; tokens/attention_mask are prompt then response."""
    ids, mask = np.asarray(result.response_ids), np.asarray(result.response_mask)
    logps, truncated = np.asarray(result.log_probs), np.asarray(result.truncated)
    R = ids.shape[1]
    for row_ids, row_mask, row_logps, row_truncated in zip(ids, mask, logps, truncated):
        hits = np.flatnonzero(np.isin(row_ids, eos_ids) & (row_mask > 0))
        length = hits[0] + 1 if len(hits) else R
        np.testing.assert_array_equal(row_mask, np.arange(R) < length)
        assert (row_ids[length:] == pad_id).all()
        assert (row_logps[length:] == 0).all() and (row_logps[:length] < 0).all()
        assert bool(row_truncated) == (len(hits) == 0)
    np.testing.assert_array_equal(np.asarray(result.tokens)[:, result.prompt_len:], ids)
    np.testing.assert_array_equal(np.asarray(result.attention_mask)[:, result.prompt_len:], mask)


# 1. Greedy decoding equals transformers' greedy generate.
@pytest.mark.parametrize("family", sorted(hf_fixtures.KINDS))
def test_greedy_matches_transformers(family, tiny_checkpoints, policies):
    import torch
    import transformers

    ids, mask = prompts()
    new_tokens = 32
    result = generate(policies[family], ids, mask, rng=None, group_size=1, max_new_tokens=new_tokens,
                      eos_ids=(EOS,), greedy=True, pad_id=PAD)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints[family], dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                          attention_mask=torch.tensor(mask, dtype=torch.long), do_sample=False,
                          max_new_tokens=new_tokens, eos_token_id=EOS, pad_token_id=PAD)
    expected = out[:, ids.shape[1]:].numpy()
    expected = np.pad(expected, ((0, 0), (0, new_tokens - expected.shape[1])), constant_values=PAD)
    np.testing.assert_array_equal(np.asarray(result.response_ids), expected)
    np.testing.assert_array_equal(np.asarray(result.tokens)[:, :ids.shape[1]], ids)
    assert_stop_semantics(result, (EOS,), PAD)


# 2. Reported log-probs equal a teacher-forced forward pass (temperature 1, whatever the sampling).
@pytest.mark.parametrize("family", sorted(hf_fixtures.KINDS))
def test_log_probs_match_teacher_forcing(family, policies):
    policy = policies[family]
    ids, mask = prompts()
    eos_ids = (EOS, 5, 7, 11, 13)  # frequent enough that some rows stop early
    result = generate(policy, ids, mask, rng=jax.random.key(1), group_size=4, max_new_tokens=16, eos_ids=eos_ids,
                      temperature=0.8, top_k=40)
    truncated = np.asarray(result.truncated)
    assert truncated.any() and not truncated.all(), "want rows that stop early and rows that run to the end"
    response_mask = np.asarray(result.response_mask) > 0
    expected = teacher_forced_log_probs(policy, result)
    np.testing.assert_allclose(np.asarray(result.log_probs)[response_mask], expected[response_mask], atol=1e-4)
    assert_stop_semantics(result, eos_ids, PAD)


@pytest.mark.parametrize("segments", [1, 3, 16])
def test_decode_segments_change_only_rounding(policies, segments):
    """The block-segmented decode loop (one loop per response-cache block) samples the same tokens
    as one loop over the whole cache, rows that stop early included; 16 > R=13 gives 1-slot blocks."""
    policy = policies["qwen2"]
    ids, mask = prompts()
    kw = dict(rng=jax.random.key(3), group_size=4, max_new_tokens=13, eos_ids=(EOS, 5, 7, 11, 13), temperature=0.8)
    ref = generate(policy, ids, mask, decode_segments=1, **kw)
    got = generate(policy, ids, mask, decode_segments=segments, **kw)
    truncated = np.asarray(ref.truncated)
    assert truncated.any() and not truncated.all()
    np.testing.assert_array_equal(np.asarray(got.response_ids), np.asarray(ref.response_ids))
    np.testing.assert_array_equal(np.asarray(got.response_mask), np.asarray(ref.response_mask))
    np.testing.assert_allclose(np.asarray(got.log_probs), np.asarray(ref.log_probs), atol=1e-5)


@pytest.mark.parametrize("family", sorted(hf_fixtures.KINDS))
def test_feature_major_decode_changes_only_rounding(family, policies):
    """The feature-major decode layers (the CPU default: x^T [D, N], W^T @ x^T) sample what the
    row-major layers sample, greedy and at temperature 1 with EOS at varied positions, for every
    architecture (Qwen2's q/k/v biases, Qwen3's q/k norms, Llama's tied embedding)."""
    policy = policies[family]
    ids, mask = prompts()
    assert sampler.feature_major_decode("auto", nnx.split(policy.model)[1])
    for kw in (dict(rng=None, greedy=True), dict(rng=jax.random.key(5), temperature=1.0)):
        kw.update(group_size=4, max_new_tokens=14, eos_ids=(EOS, 5, 7, 11, 13))
        rows = generate(policy, ids, mask, decode_layout="rows", **kw)
        columns = generate(policy, ids, mask, decode_layout="features", **kw)
        truncated = np.asarray(rows.truncated)
        assert truncated.any() and not truncated.all()
        np.testing.assert_array_equal(np.asarray(columns.response_ids), np.asarray(rows.response_ids))
        np.testing.assert_array_equal(np.asarray(columns.response_mask), np.asarray(rows.response_mask))
        np.testing.assert_allclose(np.asarray(columns.log_probs), np.asarray(rows.log_probs), atol=1e-5)
        default = generate(policy, ids, mask, **kw)
        np.testing.assert_array_equal(np.asarray(default.log_probs), np.asarray(columns.log_probs))


def test_segment_bounds_cover_every_slot_once():
    assert sampler.segment_bounds(64, 4) == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert sampler.segment_bounds(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert sampler.segment_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert sampler.segment_bounds(5, 1) == [(0, 5)]


# 3. Sampling follows softmax(logits / T), and top-k / top-p never leave their allowed set.
def _chi_square(counts, expected_probs, min_expected=5.0):
    """Pearson's statistic and degrees of freedom, pooling bins with small expected counts."""
    n = counts.sum()
    expected = expected_probs * n
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def _chi_square_critical(df, z=3.09):
    """Upper 0.1% point of chi-square(df) (Wilson-Hilferty; z = 3.09 for 0.001)."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def _first_token_logits(policy, ids, mask):
    return np.asarray(policy(ids, mask)[0, -1], np.float64)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_sampling_frequencies_match_temperature(policies):
    policy = policies["qwen2"]
    ids, mask = prompts()
    ids, mask = ids[:1], mask[:1]
    logits = _first_token_logits(policy, ids, mask)
    rows = 20000
    result = generate(policy, ids, mask, rng=jax.random.key(7), group_size=rows, max_new_tokens=1,
                      eos_ids=(), temperature=0.7)
    counts = np.bincount(np.asarray(result.response_ids)[:, 0], minlength=logits.size)
    stat, df = _chi_square(counts, _softmax(logits / 0.7))
    assert stat < _chi_square_critical(df), (stat, df)
    wrong, wrong_df = _chi_square(counts, _softmax(logits / 1.0))  # the test has power against T=1
    assert wrong > 5 * _chi_square_critical(wrong_df), (wrong, wrong_df)


def test_top_k_frequencies_and_support(policies):
    policy = policies["qwen3"]
    ids, mask = prompts()
    ids, mask = ids[1:2], mask[1:2]
    logits = _first_token_logits(policy, ids, mask)
    k, rows = 10, 8000
    result = generate(policy, ids, mask, rng=jax.random.key(3), group_size=rows, max_new_tokens=1,
                      eos_ids=(), temperature=1.3, top_k=k)
    counts = np.bincount(np.asarray(result.response_ids)[:, 0], minlength=logits.size)
    allowed = logits >= np.sort(logits)[-k]
    assert counts[~allowed].sum() == 0
    probs = np.where(allowed, _softmax(logits / 1.3), 0.0)
    stat, df = _chi_square(counts, probs / probs.sum())
    assert stat < _chi_square_critical(df), (stat, df)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.6), (8, 0.5)])
def test_filters_never_leave_allowed_set(policies, top_k, top_p):
    """Every sampled token (all steps, all rows) lies in the top-k set and the top-p nucleus of
    the policy's temperature-scaled distribution at its position (from a teacher-forced pass)."""
    policy = policies["llama"]
    ids, mask = prompts()
    temperature = 0.9
    result = generate(policy, ids, mask, rng=jax.random.key(11), group_size=64, max_new_tokens=6, eos_ids=(),
                      temperature=temperature, top_k=top_k, top_p=top_p)
    logits = np.asarray(policy(result.tokens, result.attention_mask)[:, result.prompt_len - 1:-1], np.float64)
    chosen = np.asarray(result.response_ids)[..., None]
    allowed = np.ones(logits.shape, bool)
    if top_k:
        allowed &= logits >= np.sort(logits, axis=-1)[..., -top_k:-top_k + 1]
    if top_p < 1:  # the nucleus of the distribution left by temperature and top-k
        z = np.where(allowed, logits / temperature, -np.inf)
        probs = np.exp(z - z.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        mass_before = (np.where(probs[..., None, :] > probs[..., :, None], probs[..., None, :], 0)).sum(-1)
        allowed &= mass_before < top_p
    assert allowed.sum(-1).max() < hf_fixtures.VOCAB, "the filter must exclude something"
    margin = 1e-5  # a token within float noise of the cut-off is not a violation
    chosen_logit = np.take_along_axis(logits, chosen, axis=-1)
    near_cutoff = np.abs(logits - chosen_logit) < margin
    assert (np.take_along_axis(allowed, chosen, axis=-1) | (near_cutoff & allowed).any(-1, keepdims=True)).all()


@pytest.mark.parametrize("vocab", [1, 5, 97, 3000])
def test_inverse_cdf_matches_linear_search(vocab):
    """The two-level search picks the index a plain cumulative search picks, never a zero weight."""
    from stare_jax.rollout.sampling import inverse_cdf

    rs = np.random.RandomState(vocab)
    weights = (rs.rand(400, vocab) * (rs.rand(400, vocab) > 0.3)).astype(np.float32)
    weights[:, -1] += weights.sum(-1) == 0  # at least one positive weight per row
    uniforms = rs.rand(400).astype(np.float32)
    uniforms[:3] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5]
    got = np.asarray(inverse_cdf(jnp.asarray(weights), jnp.asarray(uniforms)))
    cdf = np.cumsum(weights, axis=-1)
    target = np.minimum(uniforms * cdf[:, -1], np.nextafter(cdf[:, -1], np.float32(0)))
    np.testing.assert_array_equal(got, (cdf <= target[:, None]).sum(-1))
    assert (weights[np.arange(400), got] > 0).all()


# 4. Determinism, group diversity, sharding invariance.
def test_same_key_same_rollout_and_groups_differ(policies):
    policy = policies["qwen2"]
    ids, mask = prompts()
    kwargs = dict(group_size=4, max_new_tokens=12, eos_ids=(EOS,))
    a = generate(policy, ids, mask, rng=jax.random.key(5), **kwargs)
    b = generate(policy.model, ids, mask, rng=jax.random.key(5), **kwargs)  # a bare Decoder works too
    c = generate(policy, ids, mask, rng=jax.random.key(6), **kwargs)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.log_probs), np.asarray(b.log_probs))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    responses = np.asarray(a.response_ids).reshape(len(ids), 4, -1)
    for group in responses:
        assert len({tuple(r) for r in group}) > 1, "members of a group must differ"
    prompts_of_rows = np.asarray(a.tokens)[:, :ids.shape[1]].reshape(len(ids), 4, -1)
    np.testing.assert_array_equal(prompts_of_rows, np.repeat(ids[:, None], 4, axis=1))


def test_sharded_rollout_equals_single_device(tiny_checkpoints, policies):
    assert jax.device_count() == 8
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    sharded = from_pretrained(tiny_checkpoints["qwen3"], mesh=mesh, load_tokenizer=False)
    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(7, 3), total=7)
    kwargs = dict(rng=jax.random.key(9), group_size=4, max_new_tokens=10, eos_ids=(EOS, 5), temperature=0.9,
                  top_p=0.95)
    single = generate(policies["qwen3"], ids, mask, **kwargs)
    multi = generate(sharded, ids, mask, **kwargs)
    assert multi.tokens.sharding.spec[0] == parallel.BATCH_AXES
    assert len(multi.tokens.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(multi.tokens), np.asarray(single.tokens))
    np.testing.assert_array_equal(np.asarray(multi.response_mask), np.asarray(single.response_mask))
    np.testing.assert_allclose(np.asarray(multi.log_probs), np.asarray(single.log_probs), atol=1e-5)
    with pytest.raises(ValueError, match="divisible"):
        generate(sharded, ids, mask, rng=jax.random.key(0), group_size=3, max_new_tokens=2, eos_ids=())


def test_no_eos_fixed_trip_loop_equals_the_early_stop_loop(tiny_checkpoints, policies):
    """Without EOS ids the decode loop runs a fixed number of steps (no all-rows-done check, which
    on a mesh is a cross-device reduction per token); it samples what the early-stop loop samples
    when the EOS id never comes up, on one device and sharded."""
    ids, mask, _ = hf_fixtures.left_padded_batch(lengths=(7, 3), total=7)
    mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
    sharded = from_pretrained(tiny_checkpoints["qwen2"], mesh=mesh, load_tokenizer=False)
    for policy in (policies["qwen2"], sharded):
        kw = dict(rng=jax.random.key(4), group_size=4, max_new_tokens=9, temperature=1.0)
        free = generate(policy, ids, mask, eos_ids=(), **kw)
        unused = next(t for t in range(3, hf_fixtures.VOCAB) if t not in np.asarray(free.response_ids))
        stoppable = generate(policy, ids, mask, eos_ids=(unused,), **kw)
        assert np.asarray(free.truncated).all() and np.asarray(free.response_mask).all()
        np.testing.assert_array_equal(np.asarray(free.response_ids), np.asarray(stoppable.response_ids))
        np.testing.assert_array_equal(np.asarray(free.log_probs), np.asarray(stoppable.log_probs))


# Early stop, masks and compilation reuse.
def test_every_row_stops_at_first_token(policies):
    ids, mask = prompts()
    everything = tuple(range(hf_fixtures.VOCAB))
    result = generate(policies["llama"], ids, mask, rng=jax.random.key(0), group_size=2, max_new_tokens=8,
                      eos_ids=everything, pad_id=PAD)
    expected_mask = np.zeros((6, 8), np.int32)
    expected_mask[:, 0] = 1
    np.testing.assert_array_equal(np.asarray(result.response_mask), expected_mask)
    assert not np.asarray(result.truncated).any()
    assert result.tokens.shape == (6, ids.shape[1] + 8) and result.prompt_len == ids.shape[1]
    assert_stop_semantics(result, everything, PAD)


def test_greedy_stops_at_chosen_eos(policies):
    """With the 3rd greedy token of row 0 declared EOS, row 0 ends there and others at their own first hit."""
    policy = policies["qwen3"]
    ids, mask = prompts()
    free = generate(policy, ids, mask, rng=None, group_size=1, max_new_tokens=10, eos_ids=(), greedy=True)
    free_ids = np.asarray(free.response_ids)
    assert np.asarray(free.truncated).all() and np.asarray(free.response_mask).all()
    eos = int(free_ids[0, 2])
    assert eos not in free_ids[0, :2]
    stopped = generate(policy, ids, mask, rng=None, group_size=1, max_new_tokens=10, eos_ids=(eos,), greedy=True,
                       pad_id=PAD)
    assert np.asarray(stopped.response_mask)[0].tolist() == [1, 1, 1] + [0] * 7
    assert not bool(stopped.truncated[0])
    assert_stop_semantics(stopped, (eos,), PAD)
    masked = np.asarray(stopped.response_mask) > 0
    np.testing.assert_array_equal(np.asarray(stopped.response_ids)[masked], free_ids[masked])


def test_compiled_once_for_new_parameters(policies):
    """Same shapes and settings: new parameter values and keys reuse the compiled rollout."""
    from flax import nnx

    model = policies["qwen2"].model
    ids, mask = prompts()
    kwargs = dict(group_size=2, max_new_tokens=5, eos_ids=(), temperature=1.1)
    first = generate(model, ids, mask, rng=jax.random.key(0), **kwargs)
    traces = sampler.trace_count
    graphdef, state = nnx.split(model)
    perturbed = nnx.merge(graphdef, jax.tree.map(lambda x: x * 1.5, state))
    second = generate(perturbed, ids, mask, rng=jax.random.key(1), **kwargs)
    assert sampler.trace_count == traces
    assert not np.allclose(np.asarray(first.log_probs), np.asarray(second.log_probs))


def test_rejects_bad_settings(policies):
    ids, mask = prompts()
    policy = policies["qwen2"]
    for bad in (dict(temperature=0.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1), dict(group_size=0)):
        kwargs = dict(rng=jax.random.key(0), group_size=2, max_new_tokens=3, eos_ids=()) | bad
        with pytest.raises(ValueError):
            generate(policy, ids, mask, **kwargs)
    with pytest.raises(ValueError, match="rng"):
        generate(policy, ids, mask, rng=None, group_size=2, max_new_tokens=3)
