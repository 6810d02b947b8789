"""Measures what the base SmolLM2-135M-Instruct can do on arithmetic word problems of each difficulty.

For each (difficulty level, instruction, temperature) it samples n responses to `--problems`
held-out problems through the system's own pipeline (chat template, jitted sampler, the
final-answer verifier) and prints avg@n, pass@n, the share of responses that end within the token
budget, and one sample response. This is how the task format and difficulty of
configs/smollm2_math.py were chosen (docs/real_model.md).

    python scripts/calibrate_arith.py --workdir runs/calibrate [--problems 32 --n 8 --max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LEVELS = {
    "bare-1op": dict(min_ops=1, max_ops=1, word_frac=0.0),
    "word-1op": dict(min_ops=1, max_ops=1, word_frac=1.0),
    "word-1op+dist": dict(min_ops=1, max_ops=1, word_frac=1.0, distractors=1),
    "word-2op": dict(min_ops=2, max_ops=2, word_frac=1.0),
    "word-1-2op": dict(min_ops=1, max_ops=2, word_frac=1.0),
    "mix-1-2op": dict(min_ops=1, max_ops=2, word_frac=0.5),
}
INSTRUCTIONS = {
    "just-number": "Answer with just the number.",
    "final-line": "Give the final answer as a number on the last line.",
    "none": "",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="runs/calibrate")
    p.add_argument("--levels", default=",".join(LEVELS))
    p.add_argument("--instructions", default="just-number")
    p.add_argument("--temperatures", default="1.0")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--problems", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-number", type=int, default=9)
    p.add_argument("--ops", default="+-")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="append one JSON line per measurement to this file")
    args = p.parse_args()
    if args.out:
        from stare_jax.workdir import unwritable_file_reason

        reason = unwritable_file_reason(args.out)
        if reason:
            p.error(f"--out: {args.out}: cannot be written ({reason})")

    import jax
    import numpy as np

    from stare_jax.data.pipeline import PromptEncoder
    from stare_jax.eval_metrics import summarize
    from stare_jax.models import from_pretrained
    from stare_jax.models.gguf import ensure_converted, smollm2_gguf_path
    from stare_jax.rewards.functions import final_answer_reward
    from stare_jax.rollout import generate
    from stare_jax.tasks.arithmetic import ArithConfig, generate_problem
    from stare_jax.trainer import decode_responses

    model_dir = ensure_converted(smollm2_gguf_path(), os.path.join(args.workdir, "model"))
    policy = from_pretrained(model_dir)
    tok = policy.tokenizer
    eos = tuple(policy.config.eos_token_ids)
    for level in args.levels.split(","):
        cfg = ArithConfig(max_number=args.max_number, ops=args.ops, **LEVELS[level]).validate()
        problems = [generate_problem(args.seed, i, config=cfg, split="test") for i in range(args.problems)]
        for inst_name in args.instructions.split(","):
            enc = PromptEncoder(tok, 96, style="math", instruction=INSTRUCTIONS[inst_name])
            rows = [enc.encode(i, {"question": pr.question, "ground_truth": pr.ground_truth})
                    for i, pr in enumerate(problems)]
            ids = np.stack([r["prompt_ids"] for r in rows])
            mask = np.stack([r["prompt_mask"] for r in rows])
            keep = mask.sum(0) > 0
            ids, mask = ids[:, keep], mask[:, keep]
            for temp in (float(t) for t in args.temperatures.split(",")):
                t0 = time.perf_counter()
                res = generate(policy, ids, mask, rng=jax.random.key(args.seed), group_size=args.n,
                               max_new_tokens=args.max_new_tokens, eos_ids=eos, temperature=temp, top_p=args.top_p)
                texts = decode_responses(tok, np.asarray(res.response_ids), np.asarray(res.response_mask), eos)
                truths = np.repeat([pr.ground_truth for pr in problems], args.n)
                scores = np.array([final_answer_reward(t, g) for t, g in zip(texts, truths)]).reshape(-1, args.n)
                summary = summarize((scores >= 0.5).astype(np.float32))
                row = {"level": level, "instruction": inst_name, "temperature": temp, "top_p": args.top_p,
                       f"avg@{args.n}": round(summary[f"avg@{args.n}"], 4),
                       f"pass@{args.n}": round(summary[f"pass@{args.n}"], 4),
                       "ended_frac": round(1 - float(np.asarray(res.truncated).mean()), 3),
                       "mean_len": round(float(np.asarray(res.response_mask).sum(1).mean()), 1),
                       "seconds": round(time.perf_counter() - t0, 1),
                       "example": {"question": problems[0].question, "answer": problems[0].ground_truth,
                                   "response": texts[0]}}
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
