"""The main job: one train loop over rollout -> rewards -> dynamic sampling -> update -> log -> save.

Everything heavy is jitted elsewhere (the sampler in `rollout`, the update step in `rl.update`);
this module orchestrates it and owns the side effects: files, checkpoints, the verifier pool.

Determinism: all randomness of step s comes from `fold_in(key(seed), s)`, and the data position
is checkpointed, so a run resumed from step s produces exactly the metrics of an uninterrupted run.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings

import jax
import numpy as np

from stare_jax import checkpoint as ckpt_lib
from stare_jax import config as config_lib
from stare_jax import allocator, compilation, cpu_gemm, distributed, parallel
from stare_jax.compilation import CompilationCounter
from stare_jax import precision, preemption
from stare_jax import workdir as workdir_lib
from stare_jax.dynamic_sampling import DynamicSamplingError, GroupBuffer, groups_to_generate, groups_with_spread
from stare_jax.models import Policy, from_pretrained
from stare_jax.models.hf import abstract_model, load_config, load_tokenizer_dir
from stare_jax.rl.policy_agreement import disagreement_bound, disagreement_line
from stare_jax.rl.settings import RLSettings
from stare_jax.writers import MetricsWriter, Progress, truncate_jsonl

log = logging.getLogger(__name__)
FAULT_KILL_BEFORE_FINAL_EVAL = "STARE_FAULT_KILL_BEFORE_FINAL_EVAL"  # test hook: SIGKILL after the last commit
FAULT_RAISE_AT_STEP = "STARE_FAULT_RAISE_AT_STEP"  # test hook "STEP:PROCESS": that process raises in that step


# ----------------------------------------------------------------------------- set-up

def prepare_policy(config, workdir: str, mesh) -> Policy:
    """Loads the policy to train: `model.path`, or the embedded tiny model, created (and warm-started
    by `warmstart.steps` of supervised training on reference answers) in `WORKDIR/model` on first
    use and reused afterwards."""
    return from_pretrained(model_directory(config, workdir), mesh=mesh, **policy_options(config))


def policy_options(config) -> dict:
    """The `from_pretrained` keywords a run's `model.*` config asks for: compute and parameter
    dtypes, rematerialisation and what it keeps, scanned or unrolled layers. Every place that
    builds the policy of a config (the trainer, the benchmarks' workers) takes them from here."""
    m = config.model
    return dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, remat_saves=m.remat_saves,
                remat_saves_layers=m.remat_saves_layers, attention_block=m.attention_block,
                scan_layers=m.scan_layers)


def model_directory(config, workdir: str, *, create: bool = True) -> str:
    """The Hugging Face directory of the run's base model: `model.path` itself, or WORKDIR/model for
    the embedded model and for a GGUF source (converted there once, then reused). With `create=False`
    (evaluate, export) nothing is built: the directory the training run made is returned."""
    from stare_jax.models.gguf import is_gguf_source

    path = config.model.path
    if path and not is_gguf_source(path):
        return path
    out = os.path.join(os.path.abspath(workdir), "model")
    if not create:
        return out
    if not path:
        return embedded_model_dir(config, workdir)
    from stare_jax.models.gguf import ensure_converted, smollm2_gguf_path

    src = smollm2_gguf_path() if path == "smollm2" else path
    if jax.process_index() == 0:
        ensure_converted(src, out)
    _barrier("gguf")
    return out


def embedded_model_dir(config, workdir: str) -> str:
    """Creates (once) the embedded model of `config` under the workdir and returns its directory."""
    from stare_jax.tasks import embedded

    e, w = config.model.embedded, config.warmstart
    path = os.path.join(workdir, "model")
    kwargs = dict(hidden_size=e.hidden_size, num_layers=e.num_layers, num_heads=e.num_heads,
                  num_kv_heads=e.num_kv_heads, intermediate_size=e.intermediate_size, seed=config.seed,
                  warmup_steps=w.steps, warmup_batch_size=w.batch_size, warmup_lr=w.lr)
    task = countdown_config(config)
    if jax.process_index() == 0:
        workdir_lib.remove_stale_tmp_dirs(path)  # a kill during an earlier warm start
        if not embedded.is_complete(path):
            _create_embedded_model_pinned(path, kwargs, task)
    embedded.create_embedded_model(path, task_config=task, **kwargs)  # checks the spec; other hosts wait for it
    return path


