"""Benchmark dlpack_ctypes against numpy, PyTorch and the peer ctypes-dlpack.

Run from the repository root::

    python benchmarks/bench_dlpack.py            # full run (~60 s on 2 cores)
    python benchmarks/bench_dlpack.py --quick    # short run, fewer repeats

Method: each case is a ``timeit`` statement, calibrated with ``autorange`` (then scaled to about
``--target`` seconds per sample); all cases are sampled in interleaved rounds (``--repeat``,
at least 15 for a full run) so that machine noise hits them alike, and the table reports the
median per-call time in microseconds. A ratio (or difference) is the median over rounds of the
same-round ratio, so a burst of load in one round does not skew it; targets are checked against
them (PASS/MISS). gc is disabled while sampling (``timeit``'s default).
Every timed call drops what it made, so it includes the release (the DLPack deleter).

Targets (the rows of the performance issue that this package's paths own):
  (A) np.from_dlpack(BufferExporter), (2, 3) float32    <= 1.5x torch.from_dlpack(array)
  (B) dl.from_dlpack(torch_tensor).numpy()              <= 1.5x np.from_dlpack(torch_tensor)
  (C) legacy capsule import - versioned capsule import  <= 0.3 us (consume only: each capsule's
      own export cost is subtracted; numpy's and torch's legacy and versioned capsules)
  (D) 1 KB vs 1 GB: every path above within 10%
  (E) faster than ctypes-dlpack on the same operations
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
    a23 = np.arange(6, dtype=np.float32).reshape(2, 3)
    small = np.arange(256, dtype=np.float32).reshape(16, 16)  # 1 KB
    # 1 GiB, allocated once and never touched (no page is faulted in: sizes must not matter).
    big = np.empty((16384, 16384), dtype=np.float32)
    ns: dict[str, Any] = {
        "np": np,
        "dl": dl,
        "torch": torch,
        "a23": a23,
        "small": small,
        "big": big,
        "ex23": dl.BufferExporter.from_numpy(a23),
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
        Case("export_be", "np.from_dlpack(BufferExporter), (2, 3)  (A)",
             "np.from_dlpack(ex23)"),
        Case("export_be_1k", "np.from_dlpack(BufferExporter), 1 KB  (D)",
             "np.from_dlpack(ex_small)"),
        Case("export_be_1g", "np.from_dlpack(BufferExporter), 1 GB  (D)",
             "np.from_dlpack(ex_big)"),
        Case("export_wrap", "np.from_dlpack(to_dlpack wrapper), 1 KB  (D)",
             "np.from_dlpack(wrap_small)"),
        Case("export_wrap_1g", "np.from_dlpack(to_dlpack wrapper), 1 GB  (D)",
             "np.from_dlpack(wrap_big)"),
        Case("export_be_new", "np.from_dlpack(BufferExporter.from_numpy(a))",
             "np.from_dlpack(dl.BufferExporter.from_numpy(small))"),
        Case("export_wrap_new", "np.from_dlpack(ToDlpack(a))  [vs peer]",
             "np.from_dlpack(ToDlpack(small))"),
        Case("consume", "dl.from_dlpack(a).numpy(), 1 KB  (D)", "dl.from_dlpack(small).numpy()"),
        Case("consume_1g", "dl.from_dlpack(a).numpy(), 1 GB  (D)", "dl.from_dlpack(big).numpy()"),
        Case("consume_capsule", "dl.consume(a.__dlpack__(max_version=(1,3)))  [vs peer]",
             "dl.consume(small.__dlpack__(max_version=V13))"),
        # (C): numpy's legacy and versioned capsules, export alone and export + consume.
        Case("np_leg_export", "  numpy legacy capsule: a.__dlpack__(), dropped",
             "small.__dlpack__()"),
        Case("np_leg_consume", "  numpy legacy capsule: dl.consume(a.__dlpack__())",
             "dl.consume(small.__dlpack__())"),
        Case("np_leg_consume_1g", "  numpy legacy capsule, 1 GB: dl.consume(a.__dlpack__())  (D)",
             "dl.consume(big.__dlpack__())"),
        Case("np_ver_export", "  numpy versioned capsule: a.__dlpack__(max_version=(1,3))",
             "small.__dlpack__(max_version=V13)"),
        Case("np_ver_consume", "  numpy versioned capsule: dl.consume(...)",
             "dl.consume(small.__dlpack__(max_version=V13))"),
        # Breakdown of the consume path.
        Case("b_from_dlpack", "  breakdown: dl.from_dlpack(a), dropped", "dl.from_dlpack(small)"),
        Case("b_from_dlpack_keep", "  breakdown: dl.from_dlpack(a) (release not timed)",
             "keep.append(dl.from_dlpack(small))"),
    ]
    if torch is not None:
        tt23 = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        tt_small = torch.arange(256, dtype=torch.float32).reshape(16, 16)
        tt_big = torch.empty((16384, 16384), dtype=torch.float32)  # never touched either
        ns.update(tt23=tt23, tt_small=tt_small, tt_big=tt_big)
        cases[:0] = [
            Case("torch", "torch.from_dlpack(a), (2, 3)  [baseline A]", "torch.from_dlpack(a23)"),
            Case("np_torch", "np.from_dlpack(torch_tensor), (2, 3)  [baseline B]",
                 "np.from_dlpack(tt23)"),
            Case("consume_torch", "dl.from_dlpack(torch_tensor).numpy(), (2, 3)  (B)",
                 "dl.from_dlpack(tt23).numpy()"),
            Case("consume_torch_1k", "dl.from_dlpack(torch_tensor).numpy(), 1 KB  (D)",
                 "dl.from_dlpack(tt_small).numpy()"),
            Case("consume_torch_1g", "dl.from_dlpack(torch_tensor).numpy(), 1 GB  (D)",
                 "dl.from_dlpack(tt_big).numpy()"),
        ]
        cases += [
            Case("torch_1g", "torch.from_dlpack(a), 1 GB  [reference]", "torch.from_dlpack(big)"),
            Case("t_leg_export", "  torch legacy capsule: t.__dlpack__(), dropped",
                 "tt_small.__dlpack__()"),
            Case("t_leg_consume", "  torch legacy capsule: dl.consume(t.__dlpack__())",
                 "dl.consume(tt_small.__dlpack__())"),
            Case("t_ver_export", "  torch versioned capsule: t.__dlpack__(max_version=(1,3))",
                 "tt_small.__dlpack__(max_version=V13)"),
            Case("t_ver_consume", "  torch versioned capsule: dl.consume(...)",
                 "dl.consume(tt_small.__dlpack__(max_version=V13))"),
        ]
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
    tty = sys.stdout.isatty()

    def progress(round_: int) -> None:
        if tty:  # a redirected run gets no carriage-return noise
            print(f"\rround {round_ + 1}/{repeat}", end="", flush=True)

    sample(cases, repeat, progress)
    if tty:
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
    print("targets (medians of same-round ratios):")
    checks: list[tuple[str, str, str, bool]] = []

    def paired(num: str, den: str) -> float:
        # The median over rounds of the same-round ratio: a burst of load in one round hits
        # both cases of that round alike, so this is steadier than a ratio of medians.
        return statistics.median(
            a / b for a, b in zip(by_key[num].samples, by_key[den].samples)
        )

    def ratio(num: str, den: str, goal: float, name: str) -> None:
        r = paired(num, den)
        checks.append((name, f"{r:6.2f}x", f"<= {goal:.2f}x", r <= goal))

    def same_size(small_key: str, big_key: str) -> None:
        r = paired(big_key, small_key)
        label = by_key[small_key].label.split(",")[0].split("  ")[0]
        checks.append((f"(D) {label}: 1 GB / 1 KB", f"{r:6.2f}x", "0.90-1.10x",
                       0.9 <= r <= 1.1))

    if "torch" in med:
        ratio("export_be", "torch", 1.5,
              "(A) np.from_dlpack(BufferExporter) / torch.from_dlpack(array)")
        ratio("consume_torch", "np_torch", 1.5,
              "(B) dl.from_dlpack(torch_tensor).numpy() / np.from_dlpack(torch_tensor)")
    legacy = {"numpy": ("np_leg_export", "np_leg_consume", "np_ver_export", "np_ver_consume"),
              "torch": ("t_leg_export", "t_leg_consume", "t_ver_export", "t_ver_consume")}
    for producer, (le, lc, ve, vc) in legacy.items():
        if lc in med:
            rounds = zip(*(by_key[k].samples for k in (le, lc, ve, vc)))
            extra = statistics.median((c1 - e1) - (c2 - e2) for e1, c1, e2, c2 in rounds)
            checks.append((f"(C) {producer}: legacy - versioned capsule import",
                           f"{extra:6.3f} us", "<= 0.300 us", extra <= 0.3))
    same_size("export_be_1k", "export_be_1g")
    same_size("export_wrap", "export_wrap_1g")
    same_size("consume", "consume_1g")
    if "consume_torch_1g" in med:
        same_size("consume_torch_1k", "consume_torch_1g")
    r = paired("np_leg_consume_1g", "np_leg_consume")
    checks.append(("(D) dl.consume(legacy capsule): 1 GB / 1 KB", f"{r:6.2f}x", "0.90-1.10x",
                   0.9 <= r <= 1.1))
    if "peer_export" in med:
        for ours, peer in (("export_wrap_new", "peer_export"), ("export_be_new", "peer_export"),
                           ("consume_capsule", "peer_consume")):
            ratio(ours, peer, 0.999,
                  f"(E) {by_key[ours].label.split('  ')[0]} / ctypes-dlpack")
    cw = max(len(c[0]) for c in checks)
    for name, value, goal, ok in checks:
        print(f"  {name:<{cw}}  {value:>10}  (target {goal:>11})  {verdict(ok)}")
    if "torch" not in med:
        print("  torch not installed: targets (A) and (B) not checked")
    if ctypes_dlpack is None:
        print("  ctypes-dlpack not installed: target (E) not checked")
    met = sum(c[3] for c in checks)
    print(f"  {met}/{len(checks)} targets met")

    print()
    print("consume path, derived from the breakdown rows (differences of medians):")
    consume_only = med["b_from_dlpack_keep"] - med["np_ver_export"]
    release = med["b_from_dlpack"] - med["b_from_dlpack_keep"]
    numpy_view = med["consume"] - med["b_from_dlpack"]
    print(f"  numpy's own export (a.__dlpack__)        {med['np_ver_export']:6.3f} us")
    print(f"  from_dlpack + consume (ours)             {consume_only:6.3f} us")
    print(f"  release: numpy's deleter (ctypes call)   {release:6.3f} us")
    print(f"  .numpy(): __array_interface__ + asarray  {numpy_view:6.3f} us")
    dl.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
