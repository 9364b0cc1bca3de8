"""What ``import pb_tensor`` and the first Tensor cost on top of ``import numpy``, from fresh
interpreters.

Run it as a script (``python benchmarks/bench_import.py [--quick]``); it is not a test. Each
round starts one fresh interpreter per statement; the interpreter times ``import numpy`` and
then the statement, so each figure is what the statement adds to a program that already
imported numpy. Figures are medians over the rounds, against the target of at most 10 ms for
``import pb_tensor`` and for the first use of a Tensor; the ``dlpack_ctypes`` rows are for
information.

Bytecode: an installed wheel has compiled bytecode for numpy and for this package, so the main
figures are measured with bytecode caches for every module (written to a temporary cache
directory by a warm-up run, numpy's included, so both sides are measured alike). A source
checkout that cannot write bytecode (``PYTHONDONTWRITEBYTECODE``) compiles this package's
modules on every start; that figure is printed too, while no ``__pycache__`` sits next to the
sources. Finally, one ``-X importtime`` run lists the modules the first Tensor adds and their
self times.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_MS = 10.0

FIRST_TENSOR = 'from pb_tensor import Tensor; Tensor("x", numpy.zeros(3, numpy.float32))'
FIRST_FROM_DLPACK = "import dlpack_ctypes; dlpack_ctypes.from_dlpack(numpy.zeros(3, numpy.float32))"
# (label, statement, checked against the target)
CASES: tuple[tuple[str, str, bool], ...] = (
    ("import pb_tensor", "import pb_tensor", True),
    ("first Tensor", FIRST_TENSOR, True),
    ("import dlpack_ctypes", "import dlpack_ctypes", False),
    ("first dlpack_ctypes.from_dlpack", FIRST_FROM_DLPACK, False),
)

_CHILD = """
import time
t0 = time.perf_counter()
import numpy
t1 = time.perf_counter()
{statement}
t2 = time.perf_counter()
print((t1 - t0) * 1e3, (t2 - t1) * 1e3)
"""


def _env(cache_dir: str | None) -> dict[str, str]:
    """The children's environment: bytecode cached in ``cache_dir``, or never written."""
    env = dict(os.environ)
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if cache_dir is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env["PYTHONPYCACHEPREFIX"] = cache_dir
    return env


def _run(statement: str, env: dict[str, str]) -> tuple[float, float]:
    """(ms for ``import numpy``, ms for ``statement`` after it) in one fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(statement=statement)],
                          capture_output=True, text=True, check=True, env=env)
    numpy_ms, statement_ms = proc.stdout.split()
    return float(numpy_ms), float(statement_ms)


def _importtime(statement: str, env: dict[str, str]) -> dict[str, int]:
    """{module: self us} of the modules ``statement`` imports after numpy."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import numpy\n{statement}"],
                          capture_output=True, text=True, check=True, env=env)
    times: dict[str, int] = {}
    after_numpy = False
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _cumulative, name = line.split(":", 1)[1].split("|")
        if after_numpy:
            times[name.strip()] = int(self_us)
        elif name.strip() == "numpy":
            after_numpy = True
    return times


def _our_bytecode_exists() -> bool:
    for package in ("pb_tensor", "dlpack_ctypes"):
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            continue
        if Path(importlib.util.cache_from_source(spec.origin)).exists():
            return True
    return False


def _measure(rounds: int, env: dict[str, str], label: str) -> tuple[list[float], list[list[float]]]:
    numpy_ms: list[float] = []
    case_ms: list[list[float]] = [[] for _ in CASES]
    for r in range(rounds):
        for i, (_name, statement, _checked) in enumerate(CASES):
            base, extra = _run(statement, env)
            numpy_ms.append(base)
            case_ms[i].append(extra)
        print(f"{label}: round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    return numpy_ms, case_ms


def _report(title: str, numpy_ms: list[float], case_ms: list[list[float]]) -> int:
    print(title)
    print(f"  {'import numpy (the baseline itself)':<36} {statistics.median(numpy_ms):7.1f} ms")
    met = 0
    for (name, _statement, checked), samples in zip(CASES, case_ms):
        median = statistics.median(samples)
        if checked:
            verdict = "PASS" if median <= TARGET_MS else "MISS"
            met += verdict == "PASS"
            note = f"target <= {TARGET_MS:.0f} ms: {verdict}"
        else:
            note = "(information)"
        print(f"  {name + ' adds':<36} {median:7.1f} ms   {note}")
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="7 rounds instead of 31")
    args = parser.parse_args()
    rounds = 7 if args.quick else 31
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {rounds} rounds; statements:")
    for name, statement, _checked in CASES:
        print(f"  {name:<32} {statement}")
    print()
    with tempfile.TemporaryDirectory(prefix="bench_import_pycache_") as cache_dir:
        cached = _env(cache_dir)
        for _name, statement, _checked in CASES:
            _run(statement, cached)  # warm-up: writes every module's bytecode
        numpy_ms, case_ms = _measure(rounds, cached, "bytecode cached")
        checked = sum(c for _n, _s, c in CASES)
        met = _report(
            f"with bytecode caches (as installed), median of {rounds} fresh interpreters:",
            numpy_ms, case_ms,
        )
        print(f"  {met}/{checked} targets met")
        print()
        if _our_bytecode_exists():
            print("from source without bytecode: not measured (a __pycache__ sits next to the "
                  "sources, so nothing would be compiled)")
        else:
            numpy_src, case_src = _measure(rounds, _env(None), "from source")
            _report(
                "from source, PYTHONDONTWRITEBYTECODE (our modules compiled at every start; "
                "numpy's installed bytecode used), for information:",
                numpy_src, case_src,
            )
        print()
        times = _importtime(FIRST_TENSOR, cached)
        own = [m for m in times if m.split(".")[0] in ("pb_tensor", "dlpack_ctypes")]
        other = [m for m in times if m not in own]
        print("the first Tensor imports, besides numpy: " + ", ".join(own))
        print("standard-library modules it adds: " + (", ".join(other) or "none"))
        print("their self times in one -X importtime run (which inflates them):")
        for name in sorted(times, key=lambda m: -times[m]):
            print(f"  {name:<32} {times[name] / 1000:6.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
