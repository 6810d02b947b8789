"""Contract 9: `scripts/bench_step.py` runs the full stare-jax step and prints its JSON line last."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.e2e_helpers import ROOT, subprocess_env


def test_bench_step_prints_contract_keys_and_checks_its_workload():
    """The protocol end to end on the smoke workload (the default and --large shapes are checked in
    `test_synthetic_workloads_have_the_documented_shapes`)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), "--steps", "2", "--grpo",
                        "--warmup-rounds", "1", "--smoke"],
                       cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("median_step_s", "median_rollout_s", "median_update_s", "rollout_tokens_per_s", "peak_rss_mb"):
        assert out[key] > 0, key
    assert out["shape"] == {"vocab_size": 1024, "hidden_size": 64, "num_layers": 2, "num_heads": 2,
                            "num_kv_heads": 1, "intermediate_size": 176, "num_prompts": 4, "group_size": 4,
                            "prompt_len": 32, "new_tokens": 16}
    assert out["workload"] == "smoke"
    ours = out["participants"]["stare-jax"]
    assert ours["steps"] == 2 and ours["loss"] == "stare" and out["protocol"] == "alternate"
    assert out["warmup_rounds"] == 1 and len(ours["per_step"]) == 2  # the warm-up round is not timed
    # each timed update's forward against its sampler, held to the trainer's bound (full float32 on a CPU)
    assert all(0 <= st["sampler_approx_kl"] < 1e-3 for st in ours["per_step"]) and "policy_disagreement_steps" not in out
    assert out["matmul_precision"] == ours["matmul_precision"] == "default"
    assert 0 < out["update_mfu"] < 1
    # The framework's own float32 matmul peak and the host it was measured on (ratios depend on both).
    assert ours["matmul_peak_gflops"] == out["matmul_peak_gflops"] > 0
    # read again after the timed rounds, and the MFU against that reading (each rounded to 3 decimals)
    ratio = out["matmul_peak_gflops"] / out["matmul_peak_gflops_after"]
    assert out["matmul_peak_gflops_after"] > 0
    assert out["update_mfu_after"] == pytest.approx(out["update_mfu"] * ratio, abs=5e-4 * (1 + ratio) + 1e-9)
    assert isinstance(out["host_cpu"], str) and out["host_cpu"]
    assert out["median_step_s"] >= out["median_update_s"]
    # Each stage of the worker's start, in order, with its elapsed time (a run cut off during a slow
    # start on an accelerator says where it was).
    stages = [line for line in r.stderr.splitlines() if line.startswith("[stare-jax worker]")]
    names = [s.split(" at ")[0].split("(")[0].split(":")[0].strip() for s in stages]
    # the probes first: the warm-up step's compilations then empty oneTBB's cache of their blocks
    assert names == ["[stare-jax worker] policy loaded on cpu", "[stare-jax worker] bandwidth and matmul peak measured",
                     "[stare-jax worker] first step done"], stages
    assert all(s["step_peak_rss_mb"] > 0 for s in ours["per_step"])
    # the hypervisor's share of the CPU while each timed step ran, beside the whole rounds' share
    assert all(0 <= s["cpu_steal_frac"] <= 1 for s in ours["per_step"]) and 0 <= out["cpu_steal_frac"] <= 1
    assert "speedup_by_round" not in out  # no peer
    # the host's memory over the whole invocation: the worker's anonymous memory (most of its RSS) counts in it
    mem = out["host_memory"]
    assert mem["samples"] >= 2 and 0 <= mem["min_available_mb"] < mem["total_mb"]
    assert mem["peak_used_mb"] == mem["total_mb"] - mem["min_available_mb"]
    assert mem["peak_used_mb"] >= max(s["step_peak_rss_mb"] for s in ours["per_step"]) / 2
    assert all(s.endswith("s") and float(s.rsplit(" at ", 1)[1][:-1]) >= 0 for s in stages)
    # --grpo: the plain-GRPO update is timed on the same batches in the same worker.
    assert out["grpo_median_update_s"] > 0
    assert -1 < out["stare_update_overhead"] < 10 and abs(out["stare_overhead"]) < 10


def test_bench_stare_overhead_times_both_updates_in_one_process():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_stare_overhead.py"), "--rounds", "1",
                        "--smoke"],
                       cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["rounds"] == 1 and out["shape"] == {"hidden_size": 64, "num_layers": 2, "new_tokens": 16}
    assert out["stare_update_s"] > 0 and out["grpo_update_s"] > 0 and out["rollout_s"] > 0
    assert abs(out["step_overhead"]) < 1 and -1 < out["update_overhead"] < 10


def test_bench_stare_overhead_compares_the_cpu_compiler_options():
    """--cpu-options: STARE's update with the shipped CPU compiler options against XLA:CPU's defaults."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_stare_overhead.py"), "--rounds", "1",
                        "--cpu-options", "--smoke"], cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["compared"] == "shipped vs defaults CPU options" and out["host_cpu"]
    assert out["shipped_update_s"] > 0 and out["defaults_update_s"] > 0 and -1 < out["update_overhead"] < 10
    both = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_stare_overhead.py"), "--cpu-options",
                           "--pe-metrics"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "pick one" in both.stderr


def _bench_step_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_step_mod", os.path.join(ROOT, "scripts", "bench_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_host_memory_watch_samples_until_closed(monkeypatch):
    """`HostMemoryWatch` keeps sampling /proc/meminfo until its block ends and reports the lowest
    available memory seen; off Linux (no meminfo) it reports None."""
    bench_step = _load_script("bench_step", "bench_step.py")
    readings = iter([{"total": 1000, "available": 700}, {"total": 1000, "available": 300},
                     {"total": 1000, "available": 600}])
    monkeypatch.setattr(bench_step, "meminfo_mb", lambda: next(readings, {"total": 1000, "available": 650}))
    with bench_step.HostMemoryWatch(interval_s=0.01) as watch:
        while len(watch.samples) < 4:
            time.sleep(0.01)
    n = len(watch.samples)
    time.sleep(0.05)
    assert len(watch.samples) == n  # stopped with the block
    assert watch.summary() == {"total_mb": 1000, "min_available_mb": 300, "peak_used_mb": 700, "samples": n}
    monkeypatch.setattr(bench_step, "meminfo_mb", lambda: None)
    with bench_step.HostMemoryWatch(interval_s=0.01) as watch:
        pass
    assert watch.summary() is None
    assert set(bench_step.meminfo_mb() or {"total": 0, "available": 0}) == {"total", "available"}


def test_step_schedule_alternates_or_runs_blocks():
    """Alternating rounds rotate who goes first and give every participant one step a round;
    blocks run each participant's steps back to back; both time every participant `steps` times."""
    bs = _bench_step_module()
    names = ["stare-jax", "trl", "tunix"]
    alt = bs.step_schedule(names, 4)
    assert alt[:6] == [(0, "stare-jax"), (0, "trl"), (0, "tunix"), (1, "trl"), (1, "tunix"), (1, "stare-jax")]
    assert [alt[3 * r][1] for r in range(4)] == ["stare-jax", "trl", "tunix", "stare-jax"]
    blocks = bs.step_schedule(names, 2, "blocks")
    assert blocks == [(0, "stare-jax"), (1, "stare-jax"), (0, "trl"), (1, "trl"), (0, "tunix"), (1, "tunix")]
    for sched in (alt, blocks):
        assert all(sum(n == m for _, m in sched) == len(sched) // 3 for n in names)
    with pytest.raises(ValueError, match="random"):
        bs.step_schedule(names, 1, "random")


def test_steady_state_leaves_out_the_steps_that_compiled(tmp_path):
    """Steps that compiled a new packed-update bucket are left out of the steady-state medians and
    speed-ups; nothing is added when no step (or every step) compiled; --resummarize adds the same
    fields to a saved result and refuses a missing file with exit 2."""
    bs = _bench_step_module()
    steps = [{"step_s": 11.9, "rollout_s": 0.5, "update_s": 11.4, "compilations": 1},
             {"step_s": 0.7, "rollout_s": 0.52, "update_s": 0.18, "compilations": 0},
             {"step_s": 0.9, "rollout_s": 0.6, "update_s": 0.3, "compilations": 0}]
    result = {"participants": {"stare-jax": {"per_step": steps}, "trl": {"median_step_s": 6.4}}}
    out = bs.steady_state(result)
    assert out["steady_steps"] == 2 and out["compiling_steps"] == 1
    assert out["steady_median_step_s"] == 0.8 and out["steady_median_update_s"] == 0.24
    assert out["steady_speedup"] == {"trl": 8.0}
    for st in steps:
        st["compilations"] = 0
    assert bs.steady_state(result) == {}
    steps[0]["compilations"] = 1
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(result))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), "--resummarize", str(path)],
                          capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steady_median_step_s"] == 0.8
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), "--resummarize",
                           str(tmp_path / "missing.json")], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120)
    assert proc.returncode == 2 and "cannot resummarize" in proc.stderr