def _die_with_parent() -> None:
    """In a child before exec: ask Linux to SIGKILL it when the parent dies (no orphaned warm start)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _create_embedded_model_pinned(path: str, kwargs: dict, task) -> None:
    """Runs `create_embedded_model` (its warm start is ~400 jitted SFT steps) in a child process on
    one CPU device. XLA:CPU gives the same single-device program slightly different results in a
    process with 4 CPU devices than with 1 or 2 (identical HLO and machine code; the runtime
    differs), so warm-starting in the trainer's own process made the initial policy, and every
    metric after it, depend on the topology (1 process x 4 devices vs 2 x 2: grad_norm 4e-4 apart
    at step 0). The child's configuration is fixed, so the model is the same for any topology.

    The child uses the run's persistent compilation cache (`compilation_cache_dir`), if any: a
    later warm start with the same model shape and settings (in another workdir) loads its programs."""
    import dataclasses
    import json
    import subprocess
    import sys

    from stare_jax.config import COMPILATION_CACHE_ENV

    spec = json.dumps({"path": path, "kwargs": kwargs, "task": dataclasses.asdict(task)})
    code = ("import json, sys; from stare_jax import compilation; from stare_jax.tasks import countdown, embedded; "
            "compilation.use_persistent_cache(''); a = json.loads(sys.argv[1]); "
            "embedded.create_embedded_model(a['path'], task_config=countdown.CountdownConfig(**a['task']), "
            "**a['kwargs'])")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      os.environ.get("PYTHONPATH", "")] if p))
    if compilation.cache_dir():  # the parent's cache; else the child reads $STARE_COMPILATION_CACHE_DIR as it would
        env[COMPILATION_CACHE_ENV] = compilation.cache_dir()
    for key in ("JAX_NUM_CPU_DEVICES", "JAX_COORDINATOR_ADDRESS", "STARE_COORDINATOR", "STARE_NUM_PROCESSES",
                "STARE_PROCESS_ID"):
        env.pop(key, None)
    with warnings.catch_warnings():
        # JAX warns at every fork of its multithreaded process; this child only sets its death signal
        # (_die_with_parent, one prctl call) and then execs a new interpreter: no JAX code runs forked.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        r = subprocess.run([sys.executable, "-c", code, spec], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, preexec_fn=_die_with_parent)
    if r.returncode != 0:
        lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
        raise RuntimeError(f"creating the embedded model in {path} failed (exit {r.returncode}): "
                           f"{lines[-1] if lines else 'no message'}")


def countdown_config(config):
    """The task generator's difficulty knobs from the config's data section."""
    from stare_jax.tasks import countdown

    d = config.data
    return countdown.CountdownConfig(min_numbers=d.countdown_min_numbers, max_numbers=d.countdown_max_numbers,
                                     max_number=d.countdown_max_number, max_target=d.countdown_max_target)


def data_sources(config, workdir: str):
    """(train source, {eval name: eval source}) for the configured dataset."""
    from stare_jax import data

    data_dir = config.data.data_dir or os.path.join(workdir, "tfds")
    if config.data.name == "arith":
        d = config.data
        kw = dict(seed=config.seed, train_size=d.num_train, test_size=d.num_eval, task=arith_config(config))
        return data.arith_source(data_dir, "train", **kw), {"arith": data.arith_source(data_dir, "test", **kw)}
    if config.data.name == "countdown":
        kw = dict(seed=config.seed, train_size=config.data.num_train, test_size=config.data.num_eval,
                  task=countdown_config(config))
        return data.countdown_source(data_dir, "train", **kw), {"countdown": data.countdown_source(data_dir, "test", **kw)}
    train_files = [f for f in config.data.train_files.split(",") if f]
    splits = {"train": train_files}
    evals = {}
    for f in (f for f in config.data.eval_files.split(",") if f):
        name = os.path.splitext(os.path.basename(f))[0]
        evals[name] = data.math_source(data_dir, "test", splits={"test": [f]}, name=f"eval_{name}")
    return data.math_source(data_dir, "train", splits=splits), evals


def arith_config(config):
    """The arithmetic generator's difficulty knobs from the config's data section."""
    from stare_jax.tasks.arithmetic import ArithConfig

    d = config.data
    return ArithConfig(min_ops=d.arith_min_ops, max_ops=d.arith_max_ops, max_number=d.arith_max_number,
                       ops=d.arith_ops, word_frac=d.arith_word_frac, distractors=d.arith_distractors).validate()


def prompt_style(config) -> str:
    """"plain" (countdown: the question as is) or "math" (chat template + instruction)."""
    return "plain" if config.data.name == "countdown" else "math"


def prompt_instruction(config) -> str:
    """The instruction appended to each question: `data.instruction`, else the task's own."""
    from stare_jax.data.pipeline import MATH_INSTRUCTION
    from stare_jax.tasks.arithmetic import INSTRUCTION

    if config.data.instruction:
        return config.data.instruction
    return INSTRUCTION if config.data.name == "arith" else MATH_INSTRUCTION


# ----------------------------------------------------------------------------- rollouts

