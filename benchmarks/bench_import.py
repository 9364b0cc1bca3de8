"""What ``import pb_tensor`` costs on top of ``import numpy``, from fresh interpreters.

Run it as a script (``python benchmarks/bench_import.py [--quick]``); it is not a test. Each
round starts two interpreters with ``-X importtime``: one importing numpy alone, one importing
pb_tensor (which imports numpy). The figure is the difference of the medians of the cumulative
import times, against the target of at most 10 ms. It also lists the standard-library modules
pb_tensor adds and its own modules' self times.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

TARGET_MS = 10.0


def _importtime(statement: str) -> dict[str, tuple[int, int]]:
    """{module: (self us, cumulative us)} for one fresh interpreter running ``statement``."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", statement],
                          capture_output=True, text=True, check=True)
    times: dict[str, tuple[int, int]] = {}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cumulative_us, name = line.split(":", 1)[1].split("|")
        times[name.strip()] = (int(self_us), int(cumulative_us))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="7 rounds instead of 31")
    args = parser.parse_args()
    rounds = 7 if args.quick else 31
    numpy_ms: list[float] = []
    ours_ms: list[float] = []
    last: dict[str, tuple[int, int]] = {}
    baseline: dict[str, tuple[int, int]] = {}
    for r in range(rounds):
        baseline = _importtime("import numpy")
        last = _importtime("import pb_tensor")
        numpy_ms.append(baseline["numpy"][1] / 1000)
        ours_ms.append(last["pb_tensor"][1] / 1000)
        print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    numpy_median = statistics.median(numpy_ms)
    ours_median = statistics.median(ours_ms)
    extra = ours_median - numpy_median
    print(f"import numpy      {numpy_median:7.1f} ms (median of {rounds} fresh interpreters)")
    print(f"import pb_tensor  {ours_median:7.1f} ms")
    verdict = "PASS" if extra <= TARGET_MS else "MISS"
    print(f"pb_tensor adds    {extra:7.1f} ms   target <= {TARGET_MS:.0f} ms: {verdict}")
    added = sorted(set(last) - set(baseline))
    own = [m for m in added if m.split(".")[0] in ("pb_tensor", "dlpack_ctypes")]
    stdlib = [m for m in added if m not in own]
    print("modules added besides our own: " + (", ".join(stdlib) or "none"))
    print("our modules' self time (last round):")
    for name in sorted(own, key=lambda m: -last[m][0]):
        print(f"  {name:<28} {last[name][0] / 1000:6.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
