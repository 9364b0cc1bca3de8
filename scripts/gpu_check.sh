#!/usr/bin/env bash
# Every GPU check in one bounded run (5 minutes at most, its own timeouts): the gpu-marked tests
# (tests/test_cuda_gpu.py, tests/test_tensor_gpu.py, tests/test_pickle.py, tests/test_runtime_gpu.py
# (BLS placement; it needs protobuf too), and the exchange-API
# tests, whose GPU cases use torch's CUDA build when it is there), then the GPU latency benchmark
# (benchmarks/bench_gpu.py --quick).
#
# Made for a GPU machine that has only Python with numpy, pytest, cuda-python and torch / CuPy:
# no network, no installs. It runs from this checkout (PYTHONPATH=.), with pytest's third-party
# plugin autoloading off, and needs neither hypothesis nor mypy.
# Without a GPU it says why, lets the gpu-marked tests skip, and exits 0.
#
# Usage: bash scripts/gpu_check.sh          (PYTHON=/path/to/python picks the interpreter;
#                                            GPU_CHECK_BUDGET=<seconds> shortens the 290 s cap)
set -uo pipefail
cd "$(dirname "$0")/.."

budget=${GPU_CHECK_BUDGET:-290}
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }
say() { echo "gpu_check: $*"; }

py=${PYTHON:-}
if [ -z "$py" ]; then
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null 2>&1; then
            py=$candidate
            break
        fi
    done
fi
if [ -z "$py" ]; then
    say "FAIL: no python3 on PATH (set PYTHON=...)"
    exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export PYTHONDONTWRITEBYTECODE=1

# What this machine has (never fails: each probe reports what it finds).
timeout -k 5 60 "$py" - <<'EOF'
import importlib, platform, sys, warnings
print(f"gpu_check: Python {platform.python_version()} ({sys.executable})")
for name in ("numpy", "pytest", "typing_extensions", "cuda.bindings", "torch", "cupy", "jax",
             "hypothesis"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            print(f"gpu_check:   {name}: missing ({type(exc).__name__})")
            continue
    version = getattr(module, "__version__", "")
    extra = ""
    if name == "torch":
        extra = f", CUDA available: {module.cuda.is_available()}"
        if module.cuda.is_available():
            extra += f", {module.cuda.device_count()} x {module.cuda.get_device_name(0)}"
    print(f"gpu_check:   {name} {version}{extra}")
EOF
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout -k 5 30 nvidia-smi -L 2>&1 | sed 's/^/gpu_check:   /'
else
    say "  nvidia-smi: not found"
fi

missing=$(timeout -k 5 60 "$py" -c '
import importlib.util as u
print(" ".join(m for m in ("numpy", "pytest", "typing_extensions") if u.find_spec(m) is None))
' 2>&1)
if [ -n "$missing" ]; then
    say "FAIL: $py lacks $missing (this script installs nothing)"
    exit 1
fi

reason=$(timeout -k 5 60 "$py" -c '
from pb_tensor import cuda
print(cuda.unavailable_reason() or "")
' 2>&1)
status=$?
if [ $status -ne 0 ]; then
    say "FAIL: probing CUDA through pb_tensor failed: $reason"
    exit 1
fi
if [ -n "$reason" ]; then
    say "no GPU: $reason"
    say "running the gpu-marked tests anyway: they must all skip"
else
    say "CUDA device(s) found: running the GPU tests"
fi

# The tests: at most the budget minus a reserve for the benchmark.
test_limit=$(($(left) - 75))
[ $test_limit -gt 240 ] && test_limit=240
say "pytest (limit ${test_limit}s)"
timeout -k 10 "$test_limit" "$py" -m pytest -m gpu -p no:cacheprovider -q -ra \
    tests/test_cuda_gpu.py tests/test_tensor_gpu.py tests/test_pickle.py tests/test_exchange_api.py \
    tests/test_runtime_gpu.py
tests_status=$?
case $tests_status in
    0) tests_result="PASS${reason:+ (all skipped: no GPU)}" ;;
    124 | 137) tests_result="FAIL (timed out after ${test_limit}s)" ;;
    *) tests_result="FAIL (pytest exit $tests_status)" ;;
esac

if [ -n "$reason" ]; then
    bench_result="skipped (no GPU)"
    bench_status=0
else
    bench_limit=$(($(left) - 5))
    if [ $bench_limit -lt 20 ]; then
        bench_result="skipped (budget spent)"
        bench_status=1
    else
        say "benchmark (limit ${bench_limit}s)"
        timeout -k 5 "$bench_limit" "$py" benchmarks/bench_gpu.py --quick
        bench_status=$?
        case $bench_status in
            0) bench_result="done" ;;
            124 | 137) bench_result="FAIL (timed out after ${bench_limit}s)" ;;
            *) bench_result="FAIL (exit $bench_status)" ;;
        esac
    fi
fi

say "tests: $tests_result; benchmark: $bench_result; $((SECONDS - start))s"
[ -n "$reason" ] && say "no GPU here: nothing GPU-specific was checked"
[ $tests_status -eq 0 ] && [ $bench_status -eq 0 ]
