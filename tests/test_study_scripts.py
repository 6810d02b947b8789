"""Fast checks of scripts/plot_metrics.py and scripts/entropy_study.py on synthetic runs (no training)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", os.path.join(REPO, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the class is built
    spec.loader.exec_module(mod)
    return mod


plot_metrics = _load("plot_metrics")
entropy_study = _load("entropy_study")
quadrant_study = _load("quadrant_study")

QUADS = ("pos_high", "pos_low", "neg_high", "neg_low")


def fake_run(run_dir, entropy, *, total_steps=None, acc0=0.3, acc1=0.6, gate=None, eval_avg=0.5, eval_pass=0.7,
             n=8, target_entropy=0.3, finished=True, torn=False):
    """Writes metrics.jsonl (+ config.json, eval/step_<T>.json) like the trainer does."""
    os.makedirs(run_dir, exist_ok=True)
    T = len(entropy)
    total_steps = total_steps or T
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for s, h in enumerate(entropy):
            row = {"step": s, "entropy": float(h), "reward_mean": acc0 + (acc1 - acc0) * s / max(T - 1, 1),
                   "accuracy": acc0 + (acc1 - acc0) * s / max(T - 1, 1), "response_length_mean": 4.0 + 0.01 * s,
                   "loss": 0.1, "grad_norm": 1.0, "stare_gate_on": float(gate[s]) if gate is not None else 0.0,
                   "stare_w": 1.5, "stare_m": 0.9, "stare_lplus_frac": 0.05, "stare_lminus_frac": 0.05,
                   "rollout_s": 0.1, "update_s": 0.1, "step_s": 0.2, "quad_total_dH": -0.01}
            for i, q in enumerate(QUADS):
                row[f"quad_{q}_frac"] = 0.25
                row[f"quad_{q}_dH"] = (-1) ** i * 0.01
            f.write(json.dumps(row) + "\n")
        if torn:
            f.write('{"step": 99999, "entr')
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"stare": {"target_entropy": target_entropy}, "total_steps": total_steps}, f)
    if finished:
        os.makedirs(os.path.join(run_dir, "eval"), exist_ok=True)
        res = {f"avg@{n}": eval_avg, "n": n, "num_prompts": 16, "pass@1": eval_avg, f"pass@{n}": eval_pass}
        with open(os.path.join(run_dir, "eval", f"step_{total_steps}.json"), "w") as f:
            json.dump({"step": total_steps, "results": {"countdown": res}}, f)


def test_plot_metrics_writes_png(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    fake_run(str(a), np.linspace(0.8, 0.05, 60), torn=True)
    fake_run(str(b), np.linspace(0.8, 0.3, 60), gate=(np.arange(60) > 30))
    out = tmp_path / "fig" / "m.png"
    assert plot_metrics.main([str(a), str(b), "--out", str(out), "--smooth", "5", "--labels", "grpo,stare"]) == 0
    assert out.exists() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = plot_metrics.read_metrics(str(a))
    assert len(rows) == 60  # torn last line ignored
    assert plot_metrics.run_target_entropy(str(a)) == 0.3


def test_plot_metrics_missing_dir(tmp_path):
    assert plot_metrics.main([str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")]) == 2


def test_plot_metrics_refuses_an_output_it_cannot_write(tmp_path, capsys):
    """An --out under a file (or a directory) is one line and exit 2, not a traceback from savefig."""
    fake_run(str(tmp_path / "a"), np.linspace(0.8, 0.05, 10))
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, reason in ((afile / "m.png", "Not a directory"), (tmp_path, "is a directory")):
        assert plot_metrics.main([str(tmp_path / "a"), "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == f"plot_metrics: --out: {out}: cannot be written ({reason})"


def test_smooth():
    y = np.array([0.0, 2.0, 4.0, 6.0])
    np.testing.assert_allclose(plot_metrics.smooth(y, 2), [0.0, 1.0, 3.0, 5.0])
    np.testing.assert_allclose(entropy_study.smooth(y, 1), y)


def test_run_summary_and_finished(tmp_path):
    T, h_tgt = 100, 0.3
    collapse = np.concatenate([np.linspace(0.8, 0.05, 50), np.full(50, 0.05)])
    d = tmp_path / "grpo"
    fake_run(str(d), collapse, target_entropy=h_tgt)
    s = entropy_study.run_summary(str(d), T, h_tgt, 8)
    assert s["finished"] and s["steps_done"] == T
    assert s["collapse_step"] is not None and s["collapse_step"] <= 60
    assert not s["in_band"]
    assert s["avg@n"] == 0.5 and s["pass@k"] == 0.7 and s["pass_k"] == 8
    assert s["accuracy_end"] > s["accuracy_start"]
    # unfinished: missing eval, or fewer rows than total_steps
    e = tmp_path / "partial"
    fake_run(str(e), collapse[:40], total_steps=T, finished=False)
    assert not entropy_study.is_finished(str(e), T)
    f = tmp_path / "noeval"
    fake_run(str(f), collapse, finished=False)
    assert not entropy_study.is_finished(str(f), T)
    assert entropy_study.is_finished(str(d), T)


def test_aggregate_table_and_checks(tmp_path):
    T, h_tgt = 80, 0.3
    root = tmp_path / "study"
    held = np.concatenate([np.linspace(0.8, 0.3, 30), np.full(50, 0.3)])
    collapsed = np.concatenate([np.linspace(0.8, 0.05, 40), np.full(40, 0.05)])
    for s in range(3):
        fake_run(str(root / "grpo_ds" / f"seed_{s}"), collapsed + 0.001 * s, eval_avg=0.5 + 0.01 * s,
                 eval_pass=0.6)
        fake_run(str(root / "stare_quickstart" / f"seed_{s}"), held + 0.001 * s, eval_avg=0.5, eval_pass=0.7,
                 gate=np.arange(T) > 30)
    rows = [entropy_study.ROW_BY_NAME["grpo_ds"], entropy_study.ROW_BY_NAME["stare_quickstart"]]
    summaries, metric_rows = entropy_study.collect(str(root), rows, [0, 1, 2], T, h_tgt, 8)
    agg = entropy_study.aggregate(summaries)
    m, sd, k = agg["grpo_ds"]["avg@n"]
    assert k == 3 and abs(m - 0.51) < 1e-9 and abs(sd - 0.01) < 1e-9
    assert agg["grpo_ds"]["collapsed"] == 3 and agg["stare_quickstart"]["in_band"] == 3
    table = entropy_study.markdown_table(agg, {r.name: r.label for r in rows}, h_tgt)
    assert table.count("\n") == 3 and "GRPO-ds" in table and "± " in table
    checks = dict((name[:2], ok) for name, ok, _ in entropy_study.acceptance(agg, summaries, h_tgt))
    assert checks["1."] and checks["2."] and checks["3a"] and checks["3b"] and checks["4b"]
    # the full report: table file, summary.json and PNG
    png, md = tmp_path / "s.png", tmp_path / "t.md"
    text = entropy_study.report(str(root), rows, [0, 1, 2], T, h_tgt, 8, str(png), str(md), 12.0, "cmd")
    assert png.exists() and md.read_text() == text and (root / "summary.json").exists()
    assert "[x] 1." in text


def test_mean_sd_and_rows():
    assert entropy_study.mean_sd([1.0, None, 3.0]) == (2.0, pytest.approx(np.sqrt(2.0)), 2)
    assert entropy_study.mean_sd([0.5])[1] == 0.0
    names = [r.name for r in entropy_study.ROWS]
    assert names[0] == "grpo_ds" and len(set(names)) == len(names) == 11
    assert dict(entropy_study.ROW_BY_NAME["hapo"].overrides)["loss.name"] == "hapo"
    assert {"entropy_advantage", "w_reinforce"} <= set(names)
    paper = dict(entropy_study.ROW_BY_NAME["stare_c2_paper"].overrides)
    assert paper["stare.variant"] == "C2" and paper["stare.w"] == 1.1 and paper["stare.m"] == 0.9
    assert paper["stare.top_p_ratio"] == 0.1 and paper["stare.adaptive"] is False
    assert paper["stare.top_p_ratio_minus"] == 0.0  # the paper's one P, whatever the quickstart sets
    adaptive = dict(entropy_study.ROW_BY_NAME["stare_o1_adaptive"].overrides)
    assert adaptive["stare.adaptive"] is True and adaptive["stare.top_p_ratio_minus"] == 0.0
    assert dict(entropy_study.ROW_BY_NAME["stare_o1_paper"].overrides)["stare.variant"] == "O1"


def test_quadrant_study_rows_findings_and_report(tmp_path):
    assert [r.name for r in quadrant_study.ROWS] == ["grpo_ds", "q_phr", "q_plr", "q_nlr", "q_nhr"]
    assert dict(quadrant_study.ROW_BY_NAME["q_nhr"].overrides) == {"loss.quadrants": "NHR"}
    T, h_tgt, root = 40, 0.35, tmp_path / "q"
    # (entropy level, acc0, acc1, avg@n, pass@k): PHR keeps H and generalises best, PLR collapses and
    # gains least, NHR learns faster than NLR
    runs = {"grpo_ds": (0.2, 0.3, 0.7, 0.5, 0.6), "q_phr": (0.6, 0.3, 0.6, 0.55, 0.7),
            "q_plr": (0.05, 0.3, 0.32, 0.3, 0.35), "q_nlr": (0.4, 0.3, 0.5, 0.4, 0.5),
            "q_nhr": (0.3, 0.3, 0.65, 0.45, 0.55)}
    for row, (h, a0, a1, avg, pk) in runs.items():
        for s in range(2):
            fake_run(str(root / row / f"seed_{s}"), np.full(T, h) + 0.001 * s, acc0=a0, acc1=a1, eval_avg=avg,
                     eval_pass=pk)
    md, png = tmp_path / "q.md", tmp_path / "q.png"
    text = quadrant_study.report(str(root), quadrant_study.ROWS, [0, 1], T, h_tgt, 8, str(png), str(md), None, "cmd")
    assert png.exists() and md.read_text() == text and "PHR only" in text
    assert text.count("- [x]") == 5 and "- [ ]" not in text
    # a finding that does not repeat is reported as such
    fake_run(str(root / "q_plr" / "seed_0"), np.full(T, 0.9), acc0=0.3, acc1=0.32, eval_avg=0.3, eval_pass=0.35)
    fake_run(str(root / "q_plr" / "seed_1"), np.full(T, 0.9), acc0=0.3, acc1=0.32, eval_avg=0.3, eval_pass=0.35)
    text = quadrant_study.report(str(root), quadrant_study.ROWS, [0, 1], T, h_tgt, 8, "", "", None, "cmd")
    assert "- [ ] 1a." in text and "- [ ] 2a." in text and "- [x] 2b." in text


def test_real_model_study_equal_steps_table_includes_stopped_runs(tmp_path):
    rms = _load("real_model_study")
    root, T = tmp_path / "rm", 40
    rows = [rms.ROW_BY_NAME["grpo_ds"], rms.ROW_BY_NAME["stare"]]
    for row, seed, steps, avg in (("grpo_ds", 0, 40, 0.6), ("grpo_ds", 1, 30, 0.4), ("stare", 0, 40, 0.7)):
        d = root / row / f"seed_{seed}"
        fake_run(str(d), np.full(steps, 0.3 + 0.1 * seed), total_steps=T, finished=steps == T)
        os.makedirs(d / "eval", exist_ok=True)
        with open(d / "eval" / "step_30.json", "w") as f:
            json.dump({"step": 30, "results": {"arith": {"avg@8": avg, "n": 8, "pass@1": avg, "pass@2": avg + 0.05,
                                                          "pass@4": avg + 0.1, "pass@8": avg + 0.2}}}, f)
    (root / "grpo_ds" / "seed_1" / "train.log").write_text(
        "python -m stare_jax.train ...\nerror: dynamic sampling kept only 7 of the 8 groups needed\n")
    jobs = [(rows[0], 0), (rows[0], 1), (rows[1], 0), (rows[1], 1)]  # stare seed 1 never ran
    labels = {r.name: r.label for r in rows}
    text = rms.at_step_table(str(root), jobs, 30, labels, T)
    lines = text.splitlines()
    assert len(lines) == 2 + 3 + 1  # header, 3 runs that reached step 30, one mean row (grpo_ds has 2 seeds)
    assert "GRPO-ds seed 1 | 0.400 | 0.400 | 0.450 | 0.500 | 0.600 | 0.40 | no: stopped (dynamic sampling kept" in text
    assert "GRPO-ds seed 0 | 0.600" in text and "| yes |" in text
    assert "**GRPO-ds, mean of 2 seeds** | **0.500** |" in text
    assert rms.stop_reason(str(root / "grpo_ds" / "seed_1")) == "dynamic sampling kept only 7 of the 8 groups needed"
    assert rms.stop_reason(str(root / "stare" / "seed_0")) is None
    assert rms.checkpoint_steps(str(root / "stare" / "seed_0")) == []


def test_quadrant_findings_with_a_row_whose_runs_all_stopped(tmp_path):
    T, root = 40, tmp_path / "q"
    runs = {"grpo_ds": (0.2, 0.3, 0.7), "q_phr": (0.6, 0.3, 0.6), "q_plr": (0.05, 0.3, 0.32), "q_nhr": (0.3, 0.3, 0.65)}
    for row, (h, a0, a1) in runs.items():
        fake_run(str(root / row / "seed_0"), np.full(T, h), acc0=a0, acc1=a1)
    # NLR unlearns: accuracy falls to 0 and dynamic sampling stops the run at step 12
    d = root / "q_nlr" / "seed_0"
    fake_run(str(d), np.full(12, 0.4), total_steps=T, acc0=0.2, acc1=0.0, finished=False)
    (d / "train.log").write_text("error: dynamic sampling kept only 8 of the 16 groups needed\n")
    text = quadrant_study.report(str(root), quadrant_study.ROWS, [0], T, 0.35, 8, "", "", None, "cmd")
    assert "(no finished run: NLR)" in text
    assert "- [x] 3. NHR learns faster than NLR" in text and "NLR 0.100" in text
    assert "- q_nlr seed 0 stopped after 12 of 40 steps (last 10: train accuracy 0.082" in text
    assert "dynamic sampling kept only 8 of the 16" in text


def test_step_profile_of_one_and_of_several_steps(tmp_path, tiny_checkpoints):
    """step_profile takes medians over the steps after the first (which compiles); a one-step run
    (accelerator_figures.py recipe --steps 1) is summarised from its only step, flagged, not NaN."""
    rms = _load("real_model_study")
    model_dir = next(iter(tiny_checkpoints.values()))
    run = tmp_path / "run"
    os.makedirs(run)
    (run / "config.json").write_text(json.dumps({"model.path": model_dir, "data.prompt_batch_size": 2,
                                                 "rollout.group_size": 4, "rollout.max_new_tokens": 8}))

    def write(rows):
        with open(run / "metrics.jsonl", "w") as f:
            for i, (gen, upd) in enumerate(rows, start=1):
                f.write(json.dumps({"step": i, "generate_s": gen, "reward_s": 0.1, "rollout_s": gen + 0.2,
                                    "update_s": upd, "step_s": gen + upd + 0.3, "prompt_len": 16,
                                    "dynamic_sampling_gen_batches": 1}) + "\n")

    write([(30.0, 40.0)])
    one = rms.step_profile(str(run), 100.0)
    assert one["first_step_only"] and one["steps"] == 1 and one["update_s"] == 40.0
    assert np.isfinite(one["update_mfu"]) and one["update_tflop"] > 0
    write([(30.0, 40.0), (2.0, 3.0), (4.0, 5.0)])
    several = rms.step_profile(str(run), 100.0)
    assert not several["first_step_only"] and several["steps"] == 2
    assert several["generate_s"] == 3.0 and several["update_s"] == 4.0
    assert abs(several["host_other_s"] - 0.1) < 1e-9


def test_run_jobs_reuses_finished_runs_records_failures_and_logs(tmp_path):
    """The studies' shared job loop: a finished run is not started again, a failing run is logged
    and the loop goes on, and every line lands in ROOT/study.log."""
    import subprocess

    root = str(tmp_path)
    Row = entropy_study.Row
    a, b, c = Row("a", "A", "x.py"), Row("b", "B", "x.py"), Row("c", "C", "x.py")
    fake_run(os.path.join(root, "a", "seed_0"), np.full(10, 0.3))  # finished: 10 of 10 steps and its eval
    started = []

    def run(row, seed):
        started.append((row.name, seed))
        if row.name == "b":
            raise subprocess.CalledProcessError(3, ["train"])
        return 1.0

    log = entropy_study.study_logger(root)
    failed = entropy_study.run_jobs([(a, 0), (b, 0), (c, 1)], root, 10, run, log,
                                    done=lambda row, seed, run_dir: f"done {row.name} in {os.path.basename(run_dir)}")
    assert started == [("b", 0), ("c", 1)]
    assert failed == ["b seed 0"]
    text = open(os.path.join(root, "study.log")).read()
    assert "a seed 0: finished, reused" in text and "FAILED" in text and "done c in seed_1" in text


@pytest.mark.parametrize("study", ["entropy_study", "quadrant_study"])
def test_study_lists_its_rows_and_refuses_unknown_ones(study, tmp_path, capsys):
    mod = entropy_study if study == "entropy_study" else quadrant_study
    assert mod.main(["--list"]) == 0
    listed = capsys.readouterr().out.split("\n")
    assert [line.split()[0] for line in listed if line] == [r.name for r in mod.ROWS]
    assert mod.main(["--root", str(tmp_path), "--rows", f"{mod.ROWS[0].name},nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown rows ['nope']" in err and mod.ROWS[0].name in err
    assert not os.listdir(tmp_path)  # nothing started


@pytest.mark.parametrize("study", ["entropy_study", "quadrant_study", "real_model_study"])
@pytest.mark.parametrize("args", [["--steps", "0"], ["--steps", "-3"], ["--steps", "x"], ["--seeds", "0,a"]])
def test_study_refuses_bad_steps_and_seeds_before_starting(study, args, tmp_path, capsys):
    """`--steps 0` once fell back to the config's full length (`a.steps or base.total_steps`) and
    started the whole study; a negative one reached every run. Both, and seeds that are not
    integers, are usage errors (exit 2) now, before any run starts."""
    mod = {"entropy_study": entropy_study, "quadrant_study": quadrant_study}.get(study) or _load(study)
    with pytest.raises(SystemExit) as e:
        mod.main(["--root", str(tmp_path), *args])
    assert e.value.code == 2 and f"argument {args[0]}: " in capsys.readouterr().err
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("study", ["entropy_study", "quadrant_study", "real_model_study"])
def test_study_refuses_a_root_or_output_it_cannot_use_before_starting(study, tmp_path, capsys):
    """`--root ''` once ran the study in the current directory, and a root under a file crashed in
    makedirs; both are one line and exit 2 before anything starts, as is a figure or table path
    that could not be written at the study's end."""
    mod = {"entropy_study": entropy_study, "quadrant_study": quadrant_study}.get(study) or _load(study)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for root, needle in (("", "--root: empty"), (str(afile / "r"), "cannot be created or written in")):
        assert mod.main(["--root", root, "--steps", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith(f"{study}: ") and needle in err, err
    # the figure and the table are written at the end: a path that cannot take them is refused first
    for flag, out, reason in (("--out", afile / "f.png", "Not a directory"), ("--table", tmp_path, "is a directory")):
        assert mod.main(["--root", str(tmp_path / "r"), "--steps", "1", flag, str(out)]) == 2
        assert capsys.readouterr().err.strip() == f"{study}: {flag}: {out}: cannot be written ({reason})"
    assert os.listdir(tmp_path) == ["afile"]


@pytest.mark.parametrize("study", ["entropy_study", "quadrant_study", "real_model_study"])
def test_a_partial_study_does_not_overwrite_the_committed_figure(study, tmp_path, monkeypatch):
    """A run of one row (or other seeds) once wrote its partial figure over the one the docs show
    (docs/figures/<study>.png, the `--out` default): the full default study still writes there, a
    narrower one writes ROOT/<study>.png, and `--out` wins over both."""
    mod = {"entropy_study": entropy_study, "quadrant_study": quadrant_study}.get(study) or _load(study)
    figures = []
    monkeypatch.setattr(mod, "report", lambda root, *args, **kw: figures.append(
        next(x for x in args if isinstance(x, str) and x.endswith(".png"))) or "")
    committed = os.path.join("docs", "figures", f"{study}.png")
    one_row = mod.ROWS[0].name
    for argv, expected in [([], committed), (["--rows", one_row], str(tmp_path / f"{study}.png")),
                           (["--seeds", "7"], str(tmp_path / f"{study}.png")),
                           (["--rows", one_row, "--out", str(tmp_path / "mine.png")], str(tmp_path / "mine.png"))]:
        assert mod.main(["--root", str(tmp_path), "--report-only", *argv]) == 0
        assert os.path.normpath(figures[-1]) == os.path.normpath(expected), argv


def test_bench_checkpoint_variants_agree_and_a_missing_model_is_refused(tmp_path, tiny_checkpoints, capsys):
    """scripts/bench_checkpoint.py: the shipped leaf-by-leaf digest and the whole-state program it
    replaced give the same sums on a real train state; plain and zstd checkpoints of it (perturbed as
    if trained) restore to the same state; a --model without config.json exits 2."""
    bc = _load("bench_checkpoint")
    model_dir = tiny_checkpoints["qwen2"]
    leaf, whole = (bc.digest_worker(model_dir, variant, repeats=1) for variant in bc.VARIANTS["digest"])
    assert leaf["fingerprint"] == whole["fingerprint"] and leaf["leaves"] == whole["leaves"] > 3
    assert len(leaf["repeat_s"]) == 1 and leaf["distinct_shapes"] < leaf["leaves"]
    plain, zstd = (bc.save_worker(model_dir, variant, repeats=0) for variant in bc.VARIANTS["save"])
    assert plain["fingerprint"] == zstd["fingerprint"] != leaf["fingerprint"]  # a state as if trained
    assert len(plain["saves"]) == 1 and plain["state_bytes_written_mb"] > 0 and plain["restore_s"] > 0
    assert bc.main(["--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