def test_host_cpu_names_family_model_and_matmul_isa(tmp_path):
    """The benchmarks' host label tells apart CPUs that share a VM's model name: family and model
    numbers from the first processor's block, and which matmul-relevant ISA flags it exposes."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "bench_peers"))
    import common

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\n"
                    "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n\n"
                    "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: other\nflags\t\t: sse\n")
    assert common.host_cpu(str(info)) == ("Intel(R) Xeon(R) Processor "
                                          "(family 6 model 207; avx2 avx512f avx512_bf16 amx_tile)")
    info.write_text("model name\t: AMD EPYC\nflags\t\t: fpu sse\n")
    assert common.host_cpu(str(info)).startswith("AMD EPYC (none of avx2/")
    assert common.host_cpu(str(tmp_path / "missing")) == "unknown"
    assert isinstance(common.host_cpu(), str) and common.host_cpu()


def test_synthetic_workloads_have_the_documented_shapes(tmp_path):
    """The default and --large workloads are the shapes docs/performance.md reports (the tests run
    the protocol on --smoke); --smoke excludes --large and --model, and checkpoint.py writes each
    workload's random model."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "bench_peers"))
    import checkpoint
    import common

    shape = lambda w: {k: w[k] for k in ("vocab_size", "hidden_size", "num_layers", "num_heads",  # noqa: E731
                                         "num_kv_heads", "intermediate_size", "num_prompts", "group_size",
                                         "prompt_len", "new_tokens")}
    assert shape(common.DEFAULT) == {"vocab_size": 1024, "hidden_size": 256, "num_layers": 4, "num_heads": 4,
                                     "num_kv_heads": 2, "intermediate_size": 688, "num_prompts": 8,
                                     "group_size": 8, "prompt_len": 32, "new_tokens": 64}
    assert shape(common.LARGE) == dict(shape(common.DEFAULT), hidden_size=512, num_layers=8, new_tokens=128)
    assert set(common.SYNTHETIC) == {"default", "large", "smoke"}
    for flags, msg in ((["--smoke", "--large"], "not allowed with"), (["--smoke", "--model", "x"], "pick one")):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), *flags], cwd=ROOT,
                           env=subprocess_env(1), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr, r.stderr[-2000:]
    checkpoint.write_synthetic_checkpoint(str(tmp_path / "smoke"), "smoke")
    with open(tmp_path / "smoke" / "config.json") as f:
        cfg = json.load(f)
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (64, 2, 176)


def test_roofline_floors_follow_the_workload_shape():
    """The decode floor counts weights per replica per decode step plus the live KV caches, and the
    update floor is the model FLOPs at the peak: changing the shape changes them as the formulas say."""
    bs = _bench_step_module()
    w = dict(vocab_size=100, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=16,
             num_prompts=1, group_size=2, prompt_len=3, new_tokens=4, tie_word_embeddings=True, dtype="float32")
    params = 2 * (8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16) + 100 * 8
    kv_token = 2 * 2 * 1 * 4 * 4  # K and V, 2 layers, 1 KV head of 4 dims, 4 bytes
    # two responses of 4 tokens: each reads P + t cached tokens at t = 0..3
    assert bs.decode_bytes(w, 1) == 4 * params * 4 + 2 * (4 * 3 + 6) * kv_token
    assert bs.decode_bytes(w, 2) - bs.decode_bytes(w, 1) == 4 * params * 4
    # a response that ends after 1 token stops reading its cache; the longest sets the decode steps
    assert bs.decode_bytes(w, 1, [1, 4]) == 4 * params * 4 + ((1 * 3) + (4 * 3 + 6)) * kv_token
    assert bs.update_model_flops(w, [4, 4]) == bs.update_model_flops(w)
    assert bs.update_model_flops(w, [1, 4]) < bs.update_model_flops(w)
    r = bs.roofline(w, 2e9, 1.0, 1.0, 1, update_s=4.0, generate_s=1.0)
    assert r["update_floor_s"] == 2.0 and r["update_vs_floor"] == 2.0
    assert r["decode_floor_s"] == round(bs.decode_bytes(w, 1) / 1e9, 4)
    # decode FLOPs: 2 per weight per generated token (layers + output projection) plus attention
    # over P + t positions (4 H hd per position and layer); 8 tokens, then 5 (lengths 1 and 4)
    attn_positions = 2 * (4 * 3 + 6)
    assert bs.decode_flops(w) == 2 * params * 8 + 2 * 4 * 2 * 4 * attn_positions
    assert bs.decode_flops(w, [1, 4]) == 2 * params * 5 + 2 * 4 * 2 * 4 * (3 + 4 * 3 + 6)
    assert r["decode_compute_floor_s"] == round(bs.decode_flops(w) / 1e9, 4)
    assert r["rollout_vs_both_floors"] == round(1.0 / (bs.decode_flops(w) / 1e9 + bs.decode_bytes(w, 1) / 1e9), 2)


def test_bench_step_real_model_workload_on_a_tiny_gguf(tmp_path):
    """--model FILE.gguf: converted once, the model's own tokenizer and chat template, EOS on, lengths
    reported per response; FLOPs and roofline from the lengths actually generated; the packed
    update's capacity buckets as asked (`--pack-buckets`)."""
    from tests.gguf_fixtures import write_gguf

    pytest = __import__("pytest")
    pytest.importorskip("gguf")
    src = str(tmp_path / "tiny.gguf")
    write_gguf(src)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), "--model", src,
                        "--new-tokens", "6", "--steps", "1", "--model-cache", str(tmp_path / "cache"), "--slots", "8",
                        "--pack-tokens", "16", "--pack-buckets", "geometric"],
                       cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["workload"] == "real" and out["slots"] == 8 and out["max_new_tokens"] == 6
    assert os.path.isfile(os.path.join(str(tmp_path / "cache"), "tiny", "config.json"))
    ours = out["participants"]["stare-jax"]
    assert 0 < ours["median_tokens"] <= 64 * 6 and ours["slots"] == 8
    # the packed update's capacity is a rung of the geometric ladder 16 x {1, 2, 3, 4, 6, 8, 12, 16, 24}
    assert out["pack_tokens"] == 16 and out["pack_buckets"] == "geometric"
    assert ours["per_step"][0]["packed_capacity"] in {16 * k for k in (1, 2, 3, 4, 6, 8, 12, 16, 24)}
    assert 0 < out["response_length_mean"]["stare-jax"] <= 6
    assert out["roofline"]["update_floor_s"] > 0 and out["roofline"]["decode_floor_s"] > 0
    assert out["roofline"]["memory_bandwidth_gbs"] > 0 and out["roofline"]["replicas"] == ours["devices"]
    ratio = ours["median_update_s"] / out["roofline"]["update_floor_s"]  # both rounded in the JSON
    assert abs(out["roofline"]["update_vs_floor"] - ratio) <= 0.05 * ratio


