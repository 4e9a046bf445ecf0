#!/usr/bin/env bash
# Installs everything the tests need into .venv and runs the whole suite (unit, app, end-to-end); args go to pytest.
EXTRAS=test source "$(dirname "$0")/env.sh"
# The compose file is validated by the compose CLI (no Docker engine needed); Debian ships it as docker-compose.
if ! command -v docker-compose >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose) >/dev/null 2>&1 \
    || echo "note: docker-compose not installed; the compose validation tests will be skipped"
fi
# ffmpeg decodes the audio formats libsndfile cannot (webm, m4a); the tests of those formats need it.
if ! command -v ffmpeg >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq --no-install-recommends ffmpeg) >/dev/null 2>&1 \
    || echo "note: ffmpeg not installed; the webm and m4a tests will be skipped"
fi
ruff check transformers_openai tests stress-test scripts
mypy transformers_openai
python -m pytest -q -p no:cacheprovider "$@"
