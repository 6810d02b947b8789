"""What every participant of `scripts/bench_step.py` shares: the workload, its data and reward, and the
worker protocol. Imports only numpy and the standard library at module level, because the peers run
in their own virtual environment (requirements-bench.txt) without stare_jax installed.

Protocol. The driver starts each participant as a subprocess:

    python scripts/bench_peers/<name>_peer.py '<workload json>'

The worker builds its trainer from the Hugging Face checkpoint in `workload["checkpoint"]`
(random Qwen2 weights written by the driver), runs nothing timed, then prints
`@@BENCH {"ready": true, ...}`. For each line `{"cmd": "step"}` it reads on stdin it runs
exactly one full GRPO step (rollout of prompts x group responses, reward, one optimizer update)
and prints `@@BENCH {"rollout_s", "reward_s", "update_s", "step_s", "tokens", "peak_rss_mb"}`
where `rollout_s` includes the reward (`reward_s` is its part, when the trainer tells it apart),
`update_s` is the rest of the step and `tokens` counts the generated tokens. `{"cmd": "exit"}`
ends it. Lines without the `@@BENCH ` prefix are ignored (libraries print what they like).
"""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np

PREFIX = "@@BENCH "

# Token ids of the bench tokenizer: four specials, then the words w4 .. w{vocab-1}.
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")

VOCAB_SIZE = 1024
DEFAULT = dict(vocab_size=VOCAB_SIZE, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
               intermediate_size=688, tie_word_embeddings=True, num_prompts=8, group_size=8, prompt_len=32,
               new_tokens=64, learning_rate=1e-6, temperature=1.0, seed=0, loss="stare")
LARGE = dict(DEFAULT, hidden_size=512, num_layers=8, new_tokens=128)
# A smoke run: the same protocol on a model and batch small enough that a run takes seconds of work,
# to check a setup (the peers' environment, a new host) before an hour of benchmarking. Its times
# measure start-up and compilation more than steps: report only DEFAULT and LARGE.
SMOKE = dict(DEFAULT, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=176,
             num_prompts=4, group_size=4, new_tokens=16)
SYNTHETIC = {"default": DEFAULT, "large": LARGE, "smoke": SMOKE}


def add_synthetic_workload_flags(ap) -> None:
    """Adds the synthetic workload's flags to an argparse parser: `--large` or `--smoke` (else DEFAULT)."""
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--large", action="store_true", help="hidden 512, 8 layers, 128 new tokens")
    group.add_argument("--smoke", action="store_true",
                       help="hidden 64, 2 layers, 4 x 4 responses of 16 tokens: checks a setup in seconds of work; "
                            "its times mean little")


def synthetic_workload_name(args) -> str:
    """The synthetic workload the flags of `add_synthetic_workload_flags` chose: a key of SYNTHETIC."""
    return "large" if args.large else "smoke" if args.smoke else "default"

# The real-model workload (`bench_step.py --model smollm2|PATH`): a pretrained model's Hugging Face
# directory (`checkpoint`), its own tokenizer, EOS enabled, temperature 1, up to `new_tokens` new
# tokens, so response lengths vary as they do in real RLVR. The driver adds the model's shape,
# `prompt_texts` (the chat-templated prompts, tokenized without adding special tokens), their
# `ground_truths` and the model's `eos_token_ids`; every participant tokenizes the same texts with
# the directory's tokenizer, left-padded to the longest, and scores with `real_reward`.
REAL = dict(num_prompts=8, group_size=8, new_tokens=256, learning_rate=1e-6, temperature=1.0, seed=0,
            loss="stare")
REAL_INSTRUCTION = "Think step by step, then give the final answer as a number on the last line."


def is_real(workload: dict) -> bool:
    """True for the real-model workload (prompts given as text, EOS enabled, lengths vary)."""
    return "prompt_texts" in workload


def word(i: int) -> str:
    """The text of token id `i` (ids >= 4)."""
    return f"w{i}"


