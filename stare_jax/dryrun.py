"""Dry run: compile a config's rollout and update step for N devices, without weights or accelerators.

    python -m stare_jax.dryrun --config configs/paper/qwen2_5_math_7b_stare.py --devices 64 --chip v5p \
        [--preset NAME] [--config.key=value ...]

Both jitted programs of a training step are lowered and compiled ahead of time on N simulated CPU
devices laid out as the config's mesh (`mesh.*`, one axis may be -1):

* the sampler: `stare_jax.rollout.sampler`'s jitted `grouped_rollout` for `data.prompt_batch_size`
  prompts of `data.max_prompt_len` tokens, `rollout.group_size` responses of `rollout.max_new_tokens`
  (compacting with `rollout.compact_min_rows`; with `rollout.slots` the slot-refilling sampler, whose
  KV cache holds that many rows), built by the same `sampler.rollout_spec` as a run's;
* the update step: `stare_jax.rl.update.make_update_step` on the full batch of prompts x responses;
* with `--phases ...,eval`, also the evaluation sampler (eval.n responses per prompt, the prompt
  batch of `trainer.evaluate_model`, times the run's host count: `--processes`, which sets
  `distributed.num_processes`, else the config's).

Every argument is abstract: the train state comes from `nnx.eval_shape` (parameters, AdamW moments,
controller) with the partition rules' shardings, the batch and the rng are `jax.ShapeDtypeStruct`s
with their shardings. No weight is read or allocated, so the architecture comes from a preset
(`stare_jax.models.presets`: `--preset`, else `model.preset`, else `model.path/config.json` when that
directory exists) and `model.path` / `data.train_files` may be left empty.

For each program it prints the compile time and the per-device memory that `memory_analysis()` of
the compiled executable reports (argument, output, alias, temp, generated code), plus the exact
per-device bytes of parameters and optimizer state from their shardings, and compares the larger
phase with the chip's memory (`CHIP_HBM_GIB`). On CPU, XLA's temp figure misses fused scratch
buffers and is a lower bound (STACK_NOTES.md, "Memory analysis"); the verdict says so. The last
line printed is one JSON object with every figure.

The sampler's footprint also counts the train state it does not take as an argument (AdamW
moments, controller), which stays on the device while sampling. With `mesh.rollout_devices` = k the
samplers compile on the rollout mesh (the first k devices of each of `distributed.num_processes`
processes, data-parallel) with a copy of the policy there, and the whole train state counts as
resident beside it. `--explain K` lists the K largest
temporary buffers of each program from XLA's buffer assignment, which is how one finds what to
change (docs/dryrun.md shows an example).

Exit status: 0 when the programs compiled (whether or not they fit; `--strict` makes "does not
fit" exit 3), 2 for a config error (one line naming the key, as in training), 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Any, Sequence

# Per-device accelerator memory (GiB) of one JAX device of each kind: a v5p / v4 "device" is one chip
# (its two TensorCores form a megacore), so `v5p-128` is 64 devices of 95 GiB.
CHIP_HBM_GIB: dict[str, float] = {
    "v5p": 95.0, "v5e": 16.0, "v4": 32.0, "v6e": 32.0, "h100": 80.0, "h200": 141.0, "a100": 80.0,
}
PLACEHOLDER = "dryrun:no-weights"   # stands in for model.path / data.train_files, which a dry run never reads
CPU_TEMP_NOTE = ("temp is XLA's CPU figure: it misses fused scratch buffers, so it is a lower bound of what "
                 "a TPU/GPU compile reports; leave headroom")
GIB = float(1 << 30)
PHASES = ("rollout", "update", "eval")
TIGHT_FRACTION = 0.85  # above this share of the chip's memory a fit is flagged as tight (temp is a lower bound)


class DryRunError(RuntimeError):
    """A dry run could not be set up (no architecture, bad preset, unknown chip)."""


# ----------------------------------------------------------------------------- command line

def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(dry-run flags, the `--config.a.b=value` overrides) from argv (without the program name)."""
    p = argparse.ArgumentParser(
        prog="python -m stare_jax.dryrun", allow_abbrev=False,
        description="Ahead-of-time compile a config's rollout and update step for N devices; print memory.",
        epilog="Any config key can be overridden with --config.a.b=value, as in training. Exit status: 0 compiled, "
               "2 config error, 3 does not fit (with --strict), 1 other errors. Details: docs/dryrun.md.")
    p.add_argument("--config", required=True, help="config file (get_config())")
    p.add_argument("--devices", type=int, required=True, help="global device count N (simulated on CPU)")
    p.add_argument("--chip", default="v5p", type=str.lower, choices=sorted(CHIP_HBM_GIB),
                   help="accelerator whose per-device memory the result is compared with (default v5p)")
    p.add_argument("--hbm-gib", type=float, default=None,
                   help="per-device memory in GiB, instead of the chip's table value")
    p.add_argument("--preset", default="", help="architecture preset (default: model.preset of the config)")
    p.add_argument("--phases", default="rollout,update",
                   help="comma-separated subset of rollout,update,eval to compile (default rollout,update; "
                        "eval = the evaluation sampler, eval.n responses per prompt)")
    p.add_argument("--processes", type=int, default=None,
                   help="host processes of the run (sets distributed.num_processes, default the config's): the "
                        "eval sampler's batch (each host adds its prompts) and, with mesh.rollout_devices, the "
                        "rollout mesh")
    p.add_argument("--strict", action="store_true", help="exit 3 when the config does not fit the chip")
    p.add_argument("--explain", type=int, default=0, metavar="K",
                   help="also list the K largest temporary buffers of each program (from XLA's buffer assignment)")
    args, rest = p.parse_known_args(list(argv))
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        p.error(f"unrecognised arguments: {' '.join(bad)} (config overrides are --config.a.b=value)")
    if args.devices < 1:
        p.error("--devices must be >= 1")
    if args.hbm_gib is not None and not args.hbm_gib > 0:  # (NaN too)
        p.error(f"--hbm-gib must be a number of GiB > 0, got {args.hbm_gib}")
    if args.explain < 0:
        p.error(f"--explain must be >= 0, got {args.explain}")
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not phases or any(x not in PHASES for x in phases):
        p.error("--phases must be a comma-separated subset of " + ",".join(PHASES))
    if args.processes is not None:
        if args.processes < 1:
            p.error("--processes must be >= 1")
        rest = with_process_count(rest, args.processes, p.error)
    args.phases = phases
    return args, rest


