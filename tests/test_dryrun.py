"""The dry run (`python -m stare_jax.dryrun`): ahead-of-time compile of a config's sampler and update
step on simulated CPU devices, per-device memory and a fit verdict; the architecture presets; the
paper configs."""

import json
import os
import subprocess
import sys

import pytest

from stare_jax import config as config_lib
from stare_jax import parallel
from stare_jax.models import presets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = os.path.join(ROOT, "configs", "paper")
PAPER_7B = os.path.join(PAPER, "qwen2_5_math_7b_stare.py")

# Each paper config and the device count it targets (its docstring and docs/dryrun.md).
PAPER_TARGETS = {
    "qwen2_5_math_7b_stare.py": 64,
    "qwen2_5_math_7b_grpo.py": 64,
    "r1_distill_qwen_1_5b_long_cot.py": 16,
    "qwen2_5_32b_stare_c2.py": 128,
    "qwen3_8b_stare.py": 64,
}

# The paper's 7B config on the tiny preset, shrunk so that it compiles in seconds; it keeps what
# matters: bf16 compute, remat, FSDP over all devices, gradient accumulation, math data without files.
TINY_ARGS = ["--config", PAPER_7B, "--devices", "8", "--preset", "tiny",
             "--config.data.max_prompt_len=16", "--config.rollout.max_new_tokens=16",
             "--config.data.prompt_batch_size=8", "--config.ppo.grad_accum=2", "--config.model.vocab_chunk=128",
             "--explain", "3"]
# Absurd: a million-token rollout of 512 rows; its KV cache alone is ~32 GiB per device, twice a v5e's 16 GiB.
ABSURD_ARGS = ["--config", os.path.join(ROOT, "configs", "quickstart.py"), "--devices", "8", "--preset", "tiny",
               "--chip", "v5e", "--phases", "rollout", "--strict",
               "--config.data.prompt_batch_size=64", "--config.rollout.max_new_tokens=1000000"]

# The same rollout with 32 refilled decode slots (`rollout.slots`): the dry run compiles the slot
# sampler a run would use, whose KV cache holds 32 rows, not 512.
SLOTS_ARGS = ABSURD_ARGS + ["--config.rollout.slots=32"]


# The tiny 7B-config run as 2 host processes of 4 devices, each decoding its rollouts on 2 of them
# (a data-parallel rollout mesh of 4 devices).
ROLLOUT_MESH_ARGS = [a for a in TINY_ARGS if a not in ("--explain", "3")] + [
    "--phases", "rollout,eval", "--config.mesh.rollout_devices=2", "--processes", "2"]


