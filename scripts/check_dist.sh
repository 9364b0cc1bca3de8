#!/usr/bin/env bash
# Build the sdist and the wheel, install the wheel into a fresh venv with numpy only (plus the
# test runner), then run the demo and the sdist's numpy-only tests against the installed wheel.
# Usage: bash scripts/check_dist.sh   (needs .venv from scripts/test.sh, for `build`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet build
.venv/bin/python -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/*.tar.gz)
wheel=$(ls "$work"/dist/*.whl)
echo "== built $(basename "$sdist") and $(basename "$wheel")"

"$PY" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip
"$work/venv/bin/python" -m pip install --quiet "$wheel" pytest hypothesis typing_extensions
echo "== installed the wheel with: $("$work/venv/bin/python" -m pip list --format=freeze | grep -v -E '^(pip|setuptools)=' | tr '\n' ' ')"

# The demo from a neutral folder, so nothing but the installed wheel can be imported.
(cd "$work" && "$work/venv/bin/python" -m pb_tensor demo)

# The sdist's tests, without its package sources next to them (they would shadow the wheel).
tar xzf "$sdist" -C "$work"
src="$work/$(basename "$sdist" .tar.gz)"
rm -rf "$src/pb_tensor" "$src/dlpack_ctypes"
(cd "$src" && "$work/venv/bin/python" -m pytest -q -p no:cacheprovider -m "not gpu")
