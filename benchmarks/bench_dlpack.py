"""Benchmark dlpack_ctypes against numpy, PyTorch and the peer ctypes-dlpack.

Run from the repository root::

    python benchmarks/bench_dlpack.py            # full run (~30 s on 2 cores)
    python benchmarks/bench_dlpack.py --quick    # short run, fewer repeats

Method: each case is a ``timeit`` statement, calibrated with ``autorange`` (then scaled to about
``--target`` seconds per sample); all cases are sampled in interleaved rounds (``--repeat``,
at least 15 for a full run) so that machine noise hits them alike, and the table reports the
median per-call time in microseconds. Ratios are of medians measured in this same run; targets
are checked against them (PASS/MISS). gc is disabled while sampling (``timeit``'s default).

Targets:
  (1) np.from_dlpack(exporter) through dlpack_ctypes <= 2.5x torch.from_dlpack(a)
  (2) dlpack_ctypes.from_dlpack(a).numpy()           <= 2.5x torch.from_dlpack(a)
  (3) 1 KB vs 1 GB array: (1) and (2) within 10%
  (4) faster than ctypes-dlpack on the same operations
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import sys
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dlpack_ctypes as dl


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


torch: Any = _optional("torch")
# The peer sets argtypes/restype on ctypes.pythonapi's shared prototypes when imported;
# dlpack_ctypes uses private prototypes, so it is unaffected.
ctypes_dlpack: Any = _optional("ctypes_dlpack")


class ToDlpack:
    """The thinnest producer over dlpack_ctypes: ``__dlpack__`` forwards to ``to_dlpack``."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        return dl.to_dlpack(
            self.array, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy
        )

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def peer_release(pointer: Any) -> None:
    """Release a ctypes-dlpack pointer (what its users must do by hand)."""
    managed = pointer.contents
    if managed.deleter:
        managed.deleter(pointer)


@dataclass
class Case:
    key: str
    label: str
    stmt: str
    timer: timeit.Timer | None = None
    number: int = 0
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def make_cases() -> tuple[list[Case], dict[str, Any]]:
    small = np.arange(256, dtype=np.float32).reshape(16, 16)  # 1 KB
    # 1 GiB, allocated once and never touched (no page is faulted in: sizes must not matter).
    big = np.empty((16384, 16384), dtype=np.float32)
    ns: dict[str, Any] = {
        "np": np,
        "dl": dl,
        "torch": torch,
        "small": small,
        "big": big,
        "ex_small": dl.BufferExporter.from_numpy(small),
        "ex_big": dl.BufferExporter.from_numpy(big),
        "wrap_small": ToDlpack(small),
        "wrap_big": ToDlpack(big),
        "ToDlpack": ToDlpack,
        "cd": ctypes_dlpack,
        "peer_release": peer_release,
        "V13": (1, 3),
    }
    cases = [
        Case("numpy", "np.from_dlpack(a)  [numpy, reference]", "np.from_dlpack(small)"),
        Case("export_be", "np.from_dlpack(BufferExporter)  (1)", "np.from_dlpack(ex_small)"),
        Case("export_wrap", "np.from_dlpack(to_dlpack wrapper)  (1)",
             "np.from_dlpack(wrap_small)"),
        Case("export_be_new", "np.from_dlpack(BufferExporter.from_numpy(a))",
             "np.from_dlpack(dl.BufferExporter.from_numpy(small))"),
        Case("export_wrap_new", "np.from_dlpack(ToDlpack(a))  [vs peer]",
             "np.from_dlpack(ToDlpack(small))"),
        Case("consume", "dl.from_dlpack(a).numpy()  (2)", "dl.from_dlpack(small).numpy()"),
        Case("consume_capsule", "dl.consume(a.__dlpack__(max_version=(1,3)))  [vs peer]",
             "dl.consume(small.__dlpack__(max_version=V13))"),
        Case("export_be_1g", "np.from_dlpack(BufferExporter), 1 GB  (3)",
             "np.from_dlpack(ex_big)"),
        Case("export_wrap_1g", "np.from_dlpack(to_dlpack wrapper), 1 GB  (3)",
             "np.from_dlpack(wrap_big)"),
        Case("consume_1g", "dl.from_dlpack(a).numpy(), 1 GB  (3)", "dl.from_dlpack(big).numpy()"),
        # Breakdown of the consume path (2).
        Case("b_np_export", "  breakdown: a.__dlpack__(max_version=(1,3)), dropped",
             "small.__dlpack__(max_version=V13)"),
        Case("b_from_dlpack", "  breakdown: dl.from_dlpack(a), dropped", "dl.from_dlpack(small)"),
        Case("b_from_dlpack_keep", "  breakdown: dl.from_dlpack(a) (release not timed)",
             "keep.append(dl.from_dlpack(small))"),
    ]
    if torch is not None:
        cases.insert(0, Case("torch", "torch.from_dlpack(a)  [baseline]",
                             "torch.from_dlpack(small)"))
        cases.append(Case("torch_1g", "torch.from_dlpack(a), 1 GB  [reference]",
                          "torch.from_dlpack(big)"))
    if ctypes_dlpack is not None:
        cases += [
            Case("peer_export", "ctypes-dlpack: np.from_dlpack(DLPackArray(array_as_dlpack(a)))",
                 "np.from_dlpack(cd.DLPackArray(cd.array_as_dlpack(small, max_version=V13)))"),
            Case("peer_consume", "ctypes-dlpack: array_as_dlpack(a) + deleter",
                 "peer_release(cd.array_as_dlpack(small, max_version=V13))"),
        ]
    return cases, ns