def with_process_count(overrides: list[str], processes: int, error) -> list[str]:
    """The overrides with `--config.distributed.num_processes=processes` added, so the eval batch, the
    rollout mesh and the config checks all read one host count; `error(message)` when the overrides
    already set a different one."""
    key = "--config.distributed.num_processes="
    given = [a[len(key):] for a in overrides if a.startswith(key)]
    if not given:
        return [*overrides, f"{key}{processes}"]
    if any(g.strip() != str(processes) for g in given):
        error(f"--processes {processes} disagrees with {key}{given[-1]}: give one of them")
    return overrides


def force_cpu_devices(n: int, dump_dir: str | None = None) -> None:
    """Makes the CPU backend expose `n` devices and the only platform (and, with `dump_dir`, makes XLA
    write each compiled program's buffer assignment there), and makes the projections' products round
    their own results as on an accelerator (`products.CPU_FLOAT32_PRODUCTS`). Call before JAX
    initialises."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(
        "--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    if dump_dir:
        flags = [f for f in flags if not f.startswith("--xla_dump_to")] + [f"--xla_dump_to={dump_dir}"]
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from stare_jax.distributed import use_cpu_devices

    jax.config.update("jax_platforms", "cpu")
    use_cpu_devices(n)
    from stare_jax.models import products

    products.CPU_FLOAT32_PRODUCTS = False  # the compiles stand in for an accelerator's programs


def load_config(config_path: str, overrides: Sequence[str], num_devices: int):
    """The validated config (exit 2 with one line on a config error), with placeholders for the
    `model.path` / `data.train_files` a dry run does not read. Returns (config, placeholder keys)."""
    from stare_jax import config as config_lib

    given = {a.split("=", 1)[0][len("--config."):] for a in overrides}
    try:
        base = config_lib.load_config_file(config_path)
    except Exception:  # load_config_or_exit below reports it as a config error
        base = None
    extra, placeholders = [], []
    task = next((a.split("=", 1)[1] for a in overrides if a.startswith("--config.data.name=")),
                base.data.name if base is not None else "")
    for key in ("model.path", "data.train_files"):
        section, name = key.split(".")
        if section == "data" and name not in config_lib.DATA_KEYS_BY_TASK.get(task, ()):
            continue  # a key the task does not read may not be set (config.unused_data_key)
        if key not in given and base is not None and not base[section][name]:
            extra.append(f"--config.{key}={PLACEHOLDER}")
            placeholders.append(key)
    config = config_lib.load_config_or_exit(["dryrun", "--config", config_path, *overrides, *extra])
    try:
        config_lib.validate(config, num_devices=num_devices)
    except config_lib.ConfigError as e:
        print(str(e).replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    return config, placeholders


# ----------------------------------------------------------------------------- building blocks

def model_architecture(config, preset: str = ""):
    """(ModelConfig, source) of the run: `preset`, else `model.preset`, else `model.path/config.json`."""
    from stare_jax.models import load_config as load_hf_config
    from stare_jax.models import presets

    name = preset or config.model.preset
    if name:
        try:
            return presets.preset_config(name), f"preset {presets.resolve_name(name)}"
        except presets.UnknownPresetError as e:
            raise DryRunError(f"config error: model.preset: {e}") from None
    path = config.model.path
    if path and path != PLACEHOLDER and os.path.isfile(os.path.join(path, "config.json")):
        return load_hf_config(path), f"{path}/config.json"
    raise DryRunError("config error: model.preset: empty and model.path has no config.json; allowed: --preset "
                      "or --config.model.preset=NAME with NAME one of " + ", ".join(presets.preset_names()))


def abstract_train_state(config, cfg, mesh=None):
    """`nnx.eval_shape` of the run's train state (policy, AdamW, controller, reference policy when a KL
    term needs one): shapes and dtypes only, nothing allocated."""
    from flax import nnx

    from stare_jax.models.decoder import Decoder
    from stare_jax.models.hf import DTYPES
    from stare_jax.rl import create_train_state

    def make_model():
        """The policy as the trainer builds it (dtype, parameter dtype, remat)."""
        return Decoder(cfg, dtype=DTYPES[config.model.dtype], param_dtype=DTYPES[config.model.param_dtype],
                       remat=config.model.remat, remat_saves=config.model.remat_saves,
                       remat_saves_layers=config.model.remat_saves_layers,
                       attention_block=config.model.attention_block,
                       scan_layers=config.model.scan_layers, mesh=mesh, rngs=nnx.Rngs(0))

    def make():
        """The train state as `create_train_state` builds it."""
        ref = make_model() if config.loss.kl_type != "none" else None
        return create_train_state(make_model(), config, ref_model=ref)

    return nnx.eval_shape(make)


def with_shardings(tree, shardings):
    """`jax.ShapeDtypeStruct` leaves of `tree` carrying the matching `shardings`."""
    import jax

    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of the sharded `jax.ShapeDtypeStruct`s of `tree` (the largest shard of each)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def global_bytes(tree) -> int:
    """Unsharded bytes of the arrays of `tree`."""
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def state_breakdown(state) -> dict[str, int]:
    """Per-device bytes of the sharded abstract train state by part: params (policy), optimizer (AdamW
    moments and count), reference (frozen KL policy) and other (controller, step)."""
    import jax

    from stare_jax import parallel

    parts = {"params": 0, "optimizer": 0, "reference": 0, "other": 0}
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        p = parallel.path_to_str(path)
        part = ("params" if p.startswith("model/") else "optimizer" if p.startswith("optimizer/")
                else "reference" if p.startswith("ref_model/") else "other")
        parts[part] += per_device_bytes([x])
    return parts


def memory_figures(compiled) -> dict[str, int]:
    """Per-device bytes from `compiled.memory_analysis()`, and their sum argument + output - alias +
    temp + generated code (the executable's footprint while it runs)."""
    m = compiled.memory_analysis()
    out = {"argument_bytes": int(m.argument_size_in_bytes), "output_bytes": int(m.output_size_in_bytes),
           "alias_bytes": int(m.alias_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
           "generated_code_bytes": int(m.generated_code_size_in_bytes)}
    out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
                          + out["generated_code_bytes"])
    return out


def timed_compile(jitted_lower) -> tuple[Any, float, float]:
    """(compiled, lower seconds, compile seconds) of a zero-argument function returning a `Lowered`."""
    t0 = time.perf_counter()
    lowered = jitted_lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, t1 - t0, t2 - t1


def buffer_assignment_files(dump_dir: str | None) -> set[str]:
    """The buffer-assignment dumps XLA has written to `dump_dir` so far."""
    if not dump_dir or not os.path.isdir(dump_dir):
        return set()
    return {os.path.join(dump_dir, f) for f in os.listdir(dump_dir) if f.endswith("buffer-assignment.txt")}


def largest_temp_buffers(files, k: int) -> list[dict]:
    """The `k` largest values of the largest preallocated-temp allocation in XLA buffer-assignment
    dumps `files`: [{"bytes", "name", "shape"}]. Values that share memory at different times are
    all listed; the list shows what dominates, not a sum. Empty when the dump has another format."""
    import re

    value = re.compile(r"<\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (.*)$")
    best: list[dict] = []
    best_size = -1
    for path in files:
        current, size = None, -1
        with open(path) as f:
            for line in f:
                if line.startswith("allocation "):
                    if current is not None and size > best_size:
                        best, best_size = current, size
                    m = re.match(r"allocation \d+: size (\d+), preallocated-temp", line)
                    current, size = ([], int(m.group(1))) if m else (None, -1)
                elif current is not None:
                    m = value.search(line.strip())
                    if m:
                        current.append({"bytes": int(m.group(2)), "name": m.group(1), "shape": m.group(3)})
            if current is not None and size > best_size:
                best, best_size = current, size
    best.sort(key=lambda v: -v["bytes"])
    return best[:k]


@dataclasses.dataclass(frozen=True)
class SamplerShape:
    """One call of the sampler: `prompts` x `group_size` rows, `max_new_tokens` each, and how tokens are drawn."""

    prompts: int
    prompt_len: int
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    slots: int = 0             # > 0: the slot-refilling sampler (`rollout.slots` / `eval.slots`)
    compact_min_rows: int = 0  # static sampler: `rollout.compact_min_rows`
    token_stats: bool = False  # the sampler records entropy and Q for the update (`ppo.old_stats`)


def training_sampler_shape(config) -> SamplerShape:
    """The training rollout of `trainer.collect_batch`: one generation batch of the global
    `data.prompt_batch_size` prompts x `rollout.group_size` responses, recording the update's
    pre-update statistics when it takes them from the sampler (`RLSettings.takes_sampler_stats`)."""
    from stare_jax.rl.settings import RLSettings

    r = config.rollout
    return SamplerShape(int(config.data.prompt_batch_size), int(config.data.max_prompt_len), int(r.group_size),
                        int(r.max_new_tokens), float(r.temperature), float(r.top_p), int(r.top_k),
                        slots=int(r.slots), compact_min_rows=int(r.compact_min_rows),
                        token_stats=RLSettings.from_config(config).takes_sampler_stats)


def eval_sampler_shape(config, batch_divisor: int) -> SamplerShape:
    """The evaluation rollout of `trainer.evaluate_model`: each of `distributed.num_processes`
    processes loads min(eval.max_prompts, 64) prompts (raised until prompts x eval.n divides the
    batch shards), the hosts' prompts are gathered, and each gets eval.n responses at
    eval.temperature / eval.top_p."""
    n = int(config.eval.n)
    batch = max(1, min(int(config.eval.max_prompts), 64))
    while (batch * n) % batch_divisor:
        batch += 1
    return SamplerShape(batch * int(config.distributed.num_processes), int(config.data.max_prompt_len), n,
                        int(config.rollout.max_new_tokens), float(config.eval.temperature), float(config.eval.top_p), 0,
                        slots=int(config.eval.slots), compact_min_rows=int(config.rollout.compact_min_rows))


def simulated_rollout_mesh(mesh, per_process: int, processes: int):
    """The mesh `mesh.rollout_devices` = `per_process` gives the rollouts (`parallel.rollout_mesh`),
    with the dry run's one process standing for `processes` processes that each own a block of
    consecutive device ids."""
    from stare_jax import parallel

    block = mesh.devices.size // processes
    return parallel.rollout_mesh(mesh, per_process, process_of=lambda d: d.id // block)


def rollout_program(shape: SamplerShape, cfg, abstract_ts, mesh):
    """(graphdef, sharded abstract policy state, `RolloutSpec`) of the sampler `generate` would run
    for `shape` on `mesh` (the update's mesh, or the rollout mesh of `mesh.rollout_devices`): the
    policy sharded there by the parameter rules, the spec built by `sampler.rollout_spec` with the
    row-major decode layout and XLA's own GEMMs of an accelerator."""
    from flax import nnx

    from stare_jax import parallel
    from stare_jax.rollout.sampler import rollout_spec

    model = nnx.merge(*nnx.split(abstract_ts.model))  # a copy: the update's abstract model keeps its mesh
    if hasattr(model, "mesh"):
        model.mesh = mesh  # as parallel.model_on_mesh names the mesh the copy decodes on
    graphdef, model_state = nnx.split(model)
    model_state = with_shardings(model_state, parallel.param_shardings(model_state, mesh))
    eos_ids = tuple(cfg.eos_token_ids)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    spec = rollout_spec(model.dtype, model_state, rows=shape.prompts * shape.group_size,
                        group_size=shape.group_size, max_new_tokens=shape.max_new_tokens, eos_ids=eos_ids,
                        pad_id=int(pad_id), temperature=shape.temperature, top_p=shape.top_p, top_k=shape.top_k,
                        mesh=mesh, slots=shape.slots, decode_layout="rows",
                        compact_min_rows=shape.compact_min_rows, gpu_gemm="xla", token_stats=shape.token_stats)
    return graphdef, model_state, spec


def compile_rollout(shape: SamplerShape, program):
    """Lowers and compiles the sampler (`stare_jax.rollout.sampler._compiled_rollout`: the jitted
    `grouped_rollout` that `generate` calls, or `slots.slot_rollout` when `shape.slots`) of
    `program` (`rollout_program`) for `shape`, with replicated prompts and key as `generate` passes
    them. Returns (compiled, lower s, compile s, per-device bytes of the policy)."""
    import jax
    import jax.numpy as jnp

    from stare_jax import parallel
    from stare_jax.rollout.sampler import _compiled_rollout

    graphdef, model_state, spec = program
    rep = parallel.replicated(spec.mesh)
    ids = jax.ShapeDtypeStruct((shape.prompts, shape.prompt_len), jnp.int32, sharding=rep)
    mask = jax.ShapeDtypeStruct((shape.prompts, shape.prompt_len), jnp.int32, sharding=rep)
    rng = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=rep)
    fn = _compiled_rollout(graphdef, spec)
    compiled, t_lower, t_compile = timed_compile(lambda: fn.lower(model_state, ids, mask, rng))
    return compiled, t_lower, t_compile, per_device_bytes(model_state)


def abstract_batch(config, mesh) -> dict:
    """The update step's batch as sharded `jax.ShapeDtypeStruct`s: prompts x group_size rows of
    max_prompt_len + max_new_tokens tokens (the dtypes the trainer feeds), with the sampler's entropy
    and Q where the update reads them (`RLSettings.takes_sampler_stats`)."""
    import jax
    import jax.numpy as jnp

    from stare_jax import parallel
    from stare_jax.rl.settings import RLSettings

    N = int(config.data.prompt_batch_size) * int(config.rollout.group_size)
    P, R = int(config.data.max_prompt_len), int(config.rollout.max_new_tokens)
    shapes = {"input_ids": ((N, P + R), jnp.int32), "attention_mask": ((N, P + R), jnp.int32),
              "response_mask": ((N, R), jnp.int32), "old_log_probs": ((N, R), jnp.float32),
              "rewards": ((N,), jnp.float32)}
    if RLSettings.from_config(config).takes_sampler_stats:
        shapes.update({"old_entropy": ((N, R), jnp.float32), "old_pi2_dev": ((N, R), jnp.float32)})
    return {k: jax.ShapeDtypeStruct(s, d, sharding=parallel.batch_sharding(mesh, len(s))) for k, (s, d) in shapes.items()}


def compile_update(config, abstract_ts, mesh):
    """Lowers and compiles `make_update_step(config, mesh, train_state)` on the abstract train state
    and batch. Returns (compiled, lower s, compile s, sharded abstract state)."""
    import jax
    from flax import nnx

    from stare_jax import parallel
    from stare_jax.rl import make_update_step

    step = make_update_step(config, mesh, abstract_ts, cpu_options=False)  # as an accelerator compiles it
    state = with_shardings(nnx.state(abstract_ts), step.state_shardings)
    rng = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=parallel.replicated(mesh))
    batch = abstract_batch(config, mesh)
    compiled, t_lower, t_compile = timed_compile(lambda: step.lower(state, batch, rng))
    return compiled, t_lower, t_compile, state