def _start(args):
    return subprocess.Popen([sys.executable, "-m", "stare_jax.dryrun", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _report(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dry_runs():
    """The four compiling dry runs, started together (one compiles while another traces)."""
    procs = {"tiny": _start(TINY_ARGS), "absurd": _start(ABSURD_ARGS), "rollout_mesh": _start(ROLLOUT_MESH_ARGS),
             "slots": _start(SLOTS_ARGS)}
    return {name: _finish(p) for name, p in procs.items()}


def test_tiny_preset_compiles_both_phases_on_8_devices(dry_runs):
    rc, out, err = dry_runs["tiny"]
    assert rc == 0, err[-3000:]
    report = _report(out)
    assert report["devices"] == 8 and report["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert set(report["phases"]) == {"rollout", "update"}
    for name, phase in report["phases"].items():
        for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes",
                    "peak_bytes", "compile_s"):
            assert key in phase, (name, key)
        assert phase["argument_bytes"] > 0 and phase["peak_bytes"] > 0
    # The update step donates the train state: its output aliases the state argument.
    state = report["state_bytes_per_device"]
    assert report["phases"]["update"]["alias_bytes"] == state["total"]
    assert report["phases"]["rollout"]["resident_other_bytes"] == state["total"] - state["params"]
    # FSDP over 8 devices: each holds between 1/8 and all of the float32 parameters; AdamW's two moments twice that.
    n = presets.num_parameters(presets.preset_config("tiny"))
    assert n * 4 / 8 <= state["params"] < n * 4
    assert state["optimizer"] >= 2 * state["params"]
    assert report["fits"] and not report["tight"]
    assert "lower bound" in out and "FITS" in out
    # 8 responses a prompt in 2 micro-batches: each micro-batch runs a prompt once for its 4 rows
    assert report["shape"]["rows_per_shared_prompt"] == 4 and "each prompt once for its 4 rows" in out
    # --explain: the largest temporary buffers, from XLA's buffer assignment
    biggest = report["phases"]["update"]["largest_temp_buffers"]
    assert 0 < len(biggest) <= 3 and biggest[0]["bytes"] >= biggest[-1]["bytes"] > 0 and "[" in biggest[0]["shape"]


def test_rollout_devices_compile_the_samplers_on_their_own_mesh(dry_runs):
    """mesh.rollout_devices=2 on each of 2 processes (`--processes 2`): both samplers compile on a
    data-parallel mesh of 4 devices, each holding a whole copy of the policy (not an FSDP shard), with
    the whole train state resident; the eval sampler takes both hosts' prompts."""
    rc, out, err = dry_runs["rollout_mesh"]
    assert rc == 0, err[-3000:]
    report, tiny = _report(out), _report(dry_runs["tiny"][1])
    assert report["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert report["rollout_mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
    assert tiny["rollout_mesh"] == tiny["mesh"]
    state = report["state_bytes_per_device"]
    assert state == tiny["state_bytes_per_device"]
    n = presets.num_parameters(presets.preset_config("tiny"))
    for name in ("rollout", "eval"):
        phase = report["phases"][name]
        assert phase["resident_other_bytes"] == state["total"]
        assert phase["argument_bytes"] >= n * 4 > 2 * state["params"]  # a full float32 copy vs an 8th
    assert report["phases"]["rollout"]["argument_bytes"] > tiny["phases"]["rollout"]["argument_bytes"]
    assert "rollout_devices=2" in out


def test_absurd_config_does_not_fit(dry_runs):
    rc, out, err = dry_runs["absurd"]
    assert rc == 3, err[-3000:]  # --strict: compiled, but does not fit
    report = _report(out)
    assert report["fits"] is False and report["chip"] == "v5e"
    assert report["peak_bytes_per_device"] > report["hbm_bytes"]
    assert "DOES NOT FIT" in out
    assert report["phases"]["rollout"]["sampler"].startswith("grouped_rollout")


def test_slots_compile_the_slot_sampler_whose_cache_fits(dry_runs):
    """With `rollout.slots=32` the dry run compiles what the run would, the slot sampler, and the
    absurd million-token rollout fits: its KV cache holds 32 slots instead of the batch's 512 rows."""
    rc, out, err = dry_runs["slots"]
    assert rc == 0, err[-3000:]  # --strict: it fits
    report, absurd = _report(out), _report(dry_runs["absurd"][1])
    rollout = report["phases"]["rollout"]
    assert rollout["sampler"] == ("slot_rollout: 32 refilled decode slots, one loop per device (4 slots over 8 "
                                  "prompts each)") and "slot_rollout" in out
    assert report["fits"] is True and "FITS" in out
    # 4 slots a device instead of 64 rows, in a loop per device (`sampler.rollout_shards`): each device
    # holds its own 64 responses' [64, R] outputs, not the whole [512, R] (6.7 GiB a device when
    # every device held all of them; 10.6 GiB before that, with a replicated [R, N] array of
    # sampling uniforms). What remains is mostly the device's share of the result itself (1.3 GB).
    assert 4 * rollout["peak_bytes"] < absurd["phases"]["rollout"]["peak_bytes"] and rollout["peak_bytes"] < 4 * 2**30


@pytest.mark.parametrize("args, key", [
    (["--devices", "8", "--preset", "gpt-17"], "model.preset"),       # unknown preset
    (["--devices", "6"], "data.prompt_batch_size"),                    # 512 rows over 6 devices
    (["--devices", "8", "--config.stare.variant=O3"], "stare.variant"),  # ordinary config error
])
def test_config_errors_exit_2_naming_the_key(args, key):
    rc, out, err = _finish(_start(["--config", PAPER_7B, *args]), timeout=120)
    assert rc == 2, (out, err)
    assert key in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, message", [
    (["--hbm-gib", "0"], "--hbm-gib must be a number of GiB > 0"),  # divided by: a ZeroDivisionError once
    (["--hbm-gib", "-1"], "--hbm-gib must be a number of GiB > 0"),
    (["--hbm-gib", "nan"], "--hbm-gib must be a number of GiB > 0"),
    (["--explain", "-2"], "--explain must be >= 0"),
])
def test_bad_dry_run_flags_exit_2_naming_them(capsys, flags, message):
    from stare_jax import dryrun

    with pytest.raises(SystemExit) as exc:
        dryrun.parse_args(["--config", PAPER_7B, "--devices", "8", *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_dry_run_devices_take_the_accelerator_forms():
    """`force_cpu_devices` (the dry run's start, before JAX initialises) gives the CPU backend the
    requested devices and turns the CPU backend's product forms off
    (`products.CPU_FLOAT32_PRODUCTS`), so its compiles stand in for an accelerator's programs: a
    bfloat16 projection rounds its own product; in a plain process on a CPU it returns float32."""
    probe = ("from stare_jax.models import products\n{}import jax, jax.numpy as jnp\n"
             "print(jax.device_count(), products.CPU_FLOAT32_PRODUCTS, jnp.dtype(products.product_dtype(jnp.bfloat16)).name)")
    lines = {}
    for name, start in (("dry run", "from stare_jax import dryrun\ndryrun.force_cpu_devices(3)\n"), ("plain", "")):
        proc = subprocess.run([sys.executable, "-c", probe.format(start)], cwd=ROOT, text=True, capture_output=True,
                              timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines[name] = proc.stdout.split()
    assert lines["dry run"] == ["3", "False", "bfloat16"], lines
    assert lines["plain"][1:] == ["True", "float32"], lines


def test_sampler_shapes_take_each_phases_sampler_settings():
    """The training sampler takes rollout.slots and rollout.compact_min_rows, the evaluation sampler
    eval.slots (and the rollout's compaction), as the trainer passes them to `generate`; the spec
    `rollout_spec` builds from them never has more slots than rows, and its description says which
    sampler compiles and whether each batch shard runs its own slot loop."""
    import jax

    from stare_jax import dryrun
    from stare_jax.rollout import sampler

    c = config_lib.default_config()
    c.data.prompt_batch_size, c.rollout.group_size, c.eval.n, c.eval.max_prompts = 4, 2, 4, 8
    mesh = parallel.make_mesh(data=8)

    def described(shape, on=None):
        spec = sampler.rollout_spec("float32", {}, rows=shape.prompts * shape.group_size,
                                    group_size=shape.group_size, max_new_tokens=shape.max_new_tokens, eos_ids=(2,),
                                    pad_id=0, mesh=on, slots=shape.slots, compact_min_rows=shape.compact_min_rows)
        return sampler.describe(spec, shape.prompts)

    assert described(dryrun.training_sampler_shape(c)) == "grouped_rollout: prefill + KV-cache decode"
    c.rollout.compact_min_rows = 2
    assert "compacting down to 2 rows" in described(dryrun.training_sampler_shape(c))
    c.rollout.slots, c.eval.slots = 64, 16
    train, evaluation = dryrun.training_sampler_shape(c), dryrun.eval_sampler_shape(c, 1)
    assert (train.slots, evaluation.slots) == (64, 16) and evaluation.compact_min_rows == 2
    assert described(train) == "slot_rollout: 8 refilled decode slots"  # 4 prompts x 2 responses
    assert described(train, mesh) == "slot_rollout: 8 refilled decode slots"  # 4 prompts over 8 shards: one queue
    assert described(evaluation) == "slot_rollout: 16 refilled decode slots"  # of 8 prompts x 4
    assert described(evaluation, mesh) == ("slot_rollout: 16 refilled decode slots, one loop per device "
                                           "(2 slots over 1 prompt each)")
    fsdp = parallel.make_mesh(data=2, fsdp=4)  # one program; the line says what each decode step gathers
    assert described(evaluation, fsdp) == ("slot_rollout: 16 refilled decode slots; the weights split over fsdp=4 "
                                           "are gathered in every decode step (mesh.rollout_devices decodes on a "
                                           "copy gathered once per rollout)")
    assert described(train, parallel.make_mesh(data=8)).endswith("slots")  # no gather: not split
    assert jax.device_count() == 8


def test_processes_set_the_configs_host_count_once():
    """`--processes H` becomes distributed.num_processes (which the config checks, the eval batch and
    the rollout mesh read); beside a different --config.distributed.num_processes it is an error."""
    from stare_jax import dryrun

    def error(message):
        raise ValueError(message)

    assert dryrun.with_process_count(["--config.a=1"], 4, error) == [
        "--config.a=1", "--config.distributed.num_processes=4"]
    same = ["--config.distributed.num_processes=4"]
    assert dryrun.with_process_count(same, 4, error) == same
    with pytest.raises(ValueError, match="disagrees"):
        dryrun.with_process_count(["--config.distributed.num_processes=2"], 4, error)
    # 64 prompts of the 7B config are not a multiple of 3 hosts: the config check names the key.
    rc, out, err = _finish(_start(["--config", PAPER_7B, "--devices", "6", "--processes", "3"]), timeout=120)
    assert rc == 2 and "distributed.num_processes (3)" in err, (out, err)
    rc, out, err = _finish(_start(["--config", PAPER_7B, "--devices", "8", "--processes", "2",
                                   "--config.distributed.num_processes=4"]), timeout=120)
    assert rc == 2 and "disagrees" in err, (out, err)


def test_presets_parse_with_published_sizes():
    expected = {"qwen2.5-math-7b": 7.6e9, "qwen2.5-32b": 32.8e9, "deepseek-r1-distill-qwen-1.5b": 1.78e9,
                "qwen3-8b": 8.19e9}
    for name, size in expected.items():
        cfg = presets.preset_config(name)
        assert abs(presets.num_parameters(cfg) / size - 1) < 0.01, name
    q3 = presets.preset_config("Qwen/Qwen3-8B")  # hub ids work too
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 128
    r1 = presets.preset_config("deepseek-r1-distill-qwen-1.5b")
    assert r1.qkv_bias and not r1.tie_word_embeddings and r1.num_kv_heads == 2
    assert presets.preset_config("qwen2.5-math-7b").max_position_embeddings == 1024 + 3072
    with pytest.raises(presets.UnknownPresetError):
        presets.preset_config("gpt-17")


@pytest.mark.parametrize("name", sorted(PAPER_TARGETS))
def test_paper_configs_validate_for_their_target(name):
    c = config_lib.load_config_file(os.path.join(PAPER, name))
    presets.resolve_name(c.model.preset)
    c.model.path = "/models/x"
    c.data.train_files = "/data/train.jsonl"
    config_lib.validate(c, num_devices=PAPER_TARGETS[name])
    # paper defaults
    assert c.optim.lr == 1e-6 and c.optim.weight_decay == 0.01 and c.optim.grad_clip == 1.0
    assert c.data.prompt_batch_size == 64 and c.rollout.group_size == 8 and c.ppo.epochs == 1
    assert c.ppo.num_minibatches == 1 and c.loss.kl_type == "none" and c.loss.entropy_coef == 0.0
    assert c.dynamic_sampling.enabled and c.dynamic_sampling.max_num_gen_batches == 10
    assert c.stare.top_p_ratio == 0.1 and c.stare.target_entropy == 0.3 and c.rollout.temperature == 1.0
    model = presets.preset_config(c.model.preset)
    assert c.data.max_prompt_len + c.rollout.max_new_tokens <= model.max_position_embeddings


def test_paper_config_variants():
    load = lambda n: config_lib.load_config_file(os.path.join(PAPER, n))  # noqa: E731
    stare, grpo = load("qwen2_5_math_7b_stare.py"), load("qwen2_5_math_7b_grpo.py")
    assert stare.loss.name == "stare" and stare.stare.variant == "O1" and stare.stare.w == 1.1
    assert grpo.loss.name == "grpo" and not grpo.stare.enabled
    c2 = load("qwen2_5_32b_stare_c2.py")
    assert (c2.stare.variant, c2.stare.w, c2.stare.m) == ("C2", 1.05, 0.95)
    assert load("r1_distill_qwen_1_5b_long_cot.py").rollout.max_new_tokens >= 8192
