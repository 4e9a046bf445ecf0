#!/usr/bin/env bash
# The GPU measurements on a lent machine that lacks the server's packages (torch and CUDA there, little else), in two
# calls: `smoke` (imports, both servers on the SmolLM2 shape at concurrency 1 and 4, the 8B model built) and `full`
# (the 8B shape against `transformers serve`, its step breakdown, then the same for the 1B shape: the most valuable
# first, so a call cut short still brings them back).
# Usage, from the root of a checkout that holds DIR (git-ignored) with
#   DIR/wt    this repository's transformers_openai/ and stress-test/,
#   DIR/like  SmolLM2-135M-Instruct's config.json, tokenizer*.json, chat_template.jinja, generation_config.json,
#   DIR/whl   the wheels of cuda_wheels.txt, fetched for Python 3.12 with
#             pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#               --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
#               -d DIR/whl -r stress-test/cuda_wheels.txt
#   bash DIR/wt/stress-test/cuda_device.sh smoke|full DIR
# Output goes to $OUT (the device tool's folder): log.txt, and results.tgz packed after every step.
# Environment: T8, T1 the comparisons' time limits in seconds (default 210, 150).
set -u
G=$(cd "${2:-.gpu}" && pwd)
exec > >(tee -a "$OUT/log.txt") 2>&1
echo "start $(date -u +%T)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$G/wt:$G/wt/stress-test PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m loadtest "$@"\n' >/tmp/bin/loadtest && chmod +x /tmp/bin/loadtest
export PATH=/tmp/bin:$PATH MODELS_DIR=/tmp/random-models
res=/tmp/res-$1
mkdir -p "$res"
export AFTER_STEP="tar czf $OUT/results.tgz.tmp -C $res . && mv $OUT/results.tgz.tmp $OUT/results.tgz; echo packed \$(date -u +%T)"
run() { bash "$G/wt/stress-test/cuda_run.sh" "$G/like" "$res" "$@"; }
echo "wheels in $(date -u +%T)"
if [ "$1" = smoke ]; then
  python3 -c "import transformers, fastapi, openai, llguidance, transformers_openai.api.app, transformers_openai.main, transformers.cli.serving.chat_completion; print('imports ok', transformers.__version__)" || echo IMPORT FAILED
  REPEAT=1 CONCURRENCY=1,4 REQUESTS=4 TIME_LIMIT=100 run smollm2-135m-shape
  loadtest step-breakdown --model /tmp/random-models/smollm2-135m-shape --device cuda --dtype bfloat16 --weights plain \
    --threads 4 --batch 1,4 --max-tokens 32 --decode ahead --gpu-time --agreement --out "$res/sb-smoke.json" || echo SB FAILED
  bash -c "$AFTER_STEP"
  /usr/bin/time -v python3 -m loadtest random-model --like "$G/like" --preset llama-8b --out /tmp/random-models/llama-8b-shape 2>&1 |
    grep -E "shape of|Elapsed|Maximum resident" || echo BUILD8B FAILED
else
  REPEAT=1 TIME_LIMIT=${T8:-210} run llama-8b-shape
  DECODE=graphs,ahead run breakdown-8b
  REPEAT=1 TIME_LIMIT=${T1:-150} run llama-1b-shape
  DECODE=graphs,ahead FP32_CHECK=0 run breakdown
fi
echo "end $(date -u +%T)"
