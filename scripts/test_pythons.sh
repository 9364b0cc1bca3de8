#!/usr/bin/env bash
# The numpy-only tests (no torch, JAX or CUDA) under every CPython we support that this machine
# has, each in its own venv, to prove the ctypes layer across interpreter versions.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
root=$(pyenv root 2>/dev/null || echo "")
for version in 3.10 3.12 3.13; do
    py=""
    if [ -n "$root" ]; then
        py=$(ls -d "$root"/versions/"$version".*/bin/python3 2>/dev/null | sort -V | tail -n 1)
    fi
    [ -n "$py" ] || py=$(command -v "python$version" || true)
    if [ -z "$py" ]; then
        echo "== Python $version: not installed here, skipped"
        continue
    fi
    venv=".ci-venvs/py$version"
    echo "== Python $version ($py)"
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv" || { status=1; continue; }
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -e ".[test]" || { status=1; continue; }
    # -p no:cacheprovider keeps the shared checkout clean across interpreters.
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not gpu" || status=1
done
exit $status
