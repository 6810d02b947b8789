"""Contract 8: a bad config exits with status 2 and one line naming the key, before compiling."""

import os
import subprocess
import sys

import pytest

from stare_jax import config as config_lib
from tests.e2e_helpers import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")


def _load(capsys, *overrides):
    with pytest.raises(SystemExit) as exc:
        config_lib.load_config_or_exit(["train", "--config", QUICKSTART, *overrides])
    err = capsys.readouterr().err.strip()
    return exc.value.code, err


@pytest.mark.parametrize("override, key", [
    ("--config.stare.nope=1", "stare.nope"),                 # unknown key
    ("--config.nope=1", "nope"),                             # unknown top-level key
    ("--config.stare.w=heavy", "stare.w"),                   # wrong type
    ("--config.seed=1.5", "seed"),                           # wrong type (float for int)
    ("--config.stare.top_p_ratio=1.5", "stare.top_p_ratio"), # out of range
    ("--config.stare.top_p_ratio_minus=-0.1", "stare.top_p_ratio_minus"),
    ("--config.rollout.group_size=1", "rollout.group_size"), # group of one has no advantage
    ("--config.loss.name=ppo_magic", "loss.name"),           # unknown registry name
    ("--config.stare.variant=O3", "stare.variant"),
    ("--config.model.dtype=float16", "model.dtype"),
    ("--config.model.matmul_precision=highest", "model.matmul_precision"),  # JAX's alias, not ours
    ("--config.model.gpu_gemm=triton", "model.gpu_gemm"),   # auto | xla | cublas
    ("--config.ppo.num_minibatches=3", "ppo.num_minibatches"),  # does not divide the batch
    ("--config.data.prompt_batch_size=100000", "data.prompt_batch_size"),  # more prompts than the split has
    ("--config.mesh.cpu_devices=-1", "mesh.cpu_devices"),
    ("--config.ppo.share_prompt=maybe", "ppo.share_prompt"),
    ("--config.loss.hapo_alpha=0", "loss.hapo_alpha"),       # issue 18: alpha <= 0
    ("--config.loss.hapo_phi=-2", "loss.hapo_phi"),          # phi <= 0
    ("--config.loss.entropy_adv_alpha=0", "loss.entropy_adv_alpha"),
    ("--config.loss.entropy_adv_kappa=-1", "loss.entropy_adv_kappa"),
    ("--config.loss.w_reinforce_lambda=1.5", "loss.w_reinforce_lambda"),
    ("--config.loss.quadrants=PHR,HIGH", "loss.quadrants"),  # unknown quadrant name
    ("--config.loss.quadrants=,", "loss.quadrants"),         # empty after parsing
])
def test_bad_config_exits_2_naming_the_key(capsys, override, key):
    code, err = _load(capsys, override)
    assert code == 2
    assert len(err.splitlines()) == 1
    assert key in err
    assert "allowed" in err or "could not convert" in err or "invalid literal" in err


@pytest.mark.parametrize("override, line", [
    # an unknown section is named itself, with the top-level entries (once an empty list)
    ("--config.rl.method=stare", "config error: rl: unknown section; allowed: advantage, "),
    # a misspelt key: the nearest known one, then what its section allows
    ("--config.rollout.temperture=1", "config error: rollout.temperture: unknown key; did you mean "
                                      "rollout.temperature? allowed in rollout: rollout.compact_min_rows, "),
    # a known name in the wrong section
    ("--config.stare.hapo_alpha=1", "config error: stare.hapo_alpha: unknown key; did you mean loss.hapo_alpha? "
                                    "allowed in stare: stare.adaptive, "),
    # a misspelt section: named, with the section above it (subsections listed as entries)
    ("--config.model.embeded.hidden_size=8", "config error: model.embeded: unknown section; did you mean "
                                             "model.embedded.hidden_size? allowed in model: model.attention_block, model.cpu_gemm, "),
    ("--config.stare.zzz=1", "config error: stare.zzz: unknown key; allowed in stare: stare.adaptive, "),
])
def test_unknown_key_names_its_first_unknown_part_and_the_nearest_key(capsys, override, line):
    code, err = _load(capsys, override)
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(line), err
    section = line.split("allowed in ")[1].split(":")[0] if "allowed in " in line else ""
    entries = err.split(": ", 3)[-1].split(", ")
    assert entries and all(e.startswith(section) for e in entries)  # every entry of that section, no other
    assert ("model.embedded" in entries) == (section == "model")


