#!/usr/bin/env bash
# Starts the server on SmolLM2-135M-Instruct from PyPI on http://127.0.0.1:7088/v1; extra flags pass through.
# The model is a 4-bit GGUF (Q4_1) dequantized to float32 once into .cache/models/ (SMOLLM2_DIR) and reused.
# Its chat template is the model's own plus tools (deploy/chat-templates/smollm2-tools.jinja), so tool calls work.
# torch uses every core (TORCH_THREADS, default nproc); the tests alone run on one thread.
set -euo pipefail
source "$(dirname "$0")/env.sh"
MODEL_DIR="${SMOLLM2_DIR:-.cache/models/smollm2-135m-instruct}"
if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "dequantizing the GGUF into $MODEL_DIR (once)" >&2
  python scripts/smollm2_from_gguf.py "$MODEL_DIR" >/dev/null
fi
export TORCH_THREADS="${TORCH_THREADS:-$(nproc)}"
exec python -m transformers_openai.main --model "$MODEL_DIR" --served-model-name SmolLM2-135M-Instruct \
  --chat-template "$ROOT/deploy/chat-templates/smollm2-tools.jinja" "$@"
