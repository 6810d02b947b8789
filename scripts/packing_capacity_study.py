"""The packed update's capacity on the real-model workload's recorded batches, by packing multiple.

The update's per-token work runs on each device's buffer of `packed_capacity` entries: the fuller
device's kept tokens rounded up to a multiple M of `ppo.pack_tokens` (`stare_jax.models.packing`).
This script reads the real-model batches committed benchmark outputs record (the `response_lens`
of stare-jax's steps in `docs/bench/**/*.json`: 64 responses, 8 groups of 8, up to 256 tokens; or
the list `--save-batches` wrote, `--batches FILE`, so that later outputs do not move the figures),
deals whole groups to two devices three ways, and prints for each multiple the mean capacity a
device, the mean fill (tokens a device over capacity) and the capacities' spread (each a program
to compile):

    greedy   longest-first dealing alone (`balanced_group_order(..., swaps=False)`)
    swaps    the shipped `balanced_group_order` (greedy, then pairwise swaps)
    exact    the best split of the 8 groups into 4 + 4 (all 35 of them)

It also prints how far the fuller device sits above half the batch's tokens under each dealing.
No JAX computation runs; it takes seconds.

    python scripts/packing_capacity_study.py [--batches FILE | --save-batches FILE]
        [--multiples 1024 512 256] [--json]

The figures of docs/performance.md ("Even blocks, a finer packing multiple, and a disagreeing step
left undone") are `--batches docs/bench/epyc_zen4/packing_b2a26dc/recorded_batches.json`.
"""

from __future__ import annotations

import argparse
import ast
import glob
import itertools
import json
import os
import sys
from collections import Counter

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from stare_jax.models.packing import balanced_group_order, packed_capacity  # noqa: E402

GROUPS, GROUP_SIZE, SHARDS, R = 8, 8, 2, 256


def recorded_batches(root: str = os.path.join(ROOT, "docs", "bench")) -> list[tuple[int, ...]]:
    """The distinct 64-response length lists of stare-jax's real-model steps in committed outputs."""
    found = set()
    for path in glob.glob(os.path.join(root, "**", "*.json"), recursive=True):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        ours = data.get("participants", {}).get("stare-jax") if isinstance(data, dict) else None
        steps = ours.get("per_step") if isinstance(ours, dict) else None
        if isinstance(steps, str):  # older outputs stored the list as its repr
            try:
                steps = ast.literal_eval(steps)
            except (ValueError, SyntaxError):
                continue
        for step in steps or []:
            lens = step.get("response_lens") if isinstance(step, dict) else None
            if lens and len(lens) == GROUPS * GROUP_SIZE:
                found.add(tuple(int(x) for x in lens))
    return sorted(found)


def mask_of(lens) -> np.ndarray:
    """[64, 256] response mask of the lengths."""
    return (np.arange(R)[None, :] < np.asarray(lens)[:, None]).astype(np.float32)


def exact_order(lens) -> np.ndarray:
    """The split of the groups into two halves with the smallest fuller half."""
    tokens = np.asarray(lens).reshape(GROUPS, GROUP_SIZE).sum(1)
    best = min((c for c in itertools.combinations(range(GROUPS), GROUPS // 2) if 0 in c),
               key=lambda c: max(tokens[list(c)].sum(), tokens.sum() - tokens[list(c)].sum()))
    groups = np.array(list(best) + [g for g in range(GROUPS) if g not in best])
    return (groups[:, None] * GROUP_SIZE + np.arange(GROUP_SIZE)[None, :]).reshape(-1)


def study(batches, multiples) -> dict:
    """Per dealing and multiple: mean capacity, mean fill, capacity spread; per dealing: the fuller
    device's excess over half the batch (mean, max)."""
    dealings = {"greedy": lambda lens: balanced_group_order(mask_of(lens), GROUP_SIZE, SHARDS, swaps=False),
                "swaps": lambda lens: balanced_group_order(mask_of(lens), GROUP_SIZE, SHARDS),
                "exact": exact_order}
    out: dict = {"batches": len(batches), "dealings": {}}
    for name, order_of in dealings.items():
        caps = {m: [] for m in multiples}
        fills = {m: [] for m in multiples}
        excess = []
        for lens in batches:
            mask = mask_of(lens)[order_of(lens)]
            total = mask.sum()
            excess.append(float(mask.reshape(SHARDS, -1).sum(1).max() - total / SHARDS))
            for m in multiples:
                cap = packed_capacity(mask, shards=SHARDS, multiple=m)
                caps[m].append(cap)
                fills[m].append(total / SHARDS / cap)
        out["dealings"][name] = {
            "excess_over_half_mean": round(float(np.mean(excess)), 1), "excess_over_half_max": max(excess),
            **{f"M{m}": {"mean_capacity": round(float(np.mean(caps[m])), 1), "mean_fill": round(float(np.mean(fills[m])), 3),
                         "capacities": dict(sorted(Counter(caps[m]).items()))} for m in multiples}}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--multiples", type=int, nargs="+", default=[1024, 512, 256])
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--batches", default="", help="read the batches' length lists from this JSON file")
    ap.add_argument("--save-batches", default="", help="write the scanned batches' length lists to this JSON file")
    args = ap.parse_args()
    if args.batches:
        try:
            with open(args.batches) as f:
                batches = [tuple(b) for b in json.load(f)]
        except (OSError, ValueError) as e:
            print(f"packing_capacity_study: --batches {args.batches}: {e}", file=sys.stderr)
            sys.exit(2)
    else:
        batches = recorded_batches()
    if not batches:
        sys.exit("packing_capacity_study: no recorded real-model batches under docs/bench")
    if args.save_batches:
        with open(args.save_batches, "w") as f:
            json.dump([list(b) for b in batches], f)
    result = study(batches, args.multiples)
    if args.json:
        print(json.dumps(result, default=int))
        return
    print(f"{result['batches']} recorded batches of 64 responses (8 groups of 8) over 2 devices")
    for name, d in result["dealings"].items():
        print(f"{name:>6}: fuller device above half the batch by {d['excess_over_half_mean']} tokens on average "
              f"(at most {d['excess_over_half_max']:.0f})")
        for m in args.multiples:
            r = d[f"M{m}"]
            spread = ", ".join(f"{c} x{n}" for c, n in r["capacities"].items())
            print(f"        M {m:>5}: capacity {r['mean_capacity']:.0f} a device on average, fill {r['mean_fill']:.3f}; "
                  f"capacities {spread}")


if __name__ == "__main__":
    main()
