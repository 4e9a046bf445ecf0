#!/usr/bin/env bash
# The CUDA measurements of the stress test, on one GPU, in one go:
#   1. random-weight models of three shapes (SmolLM2-135M, and Llama 3.2 1B's and Llama 3.1 8B's layers over SmolLM2's
#      tokenizer), each built when a step first needs it;
#   2. for each, `loadtest compare` in bf16 against `transformers serve --continuous-batching` on the same GPU,
#      interleaved (ours, theirs, ours, theirs), concurrency 1, 16 and 64, streaming chat, 64 tokens per answer;
#   3. `loadtest kv-memory` (15 short requests + one 3,000-token prompt) on the 1B shape: torch.cuda.max_memory_allocated;
#   4. `loadtest step-breakdown` on the 1B shape (`breakdown`) or the 8B one (`breakdown-8b`): the eager step against
#      the CUDA-graph step (and it launched ahead, as the server runs it) at batch 1, 16 and 64, wall
#      time against the GPU's busy time (torch profiler), greedy tokens against `generate` (bf16, and fp32 at 16 for
#      the 1B shape).
# Usage: bash stress-test/cuda_run.sh LIKE_MODEL_DIR OUT_DIR [STEP ...]
#   STEP: smollm2-135m-shape, llama-1b-shape, llama-8b-shape (a comparison each), memory, breakdown or breakdown-8b;
#   default the first three, in that order. A step that fails is reported in OUT_DIR/failed.txt and the next runs.
# LIKE_MODEL_DIR holds a config and tokenizer (SmolLM2-135M-Instruct's; its weights are not needed).
# Environment: REQUESTS (default: `loadtest compare`'s, twice the concurrency, at least 8) requests per concurrency level;
# CONCURRENCY (default 1,16,64); REPEAT (default 2) interleaved repetitions; TIME_LIMIT (default 420) seconds each;
# DECODE (default grouped,graphs,ahead) the step-breakdown variants; FP32_CHECK=0 leaves out the 1B fp32 agreement;
# AFTER_STEP a command run after each step (to pack the results so far, say).
set -euo pipefail
like=$1
out=$2
shift 2
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(smollm2-135m-shape llama-1b-shape memory)
requests=${REQUESTS:-0}
models=${MODELS_DIR:-/tmp/random-models}
mkdir -p "$out" "$models"
# The `loadtest` CLI: this folder's package, installed into the environment that has torch and the project.
command -v loadtest >/dev/null || python3 -m pip install -q --no-deps -e "$(dirname "$0")"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
model() { # the random-weight model of shape $1 (smollm2-135m-shape, llama-1b-shape, llama-8b-shape), built once
  local preset=${1%-shape}
  [ "$preset" = smollm2-135m ] && preset=same
  [ -f "$models/$1/config.json" ] || loadtest random-model --like "$like" --preset "$preset" --out "$models/$1" >&2
  echo "$models/$1"
}
run_step() {
  local step=$1 shape
  if [ "$step" = breakdown ] || [ "$step" = breakdown-8b ]; then
    shape=llama-1b-shape
    [ "$step" = breakdown-8b ] && shape=llama-8b-shape
    loadtest step-breakdown --model "$(model $shape)" --device cuda --dtype bfloat16 --weights plain \
      --threads 4 --batch 1,16,64 --decode "${DECODE:-grouped,graphs,ahead}" --gpu-time --agreement \
      --profile-table "${PROFILE_ROWS:-0}" --out "$out/step-breakdown-${shape%-shape}.json" 2>&1 |
      tee "$out/step-breakdown-${shape%-shape}.txt"
    [ "$step" = breakdown-8b ] || [ "${FP32_CHECK:-1}" = 0 ] ||
      loadtest step-breakdown --model "$(model $shape)" --device cuda --dtype float32 --weights plain \
        --threads 4 --batch 16 --decode graphs --agreement 2>&1 | tee -a "$out/step-breakdown-${shape%-shape}.txt"
  elif [ "$step" = memory ]; then
    loadtest kv-memory --model "$(model llama-1b-shape)" --device cuda --dtype bfloat16 \
      --out "$out/kv-memory-llama-1b.json"
  else
    loadtest compare --model "$(model "$step")" --device cuda --dtype bfloat16 --endpoint chat \
      $(for t in ${TARGETS:-server transformers-serve}; do printf -- "--target %s " "$t"; done) \
      --concurrency "${CONCURRENCY:-1,16,64}" --requests "$requests" --repeat "${REPEAT:-2}" --max-batch-size 64 \
      --threads 4 --time-limit "${TIME_LIMIT:-420}" --out "$out/compare-$step.json" 2>&1 | tee "$out/compare-$step.txt"
  fi
}
for step in "${steps[@]}"; do
  echo "== $step $(date -u +%T)"
  run_step "$step" || echo "$step failed ($?) at $(date -u +%T)" | tee -a "$out/failed.txt"
  [ -z "${AFTER_STEP:-}" ] || bash -c "$AFTER_STEP" || true
done
