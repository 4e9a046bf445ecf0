#!/usr/bin/env bash
# Installs everything the tests need into .venv and runs the whole suite (unit, app, end-to-end); args go to pytest.
# As root with apt-get it also installs a Debian package system-wide (docker-compose), and says so first; without
# it the tests that need it are skipped, and the summary at the end lists every skip with its reason.
set -euo pipefail
EXTRAS=test source "$(dirname "$0")/env.sh"
# One torch thread: with two on a busy 2-core machine, generation got 3-10x slower and erratic. Servers use all cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Bytecode written on first import, whatever the environment says (this machine's image sets PYTHONDONTWRITEBYTECODE):
# uv installs packages without it, and the suite starts well over a hundred Python processes (servers, ranks, tools)
# that would each compile the same transformers and project sources again, about 3 s of a core each.
unset PYTHONDONTWRITEBYTECODE

apt_install() { # package, why
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing the Debian package $1 system-wide (apt-get): $2" >&2
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends "$1") >/dev/null 2>&1 \
      || echo "note: $1 could not be installed; those tests will be skipped" >&2
  else
    echo "note: $1 is not installed (needs root and apt-get); those tests will be skipped: $2" >&2
  fi
}
# The compose file is validated by the compose CLI (no Docker engine needed); Debian ships it as docker-compose.
if ! command -v docker-compose >/dev/null && ! docker compose version >/dev/null 2>&1; then
  apt_install docker-compose "the compose CLI validates docker-compose.yaml (no Docker engine is used)"
fi
# The failover test runs two replicas behind the real HAProxy with deploy/haproxy.cfg (Debian's package; as root
# only, like the compose CLI above; without it that test is skipped).
if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then
  apt_install haproxy "tests/e2e/test_failover.py runs replicas behind HAProxy with deploy/haproxy.cfg"
fi
# torch.compile's CPU kernels (--cpu-compile and its tests) are C++ built at run time.
if ! command -v g++ >/dev/null && ! command -v c++ >/dev/null; then
  apt_install g++ "torch.compile builds its CPU kernels with it (tests/unit/test_fixed_steps.py)"
fi
ruff format --check transformers_openai tests stress-test scripts
ruff check transformers_openai tests stress-test scripts
clang-format --dry-run -Werror transformers_openai/runners/kernels/csrc/*.cpp
# mypy, one run (strict on the package; the tests and tools under their profile, pyproject.toml), checks beside the
# parallel tests below, niced: their workers leave CPU idle while servers load, and a cold mypy is 1.5 minutes of a
# core. Its report comes as one block after the parallel tests; a failure still fails the command.
mypy_log="$(mktemp)"
trap 'rm -f "$mypy_log"' EXIT
nice -n 10 mypy transformers_openai tests stress-test/loadtest scripts >"$mypy_log" 2>&1 &
mypy_pid=$!
# -rs: each skipped test with its reason in the summary; --durations: the slowest tests, where time goes.
report=(-q -rs --durations=30 -p no:cacheprovider)
# First everything but the `serial` tests on TEST_WORKERS (2) xdist workers, a whole module at a time (loadscope: its
# servers start once), in the order tests/conftest.py gives (the quick start first, the quick tests last to fill in);
# then the tests marked `serial`, which assert on wall-clock time, alone (TEST_PHASE: tests/conftest.py picks them,
# so that a -m of your own still applies). Exit status 5 is pytest's "none selected".
status=0
TEST_PHASE=parallel python -m pytest "${report[@]}" -n "${TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder \
  "$@" || status=$?
typing=0
wait "$mypy_pid" || typing=$?
cat "$mypy_log"
if [ "$typing" != 0 ]; then echo "mypy found errors (above)" >&2; fi
serial=0
TEST_PHASE=serial python -m pytest "${report[@]}" "$@" || serial=$?
if [ "$status" = 5 ] && [ "$serial" != 5 ]; then status=0; fi
if [ "$serial" != 0 ] && [ "$serial" != 5 ] && [ "$status" = 0 ]; then status=$serial; fi
if [ "$typing" != 0 ] && { [ "$status" = 0 ] || [ "$status" = 5 ]; }; then status=$typing; fi
exit "$status"