def test_polarity_entropy_keys_accept_good_values():
    c = config_lib.load_config_or_exit(["train", "--config", QUICKSTART, "--config.loss.name=hapo",
                                        "--config.loss.quadrants=phr, NHR", "--config.loss.w_reinforce_lambda=0"])
    assert c.loss.name == "hapo" and config_lib.parse_quadrants(c.loss.quadrants) == ("PHR", "NHR")


def test_message_lists_allowed_values(capsys):
    _, err = _load(capsys, "--config.loss.name=ppo_magic")
    assert "'grpo'" in err and "'stare'" in err and "'clip_cov'" in err


def test_quickstart_configs_are_valid():
    for name in ("quickstart.py", "quickstart_grpo.py"):
        c = config_lib.load_config_file(os.path.join(ROOT, "configs", name))
        config_lib.validate(c)
    grpo = config_lib.load_config_file(os.path.join(ROOT, "configs", "quickstart_grpo.py"))
    assert grpo.loss.name == "grpo" and not grpo.stare.enabled


def test_unknown_key_inside_a_config_file_is_caught():
    c = config_lib.default_config()
    c.stare.wieght = 1.2
    with pytest.raises(config_lib.ConfigError, match="stare.wieght: unknown key; allowed in stare: stare.adaptive"):
        config_lib.validate(c)


def test_stare_loss_requires_stare_enabled():
    c = config_lib.default_config()
    c.stare.enabled = False
    with pytest.raises(config_lib.ConfigError, match="stare.enabled"):
        config_lib.validate(c)


def _cli(*args, devices=8):
    return subprocess.run([sys.executable, "-m", "stare_jax.train", "--config", QUICKSTART, *args],
                          capture_output=True, text=True, env=subprocess_env(devices), cwd=ROOT, timeout=120)


def test_cli_batch_not_divisible_by_devices_exits_2(tmp_path):
    r = _cli("--workdir", str(tmp_path / "w"), "--config.data.prompt_batch_size=3", "--config.rollout.group_size=3")
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "data.prompt_batch_size" in last and "8 batch shards" in last
    assert not (tmp_path / "w").exists()  # nothing was created: the run never started


def test_cli_mesh_that_does_not_fit_exits_2(tmp_path):
    r = _cli("--workdir", str(tmp_path / "w"), "--config.mesh.data=3")
    assert r.returncode == 2 and "mesh.data" in r.stderr.strip().splitlines()[-1]


def test_cli_missing_workdir_exits_2():
    r = _cli()
    assert r.returncode == 2 and "--workdir" in r.stderr


def test_cli_unknown_flag_exits_2_naming_the_flags_it_takes(tmp_path):
    r = _cli("--workdir", str(tmp_path / "w"), "--restarts", "1", "--step", "3")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and last.startswith("config error: --step: unknown argument"), r.stderr
    assert "--workdir DIR" in last and "--restarts N" in last
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args, named", [
    (["--bogus-flag"], "--bogus-flag"),                          # a misspelt or foreign flag
    (["stray"], "stray"),                                        # a positional argument
    (["--config.seed=3", "x"], "x"),
    (["--config.logging.progress", "False"], "--config.logging.progress=False"),  # a boolean's value goes after =
])
def test_arguments_absl_would_ignore_are_refused(capsys, args, named):
    """absl's `known_only` parsing drops what it does not know, so a misspelt flag would silently
    change nothing (and `--config.BOOL False` would set True): each is refused, naming it."""
    code, err = _load(capsys, *args)
    assert code == 2 and len(err.splitlines()) == 1 and named in err and "unknown argument" in err, err
    assert config_lib.unknown_arguments(["--config", "f.py", "--config.seed", "3", "--config.logging.progress",
                                         "--config.stare.w=2"]) == []