def calibrate(case: Case, ns: dict[str, Any], target: float) -> None:
    setup = "keep = []" if "keep" in case.stmt else "pass"
    case.timer = timeit.Timer(case.stmt, setup=setup, globals=ns)
    number, elapsed = case.timer.autorange()  # >= 0.2 s
    case.number = max(1, int(number * target / max(elapsed, 1e-9)))


def sample(cases: list[Case], repeat: int, progress: Callable[[int], None]) -> None:
    for round_ in range(repeat):
        for case in cases:
            assert case.timer is not None
            case.samples.append(case.timer.timeit(case.number) / case.number * 1e6)
        dl.flush()
        gc.collect()
        progress(round_)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (5 rounds, 20 ms)")
    parser.add_argument("--repeat", type=int, default=None, help="rounds (default 21; quick 5)")
    parser.add_argument("--target", type=float, default=None,
                        help="seconds per sample (default 0.05; quick 0.01)")
    args = parser.parse_args(argv)
    repeat = args.repeat or (5 if args.quick else 21)
    target = args.target or (0.01 if args.quick else 0.05)
    if not args.quick and repeat < 15:
        parser.error("a full run needs --repeat >= 15 (use --quick for a short run)")

    cases, ns = make_cases()
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, "
          f"torch {getattr(torch, '__version__', 'not installed')}, "
          f"ctypes-dlpack {getattr(ctypes_dlpack, '__version__', 'not installed')}, "
          f"dlpack_ctypes {dl.__version__}")
    print(f"{len(cases)} cases, {repeat} interleaved rounds, ~{target * 1e3:.0f} ms per sample")
    for case in cases:
        calibrate(case, ns, target)
    sample(cases, repeat, lambda r: print(f"\rround {r + 1}/{repeat}", end="", flush=True))
    print()
    ns["keep"] = None
    by_key = {c.key: c for c in cases}
    med = {c.key: c.median for c in cases}

    base = med.get("torch")
    width = max(len(c.label) for c in cases)
    print()
    print(f"{'case':<{width}}  {'median us':>9}  {'min us':>8}  {'x torch':>7}  {'calls':>8}")
    print("-" * (width + 42))
    for case in cases:
        x_torch = f"{case.median / base:7.2f}" if base else "      -"
        print(f"{case.label:<{width}}  {case.median:9.3f}  {min(case.samples):8.3f}  {x_torch}  "
              f"{case.number:8d}")

    print()
    print("targets (same-run ratios of medians):")
    checks: list[tuple[str, float, str, bool]] = []
    if base:
        for key in ("export_be", "export_wrap", "consume"):
            r = med[key] / base
            checks.append((f"{by_key[key].label.split('  ')[0]} / torch.from_dlpack(a)", r,
                           "<= 2.50", r <= 2.5))
    for small_key, big_key in (("export_be", "export_be_1g"), ("export_wrap", "export_wrap_1g"),
                               ("consume", "consume_1g")):
        r = med[big_key] / med[small_key]
        checks.append((f"{by_key[small_key].label.split('  ')[0]}: 1 GB / 1 KB", r,
                       "0.90-1.10", 0.9 <= r <= 1.1))
    if "peer_export" in med:
        for ours, peer in (("export_wrap_new", "peer_export"), ("export_be_new", "peer_export"),
                           ("consume_capsule", "peer_consume")):
            r = med[ours] / med[peer]
            checks.append((f"{by_key[ours].label.split('  ')[0]} / ctypes-dlpack", r, "< 1.00",
                           r < 1.0))
    cw = max(len(c[0]) for c in checks)
    for name, ratio, goal, ok in checks:
        print(f"  {name:<{cw}}  {ratio:6.2f}  (target {goal})  {verdict(ok)}")
    if base is None:
        print("  torch not installed: targets (1) and (2) not checked")
    if ctypes_dlpack is None:
        print("  ctypes-dlpack not installed: target (4) not checked")

    print()
    print("consume path (2), derived from the breakdown rows (differences of medians):")
    consume_only = med["b_from_dlpack_keep"] - med["b_np_export"]
    release = med["b_from_dlpack"] - med["b_from_dlpack_keep"]
    numpy_view = med["consume"] - med["b_from_dlpack"]
    print(f"  numpy's own export (a.__dlpack__)        {med['b_np_export']:6.3f} us")
    print(f"  from_dlpack + consume (ours)             {consume_only:6.3f} us")
    print(f"  release: numpy's deleter (ctypes call)   {release:6.3f} us")
    print(f"  .numpy(): __array_interface__ + asarray  {numpy_view:6.3f} us")
    dl.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
