#!/usr/bin/env bash
# Installs everything the tests need into .venv and runs the whole suite (unit, app, end-to-end); args go to pytest.
EXTRAS=test source "$(dirname "$0")/env.sh"
ruff check transformers_openai tests benchmarks
mypy transformers_openai
python -m pytest -q -p no:cacheprovider "$@"