def test_bench_step_refuses_a_missing_model(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), "--model",
                        str(tmp_path / "nope.gguf"), "--steps", "1"],
                       cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no such file" in r.stderr
    other = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), "--model", str(tmp_path),
                            "--steps", "1"], cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    assert other.returncode == 2 and "not 'smollm2', a .gguf file or a Hugging Face directory" in other.stderr


def _load_script(name, *path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_trace(trace_dir, planes):
    """A `jax.profiler.trace`-shaped run in `trace_dir` whose XSpace holds `planes`: {plane name:
    {line name: [(event name, start us, duration us[, {stat name: string value}]), ...]}}."""
    from jax.profiler import ProfileData

    names = sorted({e[0] for lines in planes.values() for events in lines.values() for e in events})
    stats = sorted({k for lines in planes.values() for events in lines.values() for e in events
                    for k in (e[3] if len(e) > 3 else {})})

    def event(e):
        n, ts, dur = e[:3]
        st = " ".join(f'stats {{ metadata_id: {stats.index(k) + 1} str_value: "{v}" }}'
                      for k, v in (e[3] if len(e) > 3 else {}).items())
        return f"events {{ metadata_id: {names.index(n) + 1} offset_ps: {ts * 10**6} duration_ps: {dur * 10**6} {st} }}"

    text = []
    for plane, lines in planes.items():
        body = []
        for i, (line, events) in enumerate(lines.items(), start=1):
            body.append(f'lines {{ id: {i} name: "{line}" {" ".join(event(e) for e in events)} }}')
        body += [f'event_metadata {{ key: {i + 1} value {{ id: {i + 1} name: "{n}" }} }}' for i, n in enumerate(names)]
        body += [f'stat_metadata {{ key: {i + 1} value {{ id: {i + 1} name: "{k}" }} }}' for i, k in enumerate(stats)]
        text.append(f'planes {{ name: "{plane}" {" ".join(body)} }}')
    run = trace_dir / "plugins" / "profile" / "2026_01_01_00_00_00"
    run.mkdir(parents=True)
    (run / "trace.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(" ".join(text)))


def test_bench_update_profile_summary_counts_self_time_by_op_kind(tmp_path):
    """`bench_update.py --profile` reads every event of the trace's XSpace (past the Perfetto JSON's
    1,000,000-event cap) and sums each op's own time (minus the ops nested in it on the same
    thread) by kind, per device: a loop's time spent in its body's ops is not counted twice."""
    bench_update = _load_script("bench_update", "bench_update.py")
    _write_trace(tmp_path, {"/host:CPU": {
        "eigen1": [("ThunkExecutor::Execute", 0, 10_000_000), ("while.7", 0, 8_000_000),
                   ("dot.1", 1_000_000, 3_000_000), ("multiply_reduce_fusion", 5_000_000, 1_000_000),
                   ("dot.2", 8_000_000, 2_000_000)],
        "eigen2": [("wrapped_reduce-window.3", 0, 2_000_000), ("dot.1", 2_000_000, 4_000_000)]}})
    events = bench_update.profile_ops.trace_events(str(tmp_path))
    assert len(events) == 7 and ("eigen2", "dot.1", 2_000_000.0, 4_000_000.0) in events
    assert bench_update.profile_ops.op_seconds_per_device(events, 2) == {"dot": 4.5, "while": 2.0,
                                                                         "reduce-window": 1.0, "fusion": 0.5}


def test_profile_counts_an_asynchronous_dots_tail_as_matmul_time(tmp_path):
    """XLA:CPU finishes a large dot in Eigen tasks after the dot's own event, until its `end: dot`
    marker: the op threads' stretches with no op event inside that window are the dot's
    (`async_tails`, added to `matmul_s` and the origin rows), stretches outside every window are
    idle; a loop's own event (spanning its body) neither hides stretches nor opens a window."""
    bench_update = _load_script("bench_update", "bench_update.py")
    ops = bench_update.profile_ops
    _write_trace(tmp_path, {"/host:CPU": {
        "eigen1": [("while.7", 0, 10_000_000), ("dot.1", 0, 1_000_000), ("end: dot.1", 5_000_000, 0),
                   ("multiply_fusion.2", 5_000_000, 1_000_000), ("end: multiply_fusion.2", 6_000_000, 0),
                   ("copy.3", 8_000_000, 1_000_000), ("end: while.7", 10_000_000, 0)],
        "eigen2": [("ThreadpoolListener::StartRegion", 2_500_000, 0), ("dot.4", 0, 2_000_000),
                   ("add_fusion.5", 4_000_000, 1_000_000)]}})
    events = ops.trace_events(str(tmp_path))
    # dot.1's window is 1..5 s: eigen1's 1..5 s and eigen2's 2..4 s are its; eigen1's 6..8 s is idle
    assert ops.async_tails(events) == {"dot.1": 6_000_000.0}
    assert ops.idle_us_by_thread(events) == {"eigen1": 2_000_000.0, "eigen2": 0.0}
    hlo = """
  %a.1 = f32[8,4]{1,0} parameter(0)
  %dot.1 = f32[8,8]{1,0} dot(%a.1, %a.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %dot.4 = f32[8,8]{1,0} dot(%a.1, %a.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
"""
    summary = ops.summarize_events(events, [hlo], devices=2)
    assert summary["matmul_s"] == pytest.approx((1 + 2 + 6) / 2)   # own events + dot.1's tail, per device
    assert summary["matmul_async_tail_s"] == pytest.approx(6 / 2)
    assert summary["idle_s"] == pytest.approx(2 / 2)
    assert sum(row[2] for row in summary["matmuls_by_origin"]) == pytest.approx(summary["matmul_s"], abs=1e-4)


def test_bench_update_counts_the_matmul_flops_each_traced_dot_executed():
    """The update's matmul accounting: each `dot` of the optimised HLO costs 2 x output elements x
    contracted elements, every traced execution counts (loop trips included), other ops none; and
    the MFU bounds follow from executed, model and traced figures."""
    bench_update = _load_script("bench_update", "bench_update.py")
    hlo = """
  %p.1 = f32[64,32]{1,0} parameter(0)
  %w.2 = f32[32,16]{1,0} parameter(1)
  %b.3 = f32[4,8,5]{2,1,0} parameter(2)
  %c.4 = f32[4,5,3]{2,1,0} parameter(3)
  %dot.5 = f32[64,16]{1,0} dot(%p.1, %w.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="x"}
  %dot.6 = f32[4,8,3]{2,1,0} dot(%b.3, %c.4), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  %multiply_fusion.7 = f32[64,16]{1,0} fusion(%dot.5), kind=kLoop, calls=%f
"""
    profile_ops = bench_update.profile_ops
    flops = profile_ops.dot_flops([hlo])
    assert flops == {"dot.5": 2.0 * 64 * 16 * 32, "dot.6": 2.0 * 4 * 8 * 3 * 5}
    events = [("t0", "dot.5", 0.0, 1.0), ("t0", "dot.5", 2.0, 1.0), ("t1", "dot.6", 0.0, 1.0),
              ("t1", "multiply_fusion.7", 1.0, 1.0)]
    assert profile_ops.executed_dot_flops(events, flops) == 2 * 65536.0 + 960.0
    origins = {"dot.5": "jit(f)/transpose(jvp())/dot_general (a.py:3)", "dot.6": "jit(f)/bkm,bmd->bkd/dot_general ()"}
    shapes = profile_ops.hlo_output_shapes([hlo])
    slow = [(t, n, start * 1e6, dur * 1e6) for t, n, start, dur in events]  # seconds, in us
    assert profile_ops.matmuls_by_origin(slow, {"dot.5": 3e11, "dot.6": 5e11}, origins, 2, shapes) == [
        ["bwd dot_general -> f32[64,16]", 0.3, 1.0, 300.0],  # two executions of 1 s, over 2 devices
        ["fwd bkm,bmd->bkd -> f32[4,8,3]", 0.25, 0.5, 500.0]]
    acc = bench_update.matmul_accounting(executed_flops=13e12, dot_s=50.0, model_flops=10e12, update_s=80.0,
                                         peak_gflops=260.0, devices=2)
    assert acc["executed_over_model"] == 1.3 and acc["dot_rate_over_peak"] == 1.0
    assert acc["mfu_bound_executed_flops"] == round(1 / 1.3, 3) and acc["mfu_bound_matmul_rate"] == round(5 / 6.5, 3)
    assert acc["mfu_traced"] == round(5e12 / 80.0 / 130e9, 3) and acc["non_dot_seconds_per_device"] == 30.0


def test_cpu_profile_counts_ynnpack_fusions_that_hold_a_dot_as_matmuls():
    """On XLA:CPU most products run as YNNPACK fusions (`ynn_fusion.N`, kind=kCustom, calling a
    computation that holds the dot): such a fusion is a matmul with its dot's FLOPs, its inner dot
    is not counted apart, and a YNNPACK fusion without a dot (a reduction) is no matmul; the op-kind
    split then puts the fusion's time under "dot", and the non-matmul list leaves it out."""
    profile_ops = _load_script("profile_ops", "bench_peers", "profile_ops.py")
    hlo = """
%fused_computation.19 (param_0.1: f32[6144,576], param_1.1: f32[576,3072]) -> f32[6144,3072] {
  %param_0.1 = f32[6144,576]{1,0} parameter(0)
  %param_1.1 = f32[576,3072]{1,0} parameter(1)
  ROOT %dot.7 = f32[6144,3072]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_computation.185 (param_0.2: f32[], param_1.2: f32[32,64,8]) -> f32[32,64] {
  %param_1.2 = f32[32,64,8]{2,1,0} parameter(1)
  %param_0.2 = f32[] parameter(0)
  ROOT %reduce.3 = f32[32,64]{1,0} reduce(%param_1.2, %param_0.2), dimensions={2}, to_apply=%add
}

ENTRY %main.1 (x: f32[6144,576], w: f32[576,3072]) -> f32[6144,3072] {
  %x = f32[6144,576]{1,0} parameter(0)
  %g = f32[6144,3072]{1,0} parameter(2)
  %ynn_fusion.19 = f32[6144,3072]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_computation.19, metadata={op_name="jit(u)/jvp()/...d,df->...f/dot_general"}, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  %ynn_fusion.185 = f32[32,64]{1,0} fusion(%c, %b), kind=kCustom, calls=%fused_computation.185, metadata={op_name="jit(u)/jvp()/reduce_sum"}, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  %dot.9 = f32[576,3072]{1,0} dot(%x, %g), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}
"""
    flops = profile_ops.dot_flops([hlo])
    assert flops == {"ynn_fusion.19": 2.0 * 6144 * 3072 * 576, "dot.9": 2.0 * 576 * 3072 * 6144}
    events = [("t0", "ynn_fusion.19", 0.0, 3_000_000.0), ("t0", "ynn_fusion.185", 3_000_000.0, 1_000_000.0),
              ("t1", "dot.9", 0.0, 2_000_000.0)]
    assert profile_ops.op_seconds_per_device(events, 2, flops) == {"dot": 2.5, "fusion": 0.5}
    shapes = profile_ops.hlo_output_shapes([hlo])
    assert [r[0] for r in profile_ops.costliest_ops(events, shapes, {}, 2, exclude=("dot",), matmuls=flops)] == [
        "ynn_fusion.185"]
    assert profile_ops.executed_dot_flops(events, flops) == 2 * 2.0 * 6144 * 3072 * 576


def test_profile_summary_on_an_accelerator_reads_the_device_ops(tmp_path):
    """On a GPU the host threads hold only launches (one CUDA-graph launch for a whole update):
    `trace_events` then reads each device plane's "XLA Ops" line, one thread per device, and leaves
    the host's events and the device's kernel streams out."""
    profile_ops = _load_script("profile_ops", "bench_peers", "profile_ops.py")
    _write_trace(tmp_path, {
        "/host:CPU": {"python": [("cuGraphLaunch", 0, 9_000_000)]},
        "/device:GPU:0": {"XLA Ops": [("dot.3", 0, 3_000_000), ("loop_multiply_fusion", 3_000_000, 1_000_000)],
                          "Stream #13(MemcpyH2D)": [("sm90_xmma_gemm_kernel", 0, 3_000_000)]}})
    events = profile_ops.trace_events(str(tmp_path))
    assert events == [("/device:GPU:0 XLA Ops", "dot.3", 0.0, 3_000_000.0),
                      ("/device:GPU:0 XLA Ops", "loop_multiply_fusion", 3_000_000.0, 1_000_000.0)]
    assert profile_ops.op_seconds_per_device(events, 1) == {"dot": 3.0, "fusion": 1.0}


def test_profile_summary_on_a_gpu_without_an_ops_line_reads_the_kernel_streams(tmp_path, capsys):
    """JAX 0.11 on CUDA (the H200 of a lent session) writes no "XLA Ops" line: the device plane's
    kernel streams are read instead, each kernel named by its `hlo_op` stat, and the memset and
    kernel that one cuBLAS call launches back to back are one execution of its instruction (their
    busy time summed), while a later execution of it stays a second one; a kernel that starts
    before the one ahead of it ends (programmatic dependent launch) takes nothing off that one's
    time, as nothing nests on a stream. The optimised GPU HLO's
    library matmul (a tuple custom call whose left operand is a tuple element) and Triton gemm
    fusion count as matmuls with their FLOPs; a loop fusion named after a gemm does not."""
    profile_ops = _load_script("profile_ops", "bench_peers", "profile_ops.py")
    stream = "Stream #14(Memset,MemcpyD2D,Compute,MemcpyD2H)"
    _write_trace(tmp_path, {
        "/host:CPU": {"python3": [("custom-call.10", 0, 50_000_000)]},
        "/device:GPU:0": {stream: [
            ("Memset 3", 0, 1_000_000, {"hlo_op": "custom-call.10"}),
            ("nvjet_sm90_tss_128x272", 1_000_000, 3_000_000, {"hlo_op": "custom-call.10"}),
            ("gemm_fusion_dot_128", 3_500_000, 2_000_000, {"hlo_op": "gemm_fusion_dot.128"}),  # starts early (PDL)
            ("loop_convert_fusion", 7_000_000, 1_000_000, {"hlo_op": "gemm_fusion_dot_general.185"}),
            ("nvjet_sm90_tss_128x272", 9_000_000, 3_000_000, {"hlo_op": "custom-call.10"})]}})
    events = profile_ops.trace_events(str(tmp_path))
    thread = f"/device:GPU:0 {stream}"
    assert events == [(thread, "custom-call.10", 0.0, 4_000_000.0), (thread, "gemm_fusion_dot.128", 3_500_000.0, 2_000_000.0),
                      (thread, "gemm_fusion_dot_general.185", 7_000_000.0, 1_000_000.0),
                      (thread, "custom-call.10", 9_000_000.0, 3_000_000.0)]
    hlo = """
%gemm_fusion_dot.128_computation (parameter_0.14: bf16[24,6144,81], parameter_1.14: bf16[24,81,64]) -> f32[24,6144,64] {
  %parameter_0.14 = bf16[24,6144,81]{2,1,0} parameter(0)
  %parameter_1.14 = bf16[24,81,64]{2,1,0} parameter(1)
  ROOT %dot.155 = f32[24,6144,64]{2,1,0} dot(%parameter_0.14, %parameter_1.14), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%fused_computation.1633 (param_0: bf16[3072,576]) -> bf16[576,3072] {
  %param_0 = bf16[3072,576]{1,0} parameter(0)
  ROOT %transpose.3 = bf16[576,3072]{1,0} transpose(%param_0), dimensions={1,0}
}

ENTRY %main.1 (arg_tuple.5: (bf16[1,11264,576], s32[])) -> f32[11264,8192] {
  %loop_convert_fusion = bf16[576,8192]{1,0} parameter(1)
  %custom-call.10 = (f32[11264,8192]{1,0}, s8[33554432]{0}) custom-call(%arg_tuple.5#9, %loop_convert_fusion), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(u)/jvp()/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}}}
  %gemm_fusion_dot.128 = f32[24,6144,64]{2,1,0} fusion(%a.1, %b.1), kind=kCustom, calls=%gemm_fusion_dot.128_computation, metadata={op_name="jit(u)/bkmp,bkpd->bkmd/dot_general"}
  %gemm_fusion_dot_general.185 = bf16[576,3072]{1,0} fusion(%custom-call.17#0), kind=kLoop, calls=%fused_computation.1633
}
"""
    flops = profile_ops.dot_flops([hlo])
    assert flops == {"custom-call.10": 2.0 * 11264 * 8192 * 576, "gemm_fusion_dot.128": 2.0 * 24 * 6144 * 64 * 81}
    assert profile_ops.executed_dot_flops(events, flops) == 2 * flops["custom-call.10"] + flops["gemm_fusion_dot.128"]
    assert profile_ops.op_seconds_per_device(events, 1, flops) == {"dot": 9.0, "fusion": 1.0}
    shapes = profile_ops.hlo_output_shapes([hlo])
    assert shapes["custom-call.10"] == "f32[11264,8192]{1,0}"
    assert [r[0] for r in profile_ops.costliest_ops(events, shapes, {}, 1, exclude=("dot",), matmuls=flops)] == [
        "gemm_fusion_dot_general.185"]
    origins = {"gemm_fusion_dot_general.185": "jit(u)/transpose(jvp())/checkpoint/convert_element_type (a.py:1)"}
    assert profile_ops.seconds_by_origin(events, origins, 1, exclude=flops) == [["bwd convert_element_type", 1.0, 1]]
    summary = profile_ops.summarize(str(tmp_path), [hlo])  # the CLI's summary, from the same trace and HLO
    assert summary["executions"] == 4 and summary["busy_s"] == 10.0 and summary["span_s"] == 12.0
    assert summary["matmul_executions"] == 3 and summary["matmul_s"] == 9.0
    assert summary["executed_matmul_tflop"] == round(profile_ops.executed_dot_flops(events, flops) / 1e12, 3)
    import gzip

    with gzip.open(tmp_path / "update.txt.gz", "wt") as f:  # the command line reads gzipped HLO as kept in docs/bench
        f.write(hlo)
    assert profile_ops.main([str(tmp_path), str(tmp_path / "update.txt.gz")]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(summary))


def test_bench_vocab_pass_times_both_dw_accumulations(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_vocab_pass.py"), "--tokens", "24",
                        "--hidden", "8", "--vocab", "97", "--chunks", "16,97", "--rounds", "1"],
                       cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert {(x["chunk"], x["dw"]) for x in rows} == {(c, d) for c in (16, 97)
                                                      for d in ("allreduce_in_loop", "per_device_partials")}
    assert all(x["median_s"] > 0 and len(x["times_s"]) == 1 and x["devices"] == 2 for x in rows)
    for bad, msg in ((["--chunks", "16,x"], "--chunks: comma-separated integers"), (["--dw", "sum"], "--dw: allowed"),
                     (["--devices", "1"], "--devices >= 2")):
        b = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_vocab_pass.py"), *bad], cwd=ROOT,
                           env=subprocess_env(1), capture_output=True, text=True, timeout=120)
        assert b.returncode == 2 and msg in b.stderr, b.stderr[-2000:]


def test_bench_vocab_pass_times_a_git_ref_beside_the_working_tree(tmp_path):
    """`--against REF` loads the pass of git REF as a second module and times it beside the working
    tree's, each line naming its code, and leaves no copy of it behind; an unknown ref stops with
    one line."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, os.path.join(ROOT, "scripts", "bench_vocab_pass.py"), "--tokens", "24", "--hidden", "8",
         "--vocab", "97", "--chunks", "16", "--rounds", "1", "--with-pi2", "--dw", "per_device_partials", *extra],
        cwd=ROOT, env=subprocess_env(1, TMPDIR=str(tmp)), capture_output=True, text=True, timeout=600)
    r = run("--against", "HEAD")
    assert not list(tmp.glob("bench_vocab_pass_*"))  # the REF's file was written to a temporary directory
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [(x["code"], x["dw"], x["with_pi2"]) for x in rows] == [("working tree", "per_device_partials", True),
                                                                   ("HEAD", "per_device_partials", True)]
    bad = run("--against", "no-such-ref-xyz")
    assert bad.returncode == 2 and "--against 'no-such-ref-xyz'" in bad.stderr.strip().splitlines()[-1]


def test_bench_decode_layout_times_each_layout(tiny_model, tmp_path):
    """The decode-layout benchmark runs the same rollout on the data-parallel, one-device and
    tensor-parallel layouts of a 2-device host and reports each one's time per decode step; an
    unknown layout exits 2 with one line."""
    model_dir, _ = tiny_model
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_decode_layout.py"), "--model", model_dir,
                        "--rows", "8", "--new-tokens", "3", "--prompt-len", "4", "--rounds", "1", "--cpu-devices", "2"],
                       cwd=ROOT, env=subprocess_env(2), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["devices"] == 2 and set(out["layouts"]) == {"data", "one_device", "tensor"}
    assert all(v["median_s"] > 0 and len(v["all_s"]) == 1 for v in out["layouts"].values())
    assert out["layouts"]["data"]["same_tokens_as_first"]
    prof = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_decode_layout.py"), "--model",
                           model_dir, "--rows", "8", "--new-tokens", "3", "--prompt-len", "4", "--rounds", "1",
                           "--cpu-devices", "2", "--layouts", "one_device", "--profile", str(tmp_path / "prof")],
                          cwd=ROOT, env=subprocess_env(2), capture_output=True, text=True, timeout=600)
    assert prof.returncode == 0, prof.stderr[-3000:]
    p = json.loads(prof.stdout)["profile"]
    assert p["devices"] == 1 and p["trace_events"] > 0 and p["traced_s"] > 0
    assert isinstance(p["op_seconds_per_device"], dict)  # kinds of >= 10 ms only: none at this size
    # every (kind, shape) row names a shape of the dumped program, e.g. the output projection [8, V]
    assert p["by_kind_and_shape"] and all(shape.startswith(("f32[", "s32[", "pred[", "u32[")) or "(" in shape
                                          for _, shape, _ in p["by_kind_and_shape"])
    both = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_decode_layout.py"), "--profile",
                           str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "exactly one" in both.stderr
    unknown = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_decode_layout.py"), "--layouts",
                              "data,data_parallel"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "--layouts: unknown data_parallel" in unknown.stderr


def test_bench_rollout_shards_times_both_forms_of_the_same_rollout(tiny_model):
    """scripts/bench_rollout_shards.py: the static rollout with EOS on, as one loop per device (the
    rule's choice) and as one program over the 2-device mesh, the same responses, each form's time,
    decode steps and rows stepped (the per-device loops step no more rows than the one program)."""
    model_dir, _ = tiny_model
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_rollout_shards.py"), "--model", model_dir,
                        "--rows", "16", "--group-size", "4", "--prompt-len", "4", "--new-tokens", "6", "--mix",
                        "uniform", "--rounds", "1", "--cpu-devices", "2"],
                       cwd=ROOT, env=subprocess_env(2), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["loops_per_device_rule"] == 2 and out["same_responses"] and out["max_log_prob_difference"] < 1e-5
    one, per = out["forms"]["one_program"], out["forms"]["per_device"]
    assert one["median_s"] > 0 and per["median_s"] > 0 and len(one["all_s"]) == len(per["all_s"]) == 1
    assert 1 <= one["decode_steps"] == per["decode_steps"] <= 5  # at most 6 tokens, the first from the prefill
    assert per["rows_stepped"] <= one["rows_stepped"] == 16 * one["decode_steps"]
    assert out["speedup"] > 0 and out["host_cpu"]


def test_bench_neighbour_times_the_update_after_each_interlude():
    """scripts/bench_neighbour.py: rollout + update after each interlude, with the update's page faults."""
    script = os.path.join(ROOT, "scripts", "bench_neighbour.py")
    # the default workload, not --smoke: the smoke update's temporaries stay mapped (no faults to count)
    r = subprocess.run([sys.executable, script, "--rounds", "1", "--interludes", "none,memory", "--gap", "0.1",
                        "--memory-gb", "0.05"], cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["interludes"]) == {"none", "memory"} and out["host_cpu"]
    for row in out["interludes"].values():
        assert row["update_s"] > 0 and row["rollout_s"] > 0 and row["update_cpu_s"] > 0
        assert row["minor_faults"] > 0  # XLA maps the step's temporaries afresh on every execution
    assert out["interludes"]["none"]["update_vs_first"] == 1
    probe = subprocess.run([sys.executable, script, "--page-cost", "--memory-gb", "0.02", "--pauses", "0,0.1"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    costs = json.loads(probe.stdout)["first_touch_us_per_page"]
    assert [c["pause_s"] for c in costs] == [0, 0.1]
    bad = subprocess.run([sys.executable, script, "--interludes", "none,nap"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "nap" in bad.stderr


def test_gpu_figures_stops_at_once_when_a_module_is_missing(tmp_path):
    """scripts/gpu_figures.sh imports every module its jobs need before the first job: in an
    environment without TRL (the test suite's) it exits 2 with one line and runs no job; an
    unknown phase, and a `jobs` phase without names or with a name outside its catalogue, exit 2
    too, before anything is written."""
    env = dict(subprocess_env(), PYTHON=sys.executable)
    script = os.path.join(ROOT, "scripts", "gpu_figures.sh")
    proc = subprocess.run(["bash", script, "real", str(tmp_path / "out"), "60"], capture_output=True, text=True,
                          env=env, timeout=120)
    if proc.returncode == 0:
        pytest.skip("every module the benchmarks need is installed here")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "module the benchmarks need is missing" in proc.stderr
    assert not (tmp_path / "out" / "results.jsonl").exists()  # no job ran
    proc = subprocess.run(["bash", script, "sideways", str(tmp_path / "out2"), "60"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "unknown phase 'sideways'" in proc.stderr
    assert not (tmp_path / "out2").exists()
    for names, why in (([], "jobs needs at least one name"), (["peaks", "nope"], "unknown job 'nope'")):
        proc = subprocess.run(["bash", script, "jobs", str(tmp_path / "out3"), "60", *names], capture_output=True,
                              text=True, env=env, timeout=120)
        assert proc.returncode == 2 and why in proc.stderr and "real_bfloat16" in proc.stderr  # names the catalogue
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "out3").exists()


def test_bench_update_times_a_synthetic_workloads_update_on_a_cached_batch(tmp_path):
    """`bench_update.py --workload smoke`: a synthetic workload of bench_step (random checkpoint
    written into the model cache, EOS off, so every response has all 16 tokens), its batch sampled
    once into the batch cache, the padded update (pack_tokens 0) timed with its model FLOPs."""
    cache = tmp_path / "models"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_update.py"), "--workload", "smoke",
                        "--reps", "1", "--cpu-devices", "1", "--model-cache", str(cache),
                        "--batch-cache", str(tmp_path / "batch.pkl"), "--vocab-chunk", "256", "--setting", "{}",
                        "--setting", json.dumps({"loss.kl_type": "k3", "loss.kl_coef": 0.01})],
                       cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out, with_kl = (json.loads(line) for line in r.stdout.strip().splitlines()[-2:])
    # a setting with a KL term runs against its frozen reference (the same initial weights), on-policy too
    assert with_kl["setting"] == {"loss.kl_type": "k3", "loss.kl_coef": 0.01}
    assert with_kl["sampler_approx_kl"] < 1e-6 and len(with_kl["times_s"]) == 1 and "policy_disagreement" not in with_kl
    assert out["response_tokens"] == 4 * 4 * 16 and out["packed_capacity"] is None and out["devices"] == 1
    assert out["vocab_chunk"] == 256
    # each setting's own resident peak (its window of the kernel's high-water mark) within the
    # process's peak so far, which only grows from one setting to the next
    for line in (out, with_kl):
        assert 0 < line["setting_peak_rss_mb"] <= line["peak_rss_mb"], line
    assert with_kl["peak_rss_mb"] >= out["peak_rss_mb"]
    assert (cache / "synthetic_smoke" / "config.json").exists() and (tmp_path / "batch.pkl").exists()
    bench_step = _load_script("bench_step", "bench_step.py")  # its import puts bench_peers/common on the path
    flops = bench_step.update_model_flops(bench_step.common.SMOKE)
    assert out["model_tflop"] == round(flops / 1e12, 4)
    assert len(out["times_s"]) == 1 and out["times_s"][0] > 0 and 0 < out["mfu"] < 1
    # the first update's policy is the sampler's: rounding, and no disagreement is flagged
    assert out["sampler_approx_kl"] == out["approx_kl"] and out["sampler_approx_kl"] < 1e-6
    assert "policy_disagreement" not in out and "disagree" not in r.stderr
    # to 3 significant digits, however long the (compiling) update took: 3 decimals read 0.0 under load
    assert out["mfu"] == float(f"{flops / out['times_s'][0] / (out['matmul_peak_gflops'] * 1e9):.3g}")
    # without --vocab-chunk both scripts use the same chunk: 1,024 columns for the real model on a CPU host
    assert bench_step.default_vocab_chunk(True) == 1024 and bench_step.default_vocab_chunk(False) is None
    # and the same bound on kept logits: the real model's update keeps them, the synthetic ones recompute
    assert out["vocab_keep_logits_mb"] == 0
    assert bench_step.default_keep_logits_mb(True) == 2048 and bench_step.default_keep_logits_mb(False) == 0


def test_bench_workers_build_the_policy_their_config_asks_for(tiny_checkpoints):
    """The benchmarks' stare-jax policy (`ours_peer.load_policy`, used by bench_step's worker,
    bench_update, bench_stare_overhead and bench_neighbour) takes its compute dtype, parameter dtype
    and rematerialisation policy from the config as the trainer does: a `--dtype bfloat16` or
    `--remat-saves` run really computes that way (they once silently ran float32 whole-layer remat)."""
    import jax.numpy as jnp

    sys.path.insert(0, os.path.join(ROOT, "scripts", "bench_peers"))
    import ours_peer

    workload = dict(ours_peer.common.DEFAULT, checkpoint=tiny_checkpoints["qwen2"], dtype="bfloat16")
    config = ours_peer.bench_config(workload)
    with config.unlocked():
        config.model.remat, config.model.remat_saves = True, "mlp"
    model = ours_peer.load_policy(workload, config, None).model
    assert model.dtype == jnp.bfloat16 and model.remat and model.remat_saves == "mlp"
    assert model.layers.arrays()["wq"].dtype == jnp.float32  # parameters stay float32
    plain = ours_peer.load_policy(workload, ours_peer.bench_config(dict(workload, dtype="float32")), None).model
    assert plain.dtype == jnp.float32 and not plain.remat


def test_paired_setting_overrides_a_copy_and_bad_ones_exit_2():
    """`--paired-setting` builds the worker's second update from a copy of its config with the
    overrides applied (`ours_peer.with_overrides`, the original untouched); an unknown key or a
    non-object is a one-line usage error (exit 2) before any worker starts."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "bench_peers"))
    import ours_peer

    base = ours_peer.bench_config(dict(ours_peer.common.DEFAULT, checkpoint=""))
    other = ours_peer.with_overrides(base, {"model.vocab_chunk": 1024, "model.remat_saves": "mlp"})
    assert (other.model.vocab_chunk, other.model.remat_saves) == (1024, "mlp")
    assert (base.model.vocab_chunk, base.model.remat_saves) == (8192, "nothing")
    for bad in ({"model.vocab_chnk": 1}, {"nomodel.x": 1}, {"model.dtype.f": 1}):
        with pytest.raises(KeyError, match="unknown config key"):
            ours_peer.with_overrides(base, bad)
    for arg, msg in (('{"model.vocab_chnk": 1}', "unknown config key 'model.vocab_chnk'"),
                     ("[1]", "a JSON object of config overrides"), ("{", "not JSON")):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), "--paired-setting", arg],
                           cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr, r.stderr[-2000:]


def test_bench_step_times_a_paired_setting_on_the_same_batches():
    """`--paired-setting`: the stare-jax worker times a second update built with the overrides on
    every step's batch (here in two micro-batches), and the result compares the two (per step,
    median speedup, each one's MFU)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), "--steps", "1", "--smoke",
                        "--paired-setting", '{"model.vocab_chunk": 512, "ppo.grad_accum": 2}'],
                       cwd=ROOT, env=subprocess_env(1), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["paired_setting"] == {"model.vocab_chunk": 512, "ppo.grad_accum": 2}  # its own micro-batches,
    # on the sampler's entropy and Q, which the worker's rollout records for it
    step = out["participants"]["stare-jax"]["per_step"][0]
    assert step["paired_update_s"] == out["paired_median_update_s"] > 0
    # the per-step times are rounded to 0.1 ms in the JSON and a smoke update takes ~15 ms, so the
    # ratio of the rounded times matches the speedup (of the exact ones) to ~1 %, not to 1e-3
    assert out["paired_update_speedup"] == pytest.approx(step["update_s"] / step["paired_update_s"], rel=1e-2)
    assert 0 < out["paired_update_mfu"]["main"] < 1 and 0 < out["paired_update_mfu"]["paired"] < 1
    # the worker holds two update programs: oneTBB's cache bound is raised for it on a CPU host
    bench_step = _load_script("bench_step", "bench_step.py")
    assert out["paired_malloc_limit_gb"] == bench_step.paired_malloc_limit_gb(subprocess_env(1))


def test_a_paired_runs_allocator_cache_bound_is_most_of_the_memory_unless_set():
    """`paired_malloc_limit_gb`: 0.8 of the physical memory on a CPU host, where the trainer's
    default is half; the caller's STARE_JAX_MALLOC_LIMIT_GB, or a run off the CPU, leaves it alone."""
    bench_step = _load_script("bench_step", "bench_step.py")
    physical_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert bench_step.paired_malloc_limit_gb({"JAX_PLATFORMS": "cpu"}) == pytest.approx(0.8 * physical_gb, abs=0.05)
    assert bench_step.paired_malloc_limit_gb({"JAX_PLATFORMS": "cpu", "STARE_JAX_MALLOC_LIMIT_GB": "4"}) is None
    assert bench_step.paired_malloc_limit_gb({"JAX_PLATFORMS": "cuda"}) is None


def test_bench_update_keeps_its_programs_in_the_compilation_cache(tmp_path):
    """`bench_update.py` uses $STARE_COMPILATION_CACHE_DIR as every stare-jax entry point does: a
    second process on the same batch loads the update's program instead of compiling it again."""
    cache = tmp_path / "xla"
    args = [sys.executable, os.path.join(ROOT, "scripts", "bench_update.py"), "--workload", "smoke", "--reps", "1",
            "--model-cache", str(tmp_path / "models"), "--batch-cache", str(tmp_path / "batch.pkl"),
            "--digest-out", str(tmp_path / "digests.jsonl")]
    env = subprocess_env(1, STARE_COMPILATION_CACHE_DIR=str(cache))
    first = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    entries = sorted(p.name for p in cache.iterdir())
    assert entries, "nothing written to the compilation cache"
    second = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert sorted(p.name for p in cache.iterdir()) == entries  # every program found, none written anew
    results = [json.loads(run.stdout.strip().splitlines()[-1]) for run in (first, second)]
    assert all(r["times_s"][0] > 0 for r in results)
    # two processes, one batch: the updated train state is the same to the bit
    assert len(results[0]["state_digest"]) == 16 and results[0]["state_digest"] == results[1]["state_digest"]
    assert abs(results[0]["approx_kl"]) < 1e-4  # the update's forward agrees with the sampler's
    assert results[0]["loss"] == results[1]["loss"]
    # --digest-out: one line per process, every metric and every leaf's digest, equal in both
    records = [json.loads(line) for line in (tmp_path / "digests.jsonl").read_text().splitlines()]
    assert len(records) == 2 and records[0] == records[1]
    assert records[0]["metrics"]["loss"] == results[0]["loss"] and "grad_norm" in records[0]["metrics"]
    assert any(path.startswith("model/") for path in records[0]["leaves"]) and len(records[0]["leaves"]) > 10


def test_check_update_kernels_refuses_bad_input(tmp_path):
    """`scripts/check_update_kernels.py` exits 2 with one line for options that are not a JSON
    object, a negative attention block, per-device programs on one device, layer counts per program
    without per-device programs, not integers or not one a device, more response positions than the
    batch's 256, and a missing batch cache (it names the command that
    writes it)."""
    script = os.path.join(ROOT, "scripts", "check_update_kernels.py")
    bad = subprocess.run([sys.executable, script, "--options", "[1]"], cwd=ROOT, env=subprocess_env(1),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--options must be a JSON object" in bad.stderr
    rows = subprocess.run([sys.executable, script, "--rows", "12"], cwd=ROOT, env=subprocess_env(1),
                          capture_output=True, text=True, timeout=120)
    assert rows.returncode == 2 and "--rows must be a multiple of the group size 8" in rows.stderr
    block = subprocess.run([sys.executable, script, "--attention-block", "-1"], cwd=ROOT, env=subprocess_env(1),
                           capture_output=True, text=True, timeout=120)
    assert block.returncode == 2 and "--attention-block >= 0" in block.stderr
    one = subprocess.run([sys.executable, script, "--per-device-programs", "--cpu-devices", "1"], cwd=ROOT,
                         env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    assert one.returncode == 2 and "--per-device-programs needs more than one CPU device" in one.stderr
    for flags, message in ((["--program-layers", "4,0"], "--program-layers needs --per-device-programs"),
                           (["--per-device-programs", "--program-layers", "4,x"], "comma-separated integers"),
                           (["--per-device-programs", "--cpu-devices", "2", "--program-layers", "4,4,4"],
                            "names 3 programs for 2 devices"),
                           (["--response-positions", "257"], "--response-positions must be between 0 and 256")):
        cut = subprocess.run([sys.executable, script, *flags], cwd=ROOT, env=subprocess_env(1),
                             capture_output=True, text=True, timeout=120)
        assert cut.returncode == 2 and message in cut.stderr
    missing = subprocess.run([sys.executable, script, "--batch-cache", str(tmp_path / "none.pkl")], cwd=ROOT,
                             env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "bench_update.py --reps 1" in missing.stderr


def test_bench_matmul_shapes_times_every_product_under_each_option_set():
    """`scripts/bench_matmul_shapes.py` on tiny shapes: one JSON object with, for each option set,
    every product's GFLOP/s a device (positive, one best time per round) and the one-product peak
    halved per device, in float32 and with bfloat16 operands; options that are not an object of
    objects exit 2 with one line."""
    script = os.path.join(ROOT, "scripts", "bench_matmul_shapes.py")
    small = ["--tokens", "64", "--hidden", "32", "--qkv", "16", "--mlp", "16", "--vocab-chunk", "32",
             "--square", "64", "--repeats", "1", "--rounds", "2", "--devices", "2"]
    for dtype in ("float32", "bfloat16"):
        run = subprocess.run([sys.executable, script, *small, "--dtype", dtype], cwd=ROOT, env=subprocess_env(2),
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert set(result["products"]) == {"shipped", "ynnpack"} and result["devices"] == 2 and result["dtype"] == dtype
        for rows in result["products"].values():
            assert len(rows) == 25 and "gate/up dW h^T@g" in rows and "square 64" in rows
            assert "gate/up forward, W stored [f,d]" in rows and "vocab chunk dh, W stored [f,d]" in rows
            assert "gate/up dh, the model's form" in rows and "q/k/v dW, the model's form" in rows
            assert all(r["gflops_per_device"] > 0 and len(r["best_s"]) == 2 for r in rows.values())
        assert result["one_product_peak_per_device_gflops"] == round(result["one_product_peak_gflops"] / 2, 1)
    bad = subprocess.run([sys.executable, script, "--options", '{"a": 1}'], cwd=ROOT, env=subprocess_env(1),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--options must be a non-empty JSON object" in bad.stderr


def test_bench_update_refuses_a_bad_setting_before_building_its_batch(tmp_path):
    """`scripts/bench_update.py`: an unknown config key, a setting the config's validation refuses,
    or one that is not a JSON object, exits 2 with one line before the (minutes-long on the real model) batch is sampled."""
    script = os.path.join(ROOT, "scripts", "bench_update.py")
    for setting, msg in (('{"model.vocab_chnk": 1}', "unknown config key 'model.vocab_chnk'"),
                         ('{"model.vocab_chunk": 0}', "vocab_chunk"), ("[1]", "a JSON object of config overrides")):
        r = subprocess.run([sys.executable, script, "--workload", "smoke", "--setting", setting, "--model-cache",
                            str(tmp_path / "models"), "--batch-cache", str(tmp_path / "batch.pkl")], cwd=ROOT,
                           env=subprocess_env(1), capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and msg in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
        assert not (tmp_path / "batch.pkl").exists()


@pytest.mark.parametrize("script,args,msg", [
    ("bench_rollout.py", ["--new-tokens", "0"], "--new-tokens and --prompt-len must be >= 1"),
    ("bench_rollout_skew.py", ["--repeats", "0"], "--cpu-devices must be >= 1"),
    ("bench_rollout_skew.py", ["--model", "/nonexistent"], "not a Hugging Face model directory"),
    ("bench_rollout_skew.py", ["--compact", "x"], "--static-rows and --compact: comma-separated integers"),
    ("bench_rollout_shards.py", ["--model", "/nonexistent"], "not a Hugging Face model directory"),
    ("bench_rollout_shards.py", ["--rows", "12", "--cpu-devices", "2"], "must be a multiple of --group-size"),
])
def test_rollout_benchmarks_refuse_bad_input_with_exit_2(script, args, msg):
    """Bad sizes, a missing model and unparsable lists are usage errors (exit 2, the message on the
    last line), not tracebacks from inside the sampler or the model loader."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args], cwd=ROOT,
                       env=subprocess_env(1), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and msg in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


def test_bench_update_builds_each_update_at_its_settings_matmul_precision(tmp_path):
    """bench_update.py builds each setting's update inside its `model.matmul_precision`, as the
    trainer does: `model.gpu_gemm` picks a GPU update's kernels (cuBLAS for full float32) from the
    precision in force when the step is built, so with only the call inside the context a
    full-float32 update was built for XLA's autotuned Triton GEMMs. Recorded here from the
    precision each `make_update_step` call sees, a full-float32 setting and a default one."""
    wrapper = tmp_path / "run_bench_update.py"
    script = os.path.join(ROOT, "scripts", "bench_update.py")
    wrapper.write_text(
        "import runpy, sys\n"
        "import stare_jax.rl as rl\n"
        "from stare_jax import gpu_gemm\n"
        "built = rl.make_update_step\n"
        "def recording(*args, **kwargs):\n"
        "    print('FULL_FLOAT32_AT_BUILD', gpu_gemm.full_float32_products(), flush=True)\n"
        "    return built(*args, **kwargs)\n"
        "rl.make_update_step = recording\n"
        f"sys.argv = [{script!r}] + sys.argv[1:]\n"
        f"runpy.run_path({script!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, str(wrapper), "--workload", "smoke", "--reps", "1",
                        "--batch-cache", str(tmp_path / "batch.pkl"), "--model-cache", str(tmp_path / "models"),
                        "--setting", '{"model.matmul_precision": "float32"}', "--setting", "{}"],
                       cwd=ROOT, env=subprocess_env(1, STARE_JAX_MALLOC="system"), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("FULL_FLOAT32_AT_BUILD")]
    assert seen == ["True", "False"], r.stdout[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["setting"] for row in rows] == [{"model.matmul_precision": "float32"}, {}]


def test_round_speedups_pair_each_peers_step_with_ours_of_the_same_round(tmp_path):
    """speedup_by_round: peer step / stare-jax step round by round (a peer without per-step figures is
    left out); steal_fraction: the steal jiffies' share of all jiffies between two readings;
    --resummarize adds the rounds to a result saved without them."""
    bs = _bench_step_module()
    participants = {"stare-jax": {"per_step": [{"step_s": 1.0}, {"step_s": 0.5}, {"step_s": 2.0}]},
                    "trl": {"per_step": [{"step_s": 2.5}, {"step_s": 1.0}, {"step_s": 3.0}]},
                    "tunix": {"median_step_s": 4.0}}
    assert bs.round_speedups(participants) == {"trl": [2.5, 2.0, 1.5]}
    assert bs.steal_fraction((1000, 10), (1400, 110)) == 0.25
    assert bs.steal_fraction((0, 0), (0, 0)) == 0.0  # no /proc/stat
    path = tmp_path / "saved.json"
    path.write_text(json.dumps({"participants": participants}))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_step.py"), "--resummarize", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["speedup_by_round"] == {"trl": [2.5, 2.0, 1.5]}