def build_tokenizer():
    """A word-level `transformers.PreTrainedTokenizerFast` over the workload's 1024 ids: text 'w5 w17'
    is ids [5, 17]; decoding joins words with spaces. Like Qwen2's, it has no BOS token (so no
    trainer prepends one); padding is on the left."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab_size = VOCAB_SIZE
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({word(i): i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left", model_max_length=4096)


def prompts(workload: dict) -> tuple[np.ndarray, list[str], list[str]]:
    """The fixed prompt batch: token ids int32 [num_prompts, prompt_len] (no padding: every prompt has
    exactly prompt_len tokens), their texts, and each prompt's ground truth (a digit 0-3)."""
    rs = np.random.RandomState(workload["seed"])
    ids = rs.randint(len(SPECIALS), workload["vocab_size"], (workload["num_prompts"], workload["prompt_len"]))
    texts = [" ".join(word(int(i)) for i in row) for row in ids]
    truths = [str(int(t)) for t in rs.randint(0, 4, workload["num_prompts"])]
    return ids.astype(np.int32), texts, truths


def reward(response: str, ground_truth: str) -> float:
    """Fraction of the response's words w<k> with k % 4 == ground_truth: cheap, deterministic, and
    varied across a group, so advantages are non-zero."""
    words = response.split()
    if not words:
        return 0.0
    target = int(ground_truth)
    hits = sum(1 for w in words if w.startswith("w") and w[1:].isdigit() and int(w[1:]) % 4 == target)
    return hits / len(words)


def final_number(text: str) -> str | None:
    """The last number in `text` (commas between digits dropped), or None."""
    import re

    found = re.findall(r"-?\d+(?:\.\d+)?", re.sub(r"(?<=\d),(?=\d{3})", "", text))
    return found[-1] if found else None


def real_reward(response: str, ground_truth: str) -> float:
    """The real-model workload's reward: 1.0 when the response's last number equals the ground
    truth, else 0.0 (a cheap stand-in for the math verifier that every peer can import)."""
    got = final_number(response)
    try:
        return float(got is not None and float(got) == float(ground_truth))
    except ValueError:
        return 0.0


def real_prompt_ids(workload: dict, tokenizer, pad_id: int):
    """The real-model workload's prompt texts as ids (no special tokens added), left-padded with
    `pad_id` to prompt_len: (ids, mask), int32 [num_prompts, prompt_len] each. Raises when the longest
    prompt is not prompt_len tokens (the participants must see the driver's prompts)."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in workload["prompt_texts"]]
    width = workload["prompt_len"]
    if max(len(r) for r in rows) != width:
        raise RuntimeError(f"the longest prompt has {max(len(r) for r in rows)} tokens, the workload's prompt_len "
                           f"is {width}")
    ids = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


class StepClock:
    """Timings of the step in progress, for the peers whose trainers run the step themselves:
    `begin()` when the step starts, `rollout_s` / `tokens` added by the rollout hook, `score`
    for the reward, `report()` when the optimizer step has finished."""

    def __init__(self, reward_fn=None):
        self.reward_fn = reward_fn or reward  # `real_reward` on the real-model workload
        self.begin()

    def begin(self) -> None:
        """Starts timing a new step."""
        self.start = time.perf_counter()
        self.rollout_s = self.reward_s = 0.0
        self.tokens = 0

    def score(self, completions, ground_truths) -> list[float]:
        """`reward` of each completion against its ground truth, timed into `reward_s`."""
        t0 = time.perf_counter()
        rewards = [self.reward_fn(c, str(g)) for c, g in zip(completions, ground_truths, strict=True)]
        self.reward_s += time.perf_counter() - t0
        return rewards

    def report(self) -> dict:
        """The protocol's step report; update_s is the step's time outside the rollout phase."""
        step_s = time.perf_counter() - self.start
        return {"rollout_s": self.rollout_s, "reward_s": self.reward_s, "update_s": step_s - self.rollout_s,
                "step_s": step_s, "tokens": self.tokens, "peak_rss_mb": peak_rss_mb()}


def matmul_peak_gflops(make_product, sizes=(512, 1024, 2048), repeats: int = 5) -> float:
    """A framework's measured matmul peak on this host: the best GFLOP/s (2 n^3 / time) of an
    n x n @ n x n product over `sizes`, best of `repeats` each. `make_product(n)` returns a function
    that computes one such product and returns when it is done (its first call, untimed, may compile)."""
    best = 0.0
    for n in sizes:
        product = make_product(n)
        product()
        for _ in range(repeats):
            t0 = time.perf_counter()
            product()
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0) / 1e9)
    return round(best, 1)


def accelerator_sizes() -> tuple[int, ...]:
    """Matmul sizes for `matmul_peak_gflops`: up to 8192 on a GPU or TPU (smaller products leave a
    large chip idle), up to 2048 on a CPU."""
    import jax

    return (2048, 4096, 8192) if jax.default_backend() in ("gpu", "tpu") else (512, 1024, 2048)


def jax_matmul(n: int, dtype: str = "float32"):
    """`matmul_peak_gflops`'s product for JAX: a jitted n x n matmul of random `dtype` operands on the
    default device, with XLA's default precision for that dtype (on a GPU float32 may use TF32),
    accumulated and returned in float32 as stare-jax's products are (for bfloat16 operands on a CPU
    that is what reaches YNNPACK's bf16 kernels: `stare_jax.models.products.product_dtype`)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    return lambda: f(a, a).block_until_ready()