# ----------------------------------------------------------------------------- report

def gib(n: float) -> str:
    """Bytes as 'x.xx GiB'."""
    return f"{n / GIB:.2f} GiB"


def human(n: float) -> str:
    """Bytes in GiB, MiB or KiB, whichever reads best."""
    for unit, size in (("GiB", GIB), ("MiB", float(1 << 20)), ("KiB", 1024.0)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def run(args: argparse.Namespace, overrides: Sequence[str], out=sys.stdout) -> dict:
    """The dry run proper (JAX already configured for `args.devices` CPU devices); returns the report."""
    import jax
    from flax import nnx

    from stare_jax import parallel
    from stare_jax.models.presets import num_parameters
    from stare_jax.rl.settings import RLSettings
    from stare_jax.rl.train_state import train_state_shardings
    from stare_jax.rl.update import rows_per_shared_prompt
    from stare_jax.rollout.sampler import describe

    config, placeholders = load_config(args.config, overrides, args.devices)
    cfg, source = model_architecture(config, args.preset)
    if jax.device_count() != args.devices:
        raise DryRunError(f"JAX sees {jax.device_count()} devices, not --devices {args.devices}: run the dry run "
                          f"as its own process (python -m stare_jax.dryrun) so it can set the device count")
    mesh = parallel.mesh_from_config(config.mesh)
    hbm = float(args.hbm_gib if args.hbm_gib is not None else CHIP_HBM_GIB[args.chip]) * GIB
    B, G = int(config.data.prompt_batch_size), int(config.rollout.group_size)
    P, R = int(config.data.max_prompt_len), int(config.rollout.max_new_tokens)
    K = int(config.ppo.num_minibatches) * int(config.ppo.grad_accum)
    shards = parallel.batch_divisor(mesh)
    rollout_devices = int(config.mesh.rollout_devices)
    rmesh = simulated_rollout_mesh(mesh, rollout_devices, int(config.distributed.num_processes))

    def say(text=""):
        """One line of the human-readable report."""
        print(text, file=out, flush=True)

    say(f"dry run: {args.config}  ({source}: {cfg.architecture}, {num_parameters(cfg) / 1e9:.2f}B parameters)")
    say(f"  devices {args.devices} x {args.chip} ({hbm / GIB:.0f} GiB each), mesh "
        + " x ".join(f"{a}={mesh.shape[a]}" for a in parallel.MESH_AXES)
        + f", dtype {config.model.dtype} / params {config.model.param_dtype}, remat {config.model.remat}"
        + (f" (saves {config.model.remat_saves}"
           + (f" in the last {config.model.remat_saves_layers} layers" if config.model.remat_saves_layers >= 0 else "")
           + ")" if config.model.remat else "")
        + (f", attention in blocks of {config.model.attention_block} beyond that length"
           if config.model.attention_block else ", attention with the whole score matrix"))
    shared = rows_per_shared_prompt(RLSettings.from_config(config))
    block = int(config.model.attention_block)
    say(f"  step: {B} prompts x {G} responses = {B * G} rows, prompt {P} + response {R} tokens; "
        f"{B * G // shards} rows per batch shard, update in {K} micro-batch(es) of {B * G // K // shards} rows "
        f"per shard, "
        + (f"each prompt once for its {shared} rows of a micro-batch (responses' attention "
           + ("in blocks" if 0 < block < R else "kept whole") + ")" if shared > 1 else "every row with its own prompt"))
    if rollout_devices:
        say(f"  rollouts decode on mesh.rollout_devices={rollout_devices}: a data-parallel mesh of "
            f"{rmesh.devices.size} device(s) holding a copy of the policy beside the train state")
    if placeholders:
        say(f"  ({', '.join(placeholders)} not needed: no weights or data are read)")

    t0 = time.perf_counter()
    abstract_ts = abstract_train_state(config, cfg, mesh)
    state = nnx.state(abstract_ts)
    state = with_shardings(state, train_state_shardings(state, mesh))
    parts = state_breakdown(state)
    state_total = sum(parts.values())
    say(f"  train state per device (exact, from the shardings): params {gib(parts['params'])}, optimizer "
        f"{gib(parts['optimizer'])}" + (f", reference {gib(parts['reference'])}" if parts["reference"] else "")
        + f", total {gib(state_total)} (of {gib(global_bytes(state))} unsharded)  [{time.perf_counter() - t0:.1f}s]")

    report: dict[str, Any] = {
        "config": args.config, "architecture": source, "num_parameters": num_parameters(cfg),
        "devices": args.devices, "chip": args.chip, "hbm_bytes": int(hbm),
        "mesh": {a: int(mesh.shape[a]) for a in parallel.MESH_AXES},
        "rollout_mesh": {a: int(rmesh.shape[a]) for a in parallel.MESH_AXES},
        "shape": {"prompts": B, "group_size": G, "rows": B * G, "prompt_len": P, "response_len": R,
                  "micro_batches": K, "dtype": config.model.dtype, "param_dtype": config.model.param_dtype,
                  "remat": bool(config.model.remat), "remat_saves": config.model.remat_saves,
                  "remat_saves_layers": config.model.remat_saves_layers,
                  "attention_block": config.model.attention_block, "rows_per_shared_prompt": shared},
        "state_bytes_per_device": {**parts, "total": state_total},
    }
    phases: dict[str, dict] = {}
    samplers = {"rollout": training_sampler_shape(config)}
    if "eval" in args.phases:
        if config.eval.enabled:
            samplers["eval"] = eval_sampler_shape(config, parallel.batch_divisor(rmesh))
        else:
            say("  eval: skipped (eval.enabled is False)")
    dump_dir = getattr(args, "dump_dir", None)

    def measure(name, compile_fn, resident):
        """Compiles one program and records its figures (and its largest buffers with --explain)."""
        before = buffer_assignment_files(dump_dir)
        compiled, t_lower, t_compile, _ = compile_fn()
        fig = memory_figures(compiled)
        fig.update(lower_s=round(t_lower, 2), compile_s=round(t_compile, 2), resident_other_bytes=resident,
                   peak_bytes=fig["total_bytes"] + resident)
        if dump_dir:
            fig["largest_temp_buffers"] = largest_temp_buffers(buffer_assignment_files(dump_dir) - before,
                                                               args.explain)
        phases[name] = fig
        return fig

    for name, shape in samplers.items():
        if name not in args.phases:
            continue
        program = rollout_program(shape, cfg, abstract_ts, rmesh)
        described = describe(program[2], shape.prompts)
        say(f"  {name} sampler ({described}): {shape.prompts} prompts x "
            f"{shape.group_size} = {shape.prompts * shape.group_size} rows of {shape.max_new_tokens} tokens ...")
        # The rest of the train state (AdamW moments, controller, reference) stays on the device while
        # sampling; on a rollout mesh of its own the sampler's policy is a copy, so the state's own
        # parameters stay too.
        resident = state_total - (0 if rollout_devices else parts["params"])
        fig = measure(name, lambda: compile_rollout(shape, program), resident)
        fig["rows"] = shape.prompts * shape.group_size
        fig["sampler"] = described
    if "update" in args.phases:
        say("  update step (forward + backward + AdamW) ...")
        measure("update", lambda: compile_update(config, abstract_ts, mesh), 0)

    say("")
    say(f"  {'per device':<24}" + "".join(f"{name:>14}" for name in phases))
    rows = [("compile time", lambda f: f"{f['lower_s'] + f['compile_s']:.1f} s"),
            ("argument", lambda f: gib(f["argument_bytes"])), ("output", lambda f: gib(f["output_bytes"])),
            ("alias (donated)", lambda f: gib(f["alias_bytes"])), ("temp (CPU, lower bound)", lambda f: gib(f["temp_bytes"])),
            ("generated code", lambda f: gib(f["generated_code_bytes"])),
            ("resident train state", lambda f: gib(f["resident_other_bytes"])),
            ("peak estimate", lambda f: gib(f["peak_bytes"]))]
    for label, fmt in rows:
        say(f"  {label:<24}" + "".join(f"{fmt(f):>14}" for f in phases.values()))
    peak = max((f["peak_bytes"] for f in phases.values()), default=state_total)
    fits = peak <= hbm
    worst = max(phases, key=lambda k: phases[k]["peak_bytes"]) if phases else "state"
    say("")
    say("  peak estimate = argument + output - alias + temp + code (+ train state not passed to the sampler)")
    say(f"  note: {CPU_TEMP_NOTE}")
    tight = fits and peak > TIGHT_FRACTION * hbm
    verdict = "DOES NOT FIT" if not fits else "FITS, TIGHT" if tight else "FITS"
    say(f"  {verdict}: {worst} peaks at {gib(peak)} of {gib(hbm)} per {args.chip} device "
        f"({100 * peak / hbm:.0f}%)" + (f"; above {TIGHT_FRACTION:.0%} while temp is a lower bound: it may "
                                        f"not fit on the chip" if tight else ""))
    for name, fig in phases.items():
        if fig.get("largest_temp_buffers"):
            say(f"  largest temporary buffers of {name} (may share memory over time):")
            for v in fig["largest_temp_buffers"]:
                say(f"    {human(v['bytes']):>12}  {v['shape']}  ({v['name']})")
    report.update(phases=phases, peak_bytes_per_device=peak, peak_phase=worst, fits=fits, tight=tight,
                  utilisation=round(peak / hbm, 4), note=CPU_TEMP_NOTE)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: sets up N CPU devices, runs the dry run, prints the JSON report last."""
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="stare_dryrun_") as tmp:
        args.dump_dir = os.path.join(tmp, "xla") if args.explain > 0 else None
        force_cpu_devices(args.devices, args.dump_dir)  # before anything initialises JAX's backends
        try:
            report = run(args, overrides)
        except DryRunError as e:
            print(str(e), file=sys.stderr)
            return 2
    print(json.dumps(report, sort_keys=True), flush=True)
    return 3 if args.strict and not report["fits"] else 0


if __name__ == "__main__":
    sys.exit(main())