@pytest.mark.parametrize("text, named", [
    ("x = 1\n", "AttributeError"),                                   # no get_config()
    ("def get_config():\n    return 5\n", "returned int"),          # not a ConfigDict
    ("def get_config():\n    raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("def get_config(:\n", "SyntaxError"),
])
def test_a_config_file_that_does_not_give_a_config_exits_2_naming_it(capsys, tmp_path, text, named):
    path = tmp_path / "my_config.py"
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        config_lib.load_config_or_exit(["train", "--config", str(path)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert str(path) in err and named in err and "get_config() returns" in err, err


def test_overrides_are_applied_not_silently_dropped():
    c = config_lib.load_config_or_exit(["train", "--config", QUICKSTART, "--config.stare.w=2.5",
                                        "--config.loss.name=grpo", "--config.stare.enabled=False"])
    assert c.stare.w == 2.5 and c.loss.name == "grpo" and c.stare.enabled is False


def test_cli_cpu_devices_split_the_host_before_jax_starts(tmp_path):
    """mesh.cpu_devices=5 gives the run 5 CPU devices (here: a batch of 16 x 8 rows that 5 batch
    shards cannot split, refused with exit 2), whatever the XLA flag says."""
    r = _cli("--workdir", str(tmp_path / "w"), "--config.mesh.cpu_devices=5", devices=1)
    assert r.returncode == 2, r.stderr
    assert "5 batch shards" in r.stderr.strip().splitlines()[-1]


def test_cpu_devices_after_jax_started_is_refused_unless_it_matches():
    import jax

    from stare_jax import distributed

    n = len(jax.devices("cpu"))
    distributed.use_cpu_devices(n)  # already what the backend has: nothing to do
    with pytest.raises(RuntimeError, match="mesh.cpu_devices"):
        distributed.use_cpu_devices(n + 1)


def _other_value(key):
    default = config_lib.flatten(config_lib.default_config())[key]
    return "/some/file.jsonl" if isinstance(default, str) else default + 1


@pytest.mark.parametrize("name", sorted(config_lib.DATA_KEYS_BY_TASK))
def test_every_data_key_of_another_task_is_refused_naming_it(name):
    """Issue 19 item 5: a data.* key that the chosen data.name does not read is refused, not ignored,
    for every (task, other task's key) combination of DATA_KEYS_BY_TASK."""
    unused = config_lib.task_keys_unused_by(name)
    assert unused, "every task should leave some other task's key unused"
    for key in unused:
        c = config_lib.default_config()
        c.data.name = name
        c.data.train_files = c.data.train_files or ("x.jsonl" if name == "math" else "")
        c.model.path = "m" if name == "math" else ""
        c.reward.name = "math" if name == "math" else "countdown"
        c.data[key.split(".", 1)[1]] = _other_value(key)
        with pytest.raises(config_lib.ConfigError, match=rf"{key}: set to .* data.name='{name}' does not use it"):
            config_lib.validate(c)


def test_data_name_chosen_on_the_command_line_drops_the_files_other_task_settings(capsys, tmp_path):
    """quickstart sets data.num_train (a countdown key); choosing data.name=math on the command line
    is not refused for it, but a countdown key given on the same command line is."""
    train = tmp_path / "t.jsonl"
    train.write_text('{"question": "1+1?", "answer": "2"}\n')
    base = ["train", "--config", QUICKSTART, "--config.data.name=math", f"--config.data.train_files={train}",
            "--config.reward.name=math", f"--config.model.path={tmp_path}"]
    c = config_lib.load_config_or_exit(base)
    assert c.data.num_train == config_lib.default_config().data.num_train
    with pytest.raises(SystemExit) as exc:
        config_lib.load_config_or_exit(base + ["--config.data.num_eval=5"])
    assert exc.value.code == 2
    assert "data.num_eval: set to 5, but data.name='math' does not use it" in capsys.readouterr().err


def test_missing_paths_are_config_errors(tmp_path):
    c = config_lib.default_config()
    c.model.path = str(tmp_path / "nope")
    with pytest.raises(config_lib.ConfigError, match="model.path: .*nope: no such directory"):
        config_lib.check_paths(c)
    c.model.path = str(tmp_path)
    with pytest.raises(config_lib.ConfigError, match="has no config.json"):
        config_lib.check_paths(c)
    (tmp_path / "config.json").write_text("{}")
    c.data.name, c.data.train_files = "math", str(tmp_path / "missing.jsonl")
    with pytest.raises(config_lib.ConfigError, match="data.train_files: .*missing.jsonl: no such file"):
        config_lib.check_paths(c)


def test_directories_the_run_would_make_must_be_possible_to_make(tmp_path):
    """The TFDS data directory and the compilation cache, where absent, must be possible to create
    (a makedirs traceback mid-start before); nothing is left behind by the check, and an existing
    data directory may be read-only (built datasets)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for key in ("data.data_dir", "compilation_cache_dir"):
        c = config_lib.default_config()
        sub = c.data if key.startswith("data.") else c
        setattr(sub, key.split(".")[-1], str(afile / "d"))
        with pytest.raises(config_lib.ConfigError, match=f"^config error: {key}: .*afile/d: cannot be created or "
                                                         f"written in \\(Not a directory\\)"):
            config_lib.check_paths(c)
        setattr(sub, key.split(".")[-1], str(tmp_path / "new" / "d"))
        config_lib.check_paths(c)
        assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_what_the_environment_lacks_for_a_setting_is_a_config_error(monkeypatch):
    """An optional package a setting needs (wandb for logging.wandb, gcsfs or TensorFlow for a gs://
    compilation cache) is checked before the run starts: one line, not a traceback mid-run (wandb)
    or a warning per cached program (gs://)."""
    import importlib.util

    c = config_lib.default_config()
    present = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "gcsfs", "tensorflow")
                        else present(name, *a))
    c.logging.wandb = True
    with pytest.raises(config_lib.ConfigError, match="logging.wandb: True, but the wandb package is not installed"):
        config_lib.check_paths(c)
    c.logging.wandb = False
    c.compilation_cache_dir = "gs://bucket/cache"
    with pytest.raises(config_lib.ConfigError, match="needs the gcsfs package"):
        config_lib.check_paths(c)
    c.compilation_cache_dir = "ftp://host/cache"
    with pytest.raises(config_lib.ConfigError, match="unknown URL scheme 'ftp'"):
        config_lib.check_paths(c)
    monkeypatch.setattr(importlib.util, "find_spec", present)
    monkeypatch.setitem(config_lib.URL_CACHE_BACKENDS, "gs", ("json",))  # a backend that is installed
    c.compilation_cache_dir = "gs://bucket/cache"
    config_lib.check_paths(c)


def test_every_key_added_since_saved_runs_is_declared_so_they_still_resume():
    """A run saved before a key existed must resume after the upgrade: each new key needs its
    old-behaviour value in checkpoint.ADDED_KEYS (rollout.slots was once missed, and every run saved
    before it refused to resume with "config differs in rollout.slots: None -> 0")."""
    from stare_jax import checkpoint as ckpt_lib

    path = os.path.join(os.path.dirname(__file__), "config_keys_before_issue18.txt")
    with open(path) as f:
        old_keys = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    current = ckpt_lib.config_to_json(config_lib.default_config())
    added = sorted(set(current) - old_keys)
    undeclared = [k for k in added if k not in ckpt_lib.ADDED_KEYS and not any(
        k == p or (p.endswith(".") and k.startswith(p)) for p in ckpt_lib.RESUMABLE_CHANGES)]
    assert undeclared == [], f"keys added without an old-behaviour value in checkpoint.ADDED_KEYS: {undeclared}"
    # and the declared value is the default, so a saved run resumes under the default config
    assert all(current[k] == ckpt_lib.ADDED_KEYS[k] for k in added if k in ckpt_lib.ADDED_KEYS)
    saved = {k: v for k, v in current.items() if k in old_keys}
    assert ckpt_lib.incompatible_keys(saved, current) == []


@pytest.mark.parametrize("module, flag", [("stare_jax.train", "--help"), ("stare_jax.evaluate", "-h")])
def test_help_prints_the_usage_and_every_config_key_with_its_default(module, flag):
    r = subprocess.run([sys.executable, "-m", module, "--config", QUICKSTART, flag], cwd=ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    assert f"python -m {module} --config configs/quickstart.py --workdir" in r.stdout
    listed = dict(line.strip().split(" = ", 1) for line in r.stdout.splitlines() if line.startswith("  ") and " = " in line)
    assert set(listed) == set(config_lib.SCHEMA)
    assert listed["stare.w"] == repr(config_lib.default_config().stare.w)
