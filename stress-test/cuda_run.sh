#!/usr/bin/env bash
# The CUDA measurements of the stress test, on one GPU, in one go:
#   1. random-weight models of two shapes (SmolLM2-135M, and Llama 3.2 1B's layers over SmolLM2's tokenizer);
#   2. for each, compare.py in bf16 against `transformers serve --continuous-batching` on the same GPU,
#      interleaved (ours, theirs, ours, theirs), concurrency 1 and 16, streaming chat, 64 tokens per answer;
#   3. kv_memory.py (15 short requests + one 3,000-token prompt) on the 1B shape: torch.cuda.max_memory_allocated.
# Usage: bash stress-test/cuda_run.sh LIKE_MODEL_DIR OUT_DIR [STEP ...]
#   STEP: smollm2-135m-shape, llama-1b-shape (a comparison each) or memory; default all three, in that order.
# LIKE_MODEL_DIR holds a config and tokenizer (SmolLM2-135M-Instruct's; its weights are not needed).
# REQUESTS (environment, default 32): requests per concurrency level.
set -euo pipefail
like=$1
out=$2
shift 2
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(smollm2-135m-shape llama-1b-shape memory)
requests=${REQUESTS:-32}
here=$(cd "$(dirname "$0")" && pwd)
models=${MODELS_DIR:-/tmp/random-models}
mkdir -p "$out" "$models"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
[ -f "$models/smollm2-135m-shape/config.json" ] ||
  python3 "$here/random_model.py" --like "$like" --preset same --out "$models/smollm2-135m-shape"
[ -f "$models/llama-1b-shape/config.json" ] ||
  python3 "$here/random_model.py" --like "$like" --preset llama-1b --out "$models/llama-1b-shape"
for step in "${steps[@]}"; do
  if [ "$step" = memory ]; then
    python3 "$here/kv_memory.py" --model "$models/llama-1b-shape" --device cuda --dtype bfloat16 \
      --out "$out/kv-memory-llama-1b.json"
  else
    python3 "$here/compare.py" --model "$models/$step" --device cuda --dtype bfloat16 --endpoint chat \
      --target server --target transformers-serve --concurrency 1,16 --requests "$requests" --repeat 2 \
      --threads 4 --time-limit "${TIME_LIMIT:-420}" --out "$out/compare-$step.json" 2>&1 | tee "$out/compare-$step.txt"
  fi
done
