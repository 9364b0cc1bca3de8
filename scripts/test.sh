#!/usr/bin/env bash
# The whole test suite, from a clean checkout: venv, install, pytest, mypy --strict, ruff.
# Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch==2.13.0 (the CPU wheel) comes from the interop extra; cuda-python is optional and its
# absence only skips the tests that need it.
.venv/bin/python -m pip install --quiet -e ".[test,interop,bench,runtime]"
.venv/bin/python -m pip install --quiet -e ".[cuda]" || echo "cuda-python unavailable here: its tests will skip"
# Ray publishes wheels for some Python versions only; where it cannot be installed, the tests
# marked ray skip and say why.
.venv/bin/python -m pip install --quiet -e ".[ray]" || echo "ray unavailable here: its tests will skip"
status=0
.venv/bin/python -m pytest "$@" || status=$?
.venv/bin/python -m mypy --strict || status=1
.venv/bin/python -m ruff check . || status=1
exit $status
