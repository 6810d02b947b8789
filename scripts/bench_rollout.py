"""Rollout throughput: `stare_jax.rollout.generate` vs `transformers` `generate` on PyTorch CPU.

Builds a random Qwen2-style model (hidden 256, 4 layers, 4 heads / 2 KV heads, vocab 1024,
tied embeddings) with transformers, saves it, loads it with `stare_jax.models.from_pretrained`
and samples `--batch` sequences (`--batch / --group-size` prompts, `--group-size` responses
each) of exactly `--new-tokens` tokens (no EOS) with both, after one warm-up call each,
alternating the two for `--repeats` timed rounds. Prints one JSON line last:
{"jax_tokens_per_s", "torch_tokens_per_s", "speedup", ...} from the median times, with the
1-minute load average before and after (PyTorch's thread pool slows down sharply when other
processes compete for the cores, so compare figures taken on an idle machine).

    python scripts/bench_rollout.py [--repeats 5] [--batch 64] [--new-tokens 64] [--cpu-devices N]

`--cpu-devices` splits the CPU into that many JAX devices (`mesh.cpu_devices`) and the rows over
them (mesh data axis); the default is one per core, at most the prompt count and dividing it.
`--cpu-devices 1` measures the single-device sampler.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB = 1024


def build_checkpoint(path: str, seed: int = 0) -> None:
    """Saves a random Qwen2-style checkpoint with no EOS token (so generation never stops early)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                   max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=0)
    transformers.Qwen2ForCausalLM(cfg).eval().save_pretrained(path)


def make_prompts(num_prompts: int, prompt_len: int, seed: int = 0):
    """Left-padded random prompts [num_prompts, prompt_len] with lengths between prompt_len/2 and prompt_len."""
    rs = np.random.RandomState(seed)
    lengths = rs.randint(prompt_len // 2, prompt_len + 1, num_prompts)
    mask = (np.arange(prompt_len)[None, :] >= prompt_len - lengths[:, None]).astype(np.int32)
    ids = np.where(mask > 0, rs.randint(1, VOCAB, (num_prompts, prompt_len)), 0).astype(np.int32)
    return ids, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (each runs both samplers)")
    ap.add_argument("--batch", type=int, default=64, help="sequences per call (prompts x group size)")
    ap.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence")
    ap.add_argument("--prompt-len", type=int, default=32, help="padded prompt length")
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="JAX CPU devices to split the rows over (0: one per core, dividing the prompt count)")
    args = ap.parse_args()
    if min(args.repeats, args.batch, args.group_size, args.new_tokens, args.prompt_len) < 1 or args.cpu_devices < 0:
        ap.error("--repeats, --batch, --group-size, --new-tokens and --prompt-len must be >= 1, --cpu-devices >= 0")
    if args.batch % args.group_size:
        ap.error(f"--batch {args.batch} must be a multiple of --group-size {args.group_size}")
    num_prompts = args.batch // args.group_size
    from stare_jax import distributed, parallel

    devices = args.cpu_devices or distributed.cpu_devices_per_core(num_prompts)
    if devices < 1 or num_prompts % devices:
        ap.error(f"--cpu-devices {devices} must be >= 1 and divide the {num_prompts} prompts")

    import jax

    distributed.use_cpu_devices(devices)
    import torch
    import transformers

    from stare_jax.models import from_pretrained
    from stare_jax.rollout import generate

    ids, mask = make_prompts(args.batch // args.group_size, args.prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(tmp)
        mesh = parallel.make_mesh(data=devices) if devices > 1 else None
        policy = from_pretrained(tmp, load_tokenizer=False, mesh=mesh)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()

    def run_jax(seed: int) -> np.ndarray:
        out = generate(policy, ids, mask, rng=jax.random.key(seed), group_size=args.group_size,
                       max_new_tokens=args.new_tokens, eos_ids=())
        return np.asarray(jax.block_until_ready(out.response_ids))

    def run_torch(seed: int) -> np.ndarray:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = hf.generate(input_ids=torch.tensor(ids, dtype=torch.long),
                              attention_mask=torch.tensor(mask, dtype=torch.long), do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
                              num_return_sequences=args.group_size,
                              pad_token_id=0, eos_token_id=None)
        return out[:, ids.shape[1]:].numpy()

    load_before = os.getloadavg()[0]
    for run in (run_jax, run_torch):  # warm-up (compilation, allocator)
        got = run(0)
        assert got.shape == (args.batch, args.new_tokens), got.shape
    times = {"jax": [], "torch": []}
    for r in range(args.repeats):
        for name, run in (("jax", run_jax), ("torch", run_torch)) if r % 2 == 0 else (("torch", run_torch),
                                                                                      ("jax", run_jax)):
            time.sleep(0.5)  # lets the other library's idle worker threads stop spinning first
            t0 = time.perf_counter()
            run(r + 1)
            times[name].append(time.perf_counter() - t0)
    load_after = os.getloadavg()[0]
    tokens = args.batch * args.new_tokens
    jax_tps = tokens / statistics.median(times["jax"])
    torch_tps = tokens / statistics.median(times["torch"])
    print(json.dumps({
        "jax_tokens_per_s": round(jax_tps, 1), "torch_tokens_per_s": round(torch_tps, 1),
        "speedup": round(jax_tps / torch_tps, 2), "batch": args.batch, "group_size": args.group_size,
        "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "repeats": args.repeats,
        "median_jax_s": round(statistics.median(times["jax"]), 4),
        "median_torch_s": round(statistics.median(times["torch"]), 4),
        "torch_threads": torch.get_num_threads(), "devices": jax.device_count(), "cpu_count": os.cpu_count(),
        "load_avg_before": round(load_before, 2), "load_avg_after": round(load_after, 2),
        "transformers": transformers.__version__, "jax": jax.__version__}))


if __name__ == "__main__":
    main()