def jax_copy_bandwidth_gbs(n_bytes: int | None = None, repeats: int = 5) -> float:
    """Memory bandwidth of JAX's default device in GB/s: the best rate of a jitted in-place `a + 1`
    over an array of `n_bytes` (1 GiB on an accelerator, 256 MiB on a CPU), counting the bytes read
    and written (2 x n_bytes). The bandwidth of the decode roofline.

    The input is donated, so the result reuses its buffer: without donation every call wrote a
    fresh output, and on a CPU host with glibc's malloc that is fresh pages, whose first-touch
    faults the timing included (8.2-9.6 GB/s read on the 2-core Xeon VMs, 22.8 GB/s once oneTBB's
    malloc reused the buffer: docs/performance.md)."""
    import jax
    import jax.numpy as jnp

    if n_bytes is None:
        n_bytes = (1 << 30) if jax.default_backend() in ("gpu", "tpu") else (1 << 28)
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return round(2 * n_bytes / best / 1e9, 1)


#: the instruction-set flags that decide which matmul kernels a CPU runs (named in `host_cpu`)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def host_cpu(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The host CPU named well enough to tell hosts apart: its model name, family and model
    numbers, and which of `ISA_FLAGS` it exposes, e.g. "AMD EPYC (family 25 model 17; avx2
    avx512f avx512_bf16)". A cloud VM's model name alone ("AMD EPYC", "Intel(R) Xeon(R)
    Processor") covers CPUs of several generations. "unknown" where unreadable."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block names the CPU
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return "unknown"
    name = fields.get("model name")
    if not name:
        return "unknown"
    flags = set(fields.get("flags", "").split())
    detail = []
    if "cpu family" in fields and "model" in fields:
        detail.append(f"family {fields['cpu family']} model {fields['model']}")
    detail.append(" ".join(f for f in ISA_FLAGS if f in flags) or "none of " + "/".join(ISA_FLAGS))
    return f"{name} ({'; '.join(detail)})"


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_rss() -> None:
    """Restarts the kernel's resident high-water mark (VmHWM) from the current resident set
    (`echo 5 > /proc/self/clear_refs`), so `window_peak_rss_mb` reads the peak of what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def window_peak_rss_mb() -> float | None:
    """VmHWM of /proc/self/status in MiB: the peak resident set since the last `reset_peak_rss`
    (None where unreadable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


def rusage():
    """This process's resource usage so far (`getrusage`), the start mark of `usage_since`."""
    return resource.getrusage(resource.RUSAGE_SELF)


def usage_since(before) -> dict:
    """What this process used since `before` (a `rusage()`): kernel CPU seconds (`sys_s`: page
    faults are handled there), minor page faults and voluntary / involuntary context switches."""
    now = rusage()
    return {"sys_s": now.ru_stime - before.ru_stime, "minor_faults": now.ru_minflt - before.ru_minflt,
            "voluntary_switches": now.ru_nvcsw - before.ru_nvcsw,
            "involuntary_switches": now.ru_nivcsw - before.ru_nivcsw}


def send(obj: dict) -> None:
    """Writes one protocol line to the real stdout."""
    sys.__stdout__.write(PREFIX + json.dumps(obj) + "\n")
    sys.__stdout__.flush()


def commands():
    """Yields the commands the driver sends on stdin until 'exit' or end of input."""
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "exit":
            return
        yield cmd


def workload_from_argv() -> dict:
    """The workload dict passed as the worker's only argument."""
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} '<workload json>'")
    return json.loads(sys.argv[1])