def global_prompts(config, prompts: dict) -> tuple[np.ndarray, np.ndarray]:
    """The global prompt batch (every host's rows, in order) as host arrays [B, P'], cut to its
    length bucket (`data.prompt_bucket_multiple`; P' = max_prompt_len without buckets)."""
    from stare_jax.data.buckets import trim_to_bucket

    return trim_to_bucket(parallel.gather_hosts(prompts["prompt_ids"]), parallel.gather_hosts(prompts["prompt_mask"]),
                          config.data.prompt_bucket_multiple)


def collect_batch(config, model, tokenizer, data_iter, pool, key, *, eos_ids, pad_id, mesh,
                  token_stats: bool | None = None):
    """Generates groups until `data.prompt_batch_size` groups with reward spread are kept (DAPO), or
    takes the first generation batch when dynamic sampling is off.

    Multi-host: each process loads its slice of the global prompt batch; the rollout runs on the
    global mesh; every process receives all responses, scores the rows of its own prompts (its
    ground truths), and the rewards are gathered, so every process takes the same keep decisions
    and holds the same global batch. Returns (the global batch as host arrays, rollout metrics).
    Raises DynamicSamplingError after `dynamic_sampling.max_num_gen_batches` generation batches.

    With the slot sampler (`rollout.slots`) a generation batch after the first generates only the
    groups it expects to need (`groups_to_generate`: the missing groups over the keep rate seen so
    far in this step), not a whole batch; the sampler's loop ends when those are complete. Which
    groups of the batch those are is the sampler's choice (`generated_groups`: the first ones, or
    each device's first ones where every device runs its own slot loop); the buffer takes them in
    batch order.

    With `mesh.rollout_devices` the sampler decodes on `parallel.rollout_mesh` (a copy of the
    model's weights placed there once per call); the batch comes back as host arrays either way.

    The batch holds the sampler's entropy and Q (`old_entropy`, `old_pi2_dev`) when `token_stats`
    is True, or when it is None (the default) and the update reads them
    (`RLSettings.takes_sampler_stats`).
    """
    from stare_jax.rollout import generate
    from stare_jax.rollout.sampler import generated_groups

    G = config.rollout.group_size
    ds = config.dynamic_sampling
    if token_stats is None:  # the update's pre-update statistics
        token_stats = RLSettings.from_config(config).takes_sampler_stats
    buffer = GroupBuffer(config.data.prompt_batch_size, G, left_padded=("input_ids", "attention_mask"))
    all_rewards, lengths, truncated, prompt_lens, longest = [], [], [], [], []
    reward_stats: dict[str, float] = {}
    gen_batches = 0
    t_generate = t_reward = 0.0
    model, mesh = parallel.rollout_placement(model, mesh, config.mesh.rollout_devices)
    replicated = parallel.replicated(mesh)
    for gen in range(ds.max_num_gen_batches if ds.enabled else 1):
        prompts = next(data_iter)
        B = len(prompts["ground_truth"]) * jax.process_count()
        limit = groups_to_generate(buffer, B) if config.rollout.slots and gen > 0 else None
        generated = np.ones(B, bool) if limit is None else generated_groups(
            limit, B, group_size=G, slots=config.rollout.slots, mesh=mesh)
        rows = np.repeat(generated, G)  # the responses generated
        t0 = time.perf_counter()
        prompt_ids, prompt_mask = global_prompts(config, prompts)
        prompt_lens.append(prompt_ids.shape[1])
        longest.append(int(prompt_mask.sum(axis=1).max()))
        prompt_ids = parallel.host_to_global(prompt_ids, replicated)
        prompt_mask = parallel.host_to_global(prompt_mask, replicated)
        result = generate(model, prompt_ids, prompt_mask, rng=parallel.replicated_key(jax.random.fold_in(key, gen), mesh), group_size=G,
                          max_new_tokens=config.rollout.max_new_tokens, eos_ids=eos_ids,
                          temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                          top_k=config.rollout.top_k, pad_id=pad_id, mesh=mesh, slots=config.rollout.slots,
                          num_groups=limit, decode_layout=config.rollout.decode_layout,
                          compact_min_rows=config.rollout.compact_min_rows, gpu_gemm=config.model.gpu_gemm,
                          token_stats=token_stats)
        sampler_stats = {"old_entropy": result.entropy, "old_pi2_dev": result.pi2_dev} if token_stats else {}
        host = {k: parallel.to_host(v) for k, v in {
            "input_ids": result.tokens, "attention_mask": result.attention_mask,
            "response_mask": result.response_mask, "old_log_probs": result.log_probs,
            "response_ids": result.response_ids, "truncated": result.truncated, **sampler_stats}.items()}
        t1 = time.perf_counter()
        own = parallel.local_slice(len(host["response_ids"]))
        scored = rows[own]  # this host's generated rows
        texts = decode_responses(tokenizer, host["response_ids"][own][scored], host["response_mask"][own][scored],
                                 eos_ids)
        truths = np.repeat(np.asarray(prompts["ground_truth"]), G)[scored]
        local_rewards, stats = pool.score(texts, list(truths))
        local = np.zeros(own.stop - own.start, np.float32)
        local[scored] = local_rewards
        rewards = parallel.gather_hosts(local)[rows]
        host = {k: v[rows] for k, v in host.items()}
        stat_keys = sorted(k for k in stats if k != "reward_s")
        totals = parallel.gather_hosts(np.asarray([[float(stats[k]) for k in stat_keys]])).sum(axis=0)
        t2 = time.perf_counter()
        t_generate += t1 - t0
        t_reward += t2 - t1
        gen_batches += 1
        for k, v in zip(stat_keys, totals):
            reward_stats[k] = reward_stats.get(k, 0.0) + float(v)
        all_rewards.append(rewards)
        lengths.append(host["response_mask"].sum(axis=1))
        truncated.append(host["truncated"])
        keep = groups_with_spread(rewards, G) if ds.enabled else np.ones(len(rewards) // G, bool)
        buffer.add({"input_ids": host["input_ids"], "attention_mask": host["attention_mask"],
                    "response_mask": host["response_mask"], "old_log_probs": host["old_log_probs"],
                    "rewards": rewards, **{k: host[k] for k in sampler_stats}}, keep)
        if buffer.full:
            break
    if not buffer.full:
        raise DynamicSamplingError(
            f"dynamic sampling kept only {buffer.num_groups} of the {buffer.target} groups needed after "
            f"{gen_batches} generation batches (dynamic_sampling.max_num_gen_batches): almost every group has "
            f"equal rewards. The task may be too easy or too hard for the policy; raise the limit (a run may "
            f"resume from its last checkpoint with a higher one), or set dynamic_sampling.enabled=False")
    rewards = np.concatenate(all_rewards)
    lengths = np.concatenate(lengths)
    batch = buffer.take()
    metrics = {
        "reward_mean": float(rewards.mean()), "accuracy": float((rewards >= 0.5).mean()),
        "response_length_mean": float(lengths.mean()), "response_length_max": float(lengths.max()),
        "truncated_frac": float(np.concatenate(truncated).mean()),
        "batch_reward_mean": float(batch["rewards"].mean()),
        "dynamic_sampling_kept_frac": buffer.num_groups / max(buffer.seen_groups, 1),
        "dynamic_sampling_gen_batches": gen_batches,
        "prompt_len": max(prompt_lens), "prompt_len_max": max(longest),
        "generate_s": t_generate, "reward_s": t_reward, **reward_stats,
    }
    return batch, metrics


def decode_responses(tokenizer, response_ids: np.ndarray, response_mask: np.ndarray, eos_ids) -> list[str]:
    """Text of each response: its masked tokens, EOS and special tokens removed."""
    eos = set(int(e) for e in eos_ids)
    seqs = [[int(t) for t, m in zip(row, mrow) if m and int(t) not in eos]
            for row, mrow in zip(response_ids, response_mask)]
    return tokenizer.batch_decode(seqs, skip_special_tokens=True)


# ----------------------------------------------------------------------------- evaluation

def evaluate_model(config, model, tokenizer, eval_sources: dict, key, *, eos_ids, pad_id, mesh, pool=None) -> dict:
    """avg@n and pass@k (k <= n = eval.n) per eval dataset, sampling at eval.temperature / eval.top_p;
    scored by `pool` (the training's verifier pool) or, without one, a pool of its own."""
    import contextlib

    from stare_jax.data import make_eval_iterator
    from stare_jax.eval_metrics import summarize
    from stare_jax.rewards import RewardPool
    from stare_jax.rollout import generate

    n = config.eval.n
    model, mesh = parallel.rollout_placement(model, mesh, config.mesh.rollout_devices)
    shards = parallel.batch_divisor(mesh)
    hosts = jax.process_count()
    batch = max(1, min(config.eval.max_prompts, 64) // hosts)  # prompts per host per eval batch
    while (batch * hosts * n) % shards:
        batch += 1
    results = {}
    with (contextlib.nullcontext(pool) if pool is not None else
          RewardPool(config.reward.name, num_workers=config.reward.num_workers, timeout_s=config.reward.timeout_s)) as pool:
        for di, (name, source) in enumerate(sorted(eval_sources.items())):
            rows, samples = [], []
            it = make_eval_iterator(source, tokenizer=tokenizer, batch_size=batch,
                                    max_prompt_len=config.data.max_prompt_len, prompt_style=prompt_style(config),
                                    instruction=prompt_instruction(config), limit=config.eval.max_prompts)
            replicated = parallel.replicated(mesh)
            for bi, prompts in enumerate(it):
                prompt_ids, prompt_mask = global_prompts(config, prompts)
                result = generate(model, parallel.host_to_global(prompt_ids, replicated),
                                  parallel.host_to_global(prompt_mask, replicated),
                                  rng=parallel.replicated_key(jax.random.fold_in(jax.random.fold_in(key, di), bi), mesh),
                                  group_size=n,
                                  max_new_tokens=config.rollout.max_new_tokens, eos_ids=eos_ids,
                                  temperature=config.eval.temperature, top_p=config.eval.top_p, pad_id=pad_id,
                                  mesh=mesh, slots=config.eval.slots, decode_layout=config.rollout.decode_layout,
                                  compact_min_rows=config.rollout.compact_min_rows, gpu_gemm=config.model.gpu_gemm)
                ids, mask = parallel.to_host(result.response_ids), parallel.to_host(result.response_mask)
                own = parallel.local_slice(len(ids))
                texts = decode_responses(tokenizer, ids[own], mask[own], eos_ids)
                scores, _ = pool.score(texts, list(np.repeat(np.asarray(prompts["ground_truth"]), n)))
                correct = (np.asarray(scores).reshape(-1, n) >= 0.5)[np.asarray(prompts["valid"])]
                rows.append(correct)
                if bi == 0:
                    samples = eval_samples(prompts, texts, scores, n)
            # every process evaluated its own prompts: gather the per-prompt counts
            counts = np.concatenate(rows).sum(axis=1) if rows else np.zeros((0,), int)
            counts = _gather_ragged(counts)
            results[name] = summarize((np.arange(n)[None, :] < counts[:, None]).astype(np.float32))
            results[name]["samples"] = samples
    return results


def eval_samples(prompts: dict, texts: list[str], scores, n: int, num_prompts: int = 4, per_prompt: int = 2
                 ) -> list[dict]:
    """A few evaluation responses to show what the policy writes: the first `per_prompt` responses of
    the first `num_prompts` prompts of a batch, with their rewards."""
    out = []
    for i in range(min(num_prompts, len(prompts["question"]))):
        if not bool(np.asarray(prompts["valid"])[i]):
            continue
        out.append({"question": str(prompts["question"][i]), "ground_truth": str(prompts["ground_truth"][i]),
                    "responses": [{"text": texts[i * n + j], "reward": float(scores[i * n + j])}
                                  for j in range(min(per_prompt, n))]})
    return out


# ----------------------------------------------------------------------------- the loop

def train(config, workdir: str) -> dict:
    """Runs (or resumes) training as configured; returns the last step's metrics.

    Holds WORKDIR/.lock (process 0) for its whole life: a second training in the same workdir
    raises WorkdirError. On SIGTERM/SIGINT/SIGHUP it finishes the current step, saves a checkpoint
    and raises `preemption.Preempted` (see stare_jax/preemption.py; after a hang-up its output goes
    to WORKDIR/hangup.log).
    """
    workdir = workdir_lib.check_workdir(workdir)
    os.makedirs(workdir, exist_ok=True)
    lock = workdir_lib.WorkdirLock(workdir) if jax.process_index() == 0 else None
    if lock is not None:
        lock.acquire()
    from stare_jax.rewards import RewardPool

    try:
        with preemption.StopSignal(os.path.join(workdir, preemption.HANGUP_LOG)) as stop, precision.matmul_precision(config.model.matmul_precision):
            # The verifier pool first: a reward function that cannot be loaded (RewardSpecError)
            # stops the run before the model loads or anything compiles.
            with RewardPool(config.reward.name, num_workers=config.reward.num_workers,
                            timeout_s=config.reward.timeout_s) as pool:
                return _train(config, workdir, stop, pool)
    finally:
        if lock is not None:
            lock.release()


def _train(config, workdir: str, stop: "preemption.StopSignal", pool) -> dict:
    from stare_jax import data as data_lib
    from stare_jax.rl import abstract_train_state, create_train_state, make_update_step

    mesh = parallel.mesh_from_config(config.mesh)
    ckpt = ckpt_lib.Checkpointer(workdir, keep=config.keep_checkpoints, compression=config.checkpoint_compression)
    ckpt.check_compatible(config)

    policy = prepare_policy(config, workdir, mesh)
    tokenizer = policy.tokenizer
    if tokenizer is None:
        raise ValueError(f"{config.model.path}: the model directory has no tokenizer files")
    eos_ids = tuple(policy.config.eos_token_ids) or (tokenizer.eos_token_id,)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    if jax.process_index() == 0:  # builds the TFDS datasets once; the other hosts then only read them
        train_source, eval_sources = data_sources(config, workdir)
    _barrier("tfds")
    if jax.process_index() != 0:
        train_source, eval_sources = data_sources(config, workdir)
    if len(train_source) < config.data.prompt_batch_size:  # the files' count is known once they are read
        raise config_lib.ConfigError("data.prompt_batch_size", f"got {config.data.prompt_batch_size}; allowed: at most "
                                                               f"the {len(train_source)} prompts of the training split")
    data_iter = data_lib.make_prompt_iterator(
        train_source, tokenizer=tokenizer, batch_size=config.data.prompt_batch_size // jax.process_count(),
        max_prompt_len=config.data.max_prompt_len, seed=config.seed, prompt_style=prompt_style(config),
        instruction=prompt_instruction(config))

    ref_model = None
    if config.loss.kl_type != "none":
        ref_model = prepare_policy(config, workdir, mesh).model
    train_state = create_train_state(policy.model, config, mesh=mesh, ref_model=ref_model)
    update = make_update_step(config, mesh, train_state, reject_disagreement=True)  # on-policy batches
    base_key = jax.random.key(config.seed)

    def update_off_eigen():
        """The update step rebuilt on XLA:CPU's default kernels (`model.cpu_gemm = "ynnpack"`)."""
        return make_update_step(cpu_gemm.with_choice(config, "ynnpack"), mesh, train_state)

    start = 0
    restored = ckpt.restore_latest({"train": abstract_train_state(train_state, mesh),
                                    "rng": jax.ShapeDtypeStruct((), base_key.dtype,
                                                                sharding=parallel.replicated(mesh))})
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    fallback_step = None  # the step whose disagreement moved the update off Eigen's products (kept in checkpoints)
    if restored is not None:
        start, state, data_state, meta = restored
        fallback_step = meta.get("cpu_gemm_fallback_step") if isinstance(meta, dict) else None
        if fallback_step is not None and cpu_gemm.uses_eigen_products(update.compiler_options):
            update = update_off_eigen()
            log.info("the update runs on XLA:CPU's default kernels (model.cpu_gemm=ynnpack), as it has since "
                     "step %d's disagreement (recorded in the checkpoint)", fallback_step)
        from flax import nnx
        nnx.update(train_state, state["train"])
        base_key = state["rng"]
        data_iter.set_state(data_state)
        if jax.process_index() == 0:
            truncate_jsonl(metrics_path, start - 1)
        log.info("resumed from step %d", start)
    elif jax.process_index() == 0 and os.path.exists(metrics_path):
        truncate_jsonl(metrics_path, -1)  # a run that never checkpointed starts over
    if jax.process_index() == 0:
        ckpt_lib.write_json_atomic(os.path.join(workdir, "config.json"), ckpt_lib.config_to_json(config))

    # Events of steps >= start from an earlier attempt are hidden by TensorBoard (purge_step).
    writer = MetricsWriter(workdir, tensorboard=config.logging.tensorboard, wandb=config.logging.wandb,
                           wandb_project=config.logging.wandb_project, config=ckpt_lib.config_to_json(config),
                           purge_step=start)
    progress = Progress(config.total_steps, start, enabled=config.logging.progress)
    row: dict = {}
    compilations = CompilationCounter()
    disagreement_seen = False  # warned once: the update's log-probs against the sampler's (rl/policy_agreement.py)
    agreement_bound = disagreement_bound(config.model.dtype, config.model.matmul_precision,
                                         mesh.devices.flat[0].platform)
    rebuilt_at = -2  # the step whose update was rebuilt off Eigen's products (it and the next step compile)
    try:
        if (start == 0 and config.eval.enabled and config.eval.at_start
                and not os.path.exists(os.path.join(workdir, "eval", "step_0.json"))):
            base = _run_eval(config, train_state.model, tokenizer, eval_sources, base_key, 0, workdir, eos_ids,
                             pad_id, mesh, pool=pool)
            log.info("initial policy: %s", ", ".join(f"{k} {v:.3f}" for k, v in sorted(base.items())))
        stop.defer()  # from here a signal ends the step in progress and saves (before: nothing to save)
        # logged here, after every refusal of bad input (whose message stays the only line of stderr)
        log.info("host malloc: %s (stare_jax.allocator)", "oneTBB" if allocator.active() else "system")
        allocator.release_cache_on_compile()  # CPU runs: a new program's one-off blocks leave before it runs
        for step in range(start, config.total_steps):
            step_key = jax.random.fold_in(base_key, step)
            if os.environ.get(FAULT_RAISE_AT_STEP) == f"{step}:{jax.process_index()}":
                raise RuntimeError(f"{FAULT_RAISE_AT_STEP}: a failure injected in step {step}")
            compilations.take()
            releases = allocator.releases_on_compile()
            t0 = time.perf_counter()
            batch, rollout_metrics = collect_batch(config, train_state.model, tokenizer, data_iter, pool,
                                                   jax.random.fold_in(step_key, 0), eos_ids=eos_ids, pad_id=pad_id,
                                                   mesh=mesh)
            t1 = time.perf_counter()
            batch, packing = update.arrange(batch)  # packed layout from host memory: no device read-back
            if allocator.release_cache_on_switch(packing):  # CPU runs: one program's temporaries cached
                log.info("oneTBB's cache emptied as step %d's update switched to packed capacity %d "
                         "(stare_jax.allocator)", step, packing.capacity)
            train_state, update_metrics = update(train_state, parallel.shard_batch(batch, mesh),
                                                 jax.random.fold_in(step_key, 1), packing=packing)
            update_metrics = {k: float(parallel.to_host(v)) for k, v in update_metrics.items()}
            disagreement = disagreement_line(update_metrics, agreement_bound)
            if disagreement and not disagreement_seen:
                log.warning("step %d: %s (warned once; every step's is in metrics.jsonl)", step, disagreement)
                disagreement_seen = True
            fallback: dict = {}
            if disagreement and cpu_gemm.uses_eigen_products(update.options_for(batch)):
                # Eigen's products are the kernels seen computing wrong values (stare_jax.cpu_gemm): the
                # rest of this run's updates compile on XLA:CPU's defaults, and this step, which the
                # update's disagreement guard left undone (rl/update.py), runs again on them
                update = update_off_eigen()
                rebuilt_at = fallback_step = step
                fallback = {"cpu_gemm_fallback": 1, "eigen_sampler_approx_kl": update_metrics["sampler_approx_kl"]}
                rejected = update_metrics.get("disagreement_rejected") == 1.0
                log.warning("step %d: the update step is rebuilt on XLA:CPU's default kernels (model.cpu_gemm="
                            "ynnpack) for the rest of this run, a resumed one included (model.cpu_gemm=%s "
                            "configured)%s", step, config.model.cpu_gemm,
                            "; the step, left undone, runs again on them" if rejected else "")
                if rejected:
                    train_state, update_metrics = update(train_state, parallel.shard_batch(batch, mesh),
                                                         jax.random.fold_in(step_key, 1), packing=packing)
                    update_metrics = {k: float(parallel.to_host(v)) for k, v in update_metrics.items()}
            t2 = time.perf_counter()
            row = {**rollout_metrics, **update_metrics, "rollout_s": t1 - t0, "update_s": t2 - t1,
                   "step_s": t2 - t0, "compilations": compilations.take(), **fallback}
            if packing is not None:
                row["packed_capacity"] = packing.capacity
            if allocator.releases_on_compile() > releases:
                log.info("oneTBB's cache emptied as step %d's new XLA programs were built (%d times; "
                         "stare_jax.allocator)", step, allocator.releases_on_compile() - releases)
            if step == start and compilation.persistent_cache_hits():
                log.info("loaded %d XLA programs from the compilation cache %s (up to the end of the first step)",
                         compilation.persistent_cache_hits(), compilation.cache_dir())
            if step > start and row["compilations"] and step not in (rebuilt_at, rebuilt_at + 1):
                log.warning("step %d compiled %d XLA programs (prompt bucket %d%s): shapes changed since the first "
                            "step", step, row["compilations"], row["prompt_len"],
                            "" if packing is None else f", packed capacity {packing.capacity}")
            done = step + 1
            if config.test_freq and done % config.test_freq == 0 and config.eval.enabled:
                row.update(_run_eval(config, train_state.model, tokenizer, eval_sources, base_key, done,
                                     workdir, eos_ids, pad_id, mesh, pool=pool))
            writer.write(step, row)
            ckpt.check()  # a failed background save stops the run here (CheckpointWriteError)
            if done % config.log_every == 0 or done == config.total_steps:
                progress.update(step, row)
            signum = stop.agreed(step)
            if done % config.checkpoint_every == 0 or done == config.total_steps or signum:
                ckpt.save(done, {"train": _state_of(train_state), "rng": parallel.replicated_key(base_key, mesh)},
                          data_iter.get_state(),
                          {"step": done, "config": ckpt_lib.config_to_json(config),
                           **({} if fallback_step is None else {"cpu_gemm_fallback_step": fallback_step})})
            if signum:
                ckpt.wait()
                raise preemption.Preempted(signum, done)
        if os.environ.get(FAULT_KILL_BEFORE_FINAL_EVAL):
            ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: die after the last commit, before the final eval
        # The final evaluation, unless it exists already (a run killed after its last checkpoint
        # commits and before this file is written gets it on the re-run).
        final = os.path.join(workdir, "eval", f"step_{config.total_steps}.json")
        if config.eval.enabled and not _all_agree(os.path.exists(final)):
            signum = stop.agreed(config.total_steps)
            if signum:
                raise preemption.Preempted(signum, config.total_steps)
            _run_eval(config, train_state.model, tokenizer, eval_sources, base_key, config.total_steps, workdir,
                      eos_ids, pad_id, mesh, pool=pool)
    except BaseException as e:
        if distributed.peer_failure_reason(e) is not None:
            ckpt.abandon()  # a pending save's Orbax threads wait for the lost process at its commit barrier
        raise
    finally:
        progress.close()
        ckpt.close()
        writer.close()
    return row


def _gather_ragged(values: np.ndarray) -> np.ndarray:
    """Concatenates 1-D arrays of possibly different lengths from all processes, in process order."""
    if jax.process_count() == 1:
        return np.asarray(values)
    sizes = parallel.gather_hosts(np.asarray([len(values)]))
    padded = np.zeros((int(sizes.max()),), np.asarray(values).dtype)
    padded[:len(values)] = values
    allv = parallel.gather_hosts(padded[None, :])
    return np.concatenate([allv[i, :int(sizes[i])] for i in range(len(sizes))])


def _state_of(train_state):
    from flax import nnx
    return nnx.state(train_state)


def _run_eval(config, model, tokenizer, eval_sources, base_key, step, workdir, eos_ids, pad_id, mesh,
              pool=None) -> dict:
    """Evaluates (`evaluate_model`), writes WORKDIR/eval/step_<k>.json, returns flat
    `eval/<dataset>/<metric>` scalars."""
    t0 = time.perf_counter()
    results = evaluate_model(config, model, tokenizer, eval_sources, jax.random.fold_in(base_key, 1 << 30 | step),
                             eos_ids=eos_ids, pad_id=pad_id, mesh=mesh, pool=pool)
    if jax.process_index() == 0:
        os.makedirs(os.path.join(workdir, "eval"), exist_ok=True)
        ckpt_lib.write_json_atomic(os.path.join(workdir, "eval", f"step_{step}.json"),
                                   {"step": step, "results": results, "eval_s": time.perf_counter() - t0})
    return {f"eval/{name}/{k}": v for name, r in results.items() for k, v in r.items()
            if k not in ("num_prompts", "n", "num_correct", "samples")}


# ----------------------------------------------------------------------------- trained policies

def config_from_json(flat: dict):
    """Rebuilds a ConfigDict from the flattened {"a.b": value} form stored in checkpoints."""
    from stare_jax import config as config_lib

    return config_lib.set_dotted(config_lib.default_config(), flat, strict=False)


def load_trained_policy(workdir: str, *, config=None, step: int | None = None, mesh=None):
    """(config, policy, step) of a workdir's newest usable (or given) checkpoint, restored onto `mesh`
    (default: one device). The config is the one the run saved unless `config` is given. Only the
    policy parameters are read, from the checkpoint alone, onto the structure and shardings of the
    run's model config (`abstract_model`): the base weights are not loaded first. The restore goes
    through `Checkpointer.restore` (partial), the path training uses: a damaged newest step is
    skipped for the previous one; a damaged or missing `step` raises CheckpointUnusableError.
    Raises FileNotFoundError when the workdir holds no usable checkpoint."""
    from flax import nnx

    workdir = os.path.abspath(workdir)
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise FileNotFoundError(f"{workdir} holds no checkpoints (no {workdir}/checkpoints directory)")
    ckpt = ckpt_lib.Checkpointer(workdir, read_only=True)
    try:
        steps = [s for s in ckpt.steps() if ckpt.is_complete(s)]
        if not steps:
            raise FileNotFoundError(f"{workdir}/checkpoints holds no complete checkpoint")
        if step is not None and step not in steps:
            raise ckpt_lib.CheckpointUnusableError(
                f"{workdir}/checkpoints has no complete step {step}; complete steps: {steps}")
        saved = None
        for s in ([step] if step is not None else reversed(steps)):
            try:  # the run's config (the same in every step of a run); a damaged meta is skipped here
                saved = config_from_json(ckpt.read_meta(s)["config"])
                break
            except Exception as e:
                log.warning("checkpoint step %d: cannot read its metadata (%s: %s)", s, type(e).__name__, e)
        if saved is None:
            raise FileNotFoundError(f"{workdir}/checkpoints holds no checkpoint with readable metadata")
        mesh = mesh if mesh is not None else parallel.make_mesh(devices=jax.devices()[:1])
        path = model_directory(saved, workdir, create=False)
        cfg = load_config(path)
        graphdef, state = abstract_model(cfg, dtype=saved.model.dtype, param_dtype=saved.model.param_dtype, mesh=mesh)
        restored = ckpt.restore({"train": {"model": state}}, step=step, partial=True)
        if restored is None:
            raise FileNotFoundError(f"{workdir}/checkpoints holds no usable checkpoint (every step is damaged; "
                                    f"see the warnings above)")
        step, params, _, meta = restored
        config = config_from_json(meta["config"]) if config is None else config
        model = nnx.merge(graphdef, params["train"]["model"])
        policy = Policy(model=model, config=cfg, tokenizer=load_tokenizer_dir(path), mesh=mesh)
    finally:
        ckpt.close()
    return config, policy, step


def _all_agree(flag: bool) -> bool:
    """Process 0's `flag`, on every process (file checks happen on process 0 only)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(bool(flag))))


def _barrier(name: str) -> None:
    """Waits for every process (no-op on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
