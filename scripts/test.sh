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
# The project is installed once (one editable install); torch==2.13.0 (the CPU wheel) comes from
# the interop extra. The serve extra (uvicorn, httptools, uvloop, grpcio) has wheels for every
# supported Python, so it installs here too; the bench extra brings tritonclient[http,grpc],
# which the serve tests drive the server with (they skip, saying so, where either is missing).
.venv/bin/python -m pip install --quiet -e ".[test,interop,bench,runtime,serve]"
# The optional extras' packages, as pyproject.toml declares them, constrained to what is
# installed now: an optional package that would downgrade one (ml_dtypes) fails instead of
# changing it. cuda-python is optional and its absence only skips the tests that need it; Ray
# publishes wheels for some Python versions only, and the tests marked ray skip without it.
.venv/bin/python -m pip freeze --exclude-editable | { grep -v ' @ ' || true; } > .venv/constraints.txt
extra() {  # the requirements of one extra, one a line (tomllib needs Python 3.11)
    .venv/bin/python - "$1" <<'PYEOF'
import re, sys
text = open("pyproject.toml", encoding="utf-8").read()
found = re.search(r"^%s = \[(.*?)\]" % re.escape(sys.argv[1]), text, re.M | re.S)
print("\n".join(re.findall(r'"([^"]+)"', found.group(1) if found else "")))
PYEOF
}
for name in cuda ray; do
    mapfile -t packages < <(extra "$name")
    .venv/bin/python -m pip install --quiet -c .venv/constraints.txt "${packages[@]}" \
        || echo "$name unavailable here (or it would change an installed version): its tests will skip"
done
status=0
.venv/bin/python -m pytest "$@" || status=$?
.venv/bin/python -m mypy --strict || status=1
.venv/bin/python -m ruff check . || status=1
exit $status
