"""Benchmark pb_tensor.Tensor's per-exchange cost against numpy, PyTorch and JAX.

Run from the repository root::

    python benchmarks/bench_tensor.py             # full run (~30 s on 2 cores)
    python benchmarks/bench_tensor.py --quick     # short run
    python benchmarks/bench_tensor.py --breakdown # also time the stages of Tensor.from_dlpack

Everything uses a small (2, 3) float32 array on a 64-byte boundary (so that JAX can share it).

Method: each case is a callable timed with ``timeit`` (gc disabled, its default), calibrated
once to about ``--target`` seconds per sample; all cases are sampled in interleaved rounds so
that machine noise hits them alike. The table gives the median per-call time in microseconds;
a ratio is the median over rounds of (case / baseline) measured in the same round, so a burst of
load in one round does not skew it. Results are dropped inside the timed call, so each time
includes releasing what the call made (the DLPack deleter, for imports).

Targets (PASS/MISS; PyTorch provides the baseline, without it they are not judged):
  (1) np.from_dlpack(tensor)          <= 1.5x torch.from_dlpack(array)
  (2) Tensor.from_dlpack("x", array)  <= 2.5x torch.from_dlpack(array)
Reported: Tensor("x", array) against torch.from_numpy(array); torch.from_dlpack(tensor) and
jnp.from_dlpack(tensor) against their import of the array itself; BYTES tensors built from object
arrays (serialise) and loaded from shared memory (deserialise) against a plain-Python loop of the
wire format (the codec's own benchmark is benchmarks/bench_bytes.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import struct
import sys
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dlpack_ctypes as dl
from pb_tensor import Tensor
from pb_tensor._tensor_import import check_importable


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


torch: Any = _optional("torch")
jax: Any = _optional("jax")
jnp: Any = _optional("jax.numpy") if jax is not None else None


def aligned(shape: tuple[int, ...], dtype: Any, alignment: int = 64) -> np.ndarray[Any, Any]:
    """A C-contiguous zeroed array whose data starts on an ``alignment``-byte boundary."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dt.itemsize
    raw = np.zeros(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dt).reshape(shape)


@dataclass
class Case:
    """One timed statement; ``baseline`` names the case its ratio is taken against."""

    name: str
    fn: Callable[[], object]
    baseline: str | None = None
    target: float | None = None
    low: float | None = None  # with target: the ratio must lie in [low, target]
    note: str = ""
    number: int = 1
    samples: list[float] = field(default_factory=list)  # us per call, one per round
    keep: object = None  # kept alive while the case runs

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def _calibrate(case: Case, target: float) -> None:
    timer = timeit.Timer(case.fn)
    number, elapsed = timer.autorange()  # >= 0.2 s
    case.number = max(1, int(number * target / max(elapsed, 1e-9)))


def _sample(cases: list[Case], rounds: int) -> None:
    for _ in range(rounds):
        for case in cases:
            elapsed = timeit.Timer(case.fn).timeit(case.number)
            case.samples.append(elapsed / case.number * 1e6)


def _ratio(case: Case, by_name: dict[str, Case]) -> float | None:
    if case.baseline is None or case.baseline not in by_name:
        return None
    base = by_name[case.baseline]
    return statistics.median(c / b for c, b in zip(case.samples, base.samples))


# ------------------------------------------------------------------------------------- cases


def _shares(a: object, b: np.ndarray[Any, Any]) -> str:
    return "zero-copy" if a == b.ctypes.data else "COPIED"


def numeric_cases() -> tuple[list[Case], list[str]]:
    """The (2, 3) float32 cases, and notes on zero copy checked before timing."""
    a = aligned((2, 3), np.float32)
    a[...] = np.arange(6).reshape(2, 3)
    t = Tensor("x", a)
    checks = [
        f"np.from_dlpack(tensor): {_shares(np.from_dlpack(t).ctypes.data, a)}",
        "Tensor.from_dlpack('x', array): "
        f"{_shares(Tensor.from_dlpack('x', a).data_ptr, a)}",
    ]
    cases = [
        Case("np.from_dlpack(array)", lambda: np.from_dlpack(a), note="numpy alone: the floor"),
        Case("np.from_dlpack(tensor)", lambda: np.from_dlpack(t), "torch.from_dlpack(array)",
             0.8),
        Case("Tensor.from_dlpack('x', array)", lambda: Tensor.from_dlpack("x", a),
             "torch.from_dlpack(array)", 2.5),
        Case("Tensor('x', array)", lambda: Tensor("x", a), "torch.from_numpy(array)"),
        Case("Tensor.from_dlpack('x', tensor)", lambda: Tensor.from_dlpack("x", t),
             "torch.from_dlpack(array)"),
    ]
    # Size independence: the same paths over 1 KB and over 1 GB that is never touched.
    kb = aligned((16, 16), np.float32)
    gb = np.empty((16384, 16384), dtype=np.float32)
    t_kb, t_gb = Tensor("x", kb), Tensor("x", gb)
    cases += [
        Case("np.from_dlpack(tensor), 1 KB", lambda: np.from_dlpack(t_kb)),
        Case("np.from_dlpack(tensor), 1 GB", lambda: np.from_dlpack(t_gb),
             "np.from_dlpack(tensor), 1 KB", 1.1, low=0.9),
    ]
    if torch is not None:
        tt = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        tt_kb = torch.zeros((16, 16), dtype=torch.float32)
        tt_gb = torch.empty((16384, 16384), dtype=torch.float32)
        shared = Tensor.from_dlpack("x", tt).data_ptr == tt.data_ptr()
        checks.append("Tensor.from_dlpack('x', torch_tensor): "
                      + ("zero-copy" if shared else "COPIED"))
        cases += [
            Case("np.from_dlpack(torch_tensor)", lambda: np.from_dlpack(tt), note="baseline (3)"),
            Case("Tensor.from_dlpack('x', torch_tensor)", lambda: Tensor.from_dlpack("x", tt),
                 "np.from_dlpack(torch_tensor)", 1.0),
            Case("Tensor.from_dlpack('x', torch_tensor), 1 KB",
                 lambda: Tensor.from_dlpack("x", tt_kb)),
            Case("Tensor.from_dlpack('x', torch_tensor), 1 GB",
                 lambda: Tensor.from_dlpack("x", tt_gb),
                 "Tensor.from_dlpack('x', torch_tensor), 1 KB", 1.1, low=0.9),
        ]
        checks.append(f"torch.from_dlpack(tensor): {_shares(torch.from_dlpack(t).data_ptr(), a)}")
        cases += [
            Case("torch.from_dlpack(array)", lambda: torch.from_dlpack(a),
                 note="baseline (1), (2)"),
            Case("torch.from_numpy(array)", lambda: torch.from_numpy(a), note="baseline"),
            Case("torch.from_dlpack(tensor)", lambda: torch.from_dlpack(t),
                 "torch.from_dlpack(array)"),
        ]
    if jnp is not None:
        ptr = jnp.from_dlpack(t).unsafe_buffer_pointer()
        checks.append(f"jnp.from_dlpack(tensor): {_shares(ptr, a)}")
        cases += [
            Case("jnp.from_dlpack(array)", lambda: jnp.from_dlpack(a), note="baseline"),
            Case("jnp.from_dlpack(tensor)", lambda: jnp.from_dlpack(t), "jnp.from_dlpack(array)"),
        ]
    return cases, checks


def _naive_serialize(items: list[bytes]) -> bytes:
    pack = struct.Struct("<I").pack
    return b"".join([pack(len(x)) + x for x in items])


def _naive_deserialize(wire: bytes) -> np.ndarray[Any, Any]:
    unpack = struct.Struct("<I").unpack_from
    out, off = [], 0
    while off < len(wire):
        (n,) = unpack(wire, off)
        out.append(wire[off + 4 : off + 4 + n])
        off += 4 + n
    return np.array(out, dtype=object)


def bytes_cases(pool: Any) -> list[Case]:
    cases: list[Case] = []
    for shape in ((2, 3), (1000,)):
        n = int(np.prod(shape))
        items = [f"item-{i}".encode() for i in range(n)]
        arr = np.empty(n, dtype=object)
        arr[:] = items
        arr = arr.reshape(shape)
        t = Tensor("s", arr)
        handle = t.save_to_shared_memory(pool)
        wire = _naive_serialize(items)
        label = f"BYTES {shape}"
        base_ser = f"{label} python loop: serialise"
        base_de = f"{label} python loop: deserialise"
        cases += [
            Case(base_ser, lambda items=items: _naive_serialize(items), note="baseline"),
            Case(f"{label} Tensor('s', object array)", lambda arr=arr: Tensor("s", arr),
                 base_ser),
            Case(base_de, lambda wire=wire: _naive_deserialize(wire), note="baseline"),
            # The saved tensor keeps its record alive: the case holds it.
            Case(f"{label} Tensor.load_from_shared_memory",
                 lambda h=handle: Tensor.load_from_shared_memory(pool, h), base_de, keep=t),
        ]
    return cases


# ------------------------------------------------------------------------------ breakdown


def breakdown(rounds: int, target: float) -> list[Case]:
    """Stages of Tensor.from_dlpack('x', array) and of the torch-tensor import, each including
    the release it causes."""
    a = aligned((2, 3), np.float32)
    check = check_importable
    cases = [
        Case("array.__dlpack__(max_version=(1, 3))", lambda: a.__dlpack__(max_version=(1, 3))),
        Case("dl.consume(capsule) + release",
             lambda: dl.consume(a.__dlpack__(max_version=(1, 3)))),
        Case("dl.from_dlpack(array)", lambda: dl.from_dlpack(a)),
        Case("dl.from_dlpack(array, check=Triton's)", lambda: dl.from_dlpack(a, check=check)),
        Case("Tensor.from_dlpack('x', array)", lambda: Tensor.from_dlpack("x", a)),
    ]
    if torch is not None:
        tt = torch.zeros((2, 3), dtype=torch.float32)
        cases += [
            Case("torch.from_dlpack(array)", lambda: torch.from_dlpack(a)),
            Case("torch_tensor.__dlpack_device__()", tt.__dlpack_device__),
            Case("torch_tensor.__dlpack__(max_version=(1, 3))",
                 lambda: tt.__dlpack__(max_version=(1, 3))),
            Case("np.from_dlpack(torch_tensor)", lambda: np.from_dlpack(tt)),
            Case("dl.from_dlpack(torch_tensor)", lambda: dl.from_dlpack(tt)),
            Case("Tensor.from_dlpack('x', torch_tensor)", lambda: Tensor.from_dlpack("x", tt)),
        ]
    for case in cases:
        _calibrate(case, target)
    _sample(cases, rounds)
    return cases


# ---------------------------------------------------------------------------------- report


def render(cases: list[Case]) -> tuple[str, int]:
    by_name = {c.name: c for c in cases}
    head = ("case", "median us", "vs", "ratio", "target", "result")
    rows: list[tuple[str, ...]] = []
    misses = 0
    for c in cases:
        ratio = _ratio(c, by_name)
        if c.target is None:
            result, target = (c.note, "")
        elif ratio is None:
            result, target = ("not judged (no baseline)", f"<= {c.target}x")
        elif c.low is not None:
            ok = c.low <= ratio <= c.target
            misses += not ok
            result, target = ("PASS" if ok else "MISS", f"{c.low}-{c.target}x")
        else:
            ok = ratio <= c.target
            misses += not ok
            result, target = ("PASS" if ok else "MISS", f"<= {c.target}x")
        vs = c.baseline if c.baseline in by_name else ""
        rows.append((c.name, f"{c.median:.3f}", vs or "", f"{ratio:.2f}x" if ratio else "",
                     target, result))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines), misses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter samples")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 15, quick 5)")
    parser.add_argument("--target", type=float, help="seconds per sample (default 0.02)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the stages of Tensor.from_dlpack")
    parser.add_argument("--no-bytes", action="store_true", help="skip the BYTES cases")
    args = parser.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else 15)
    target = args.target or (0.005 if args.quick else 0.02)

    import platform

    print(f"pb_tensor.Tensor benchmark: Python {platform.python_version()}, numpy "
          f"{np.__version__}, torch {getattr(torch, '__version__', 'not installed')}, jax "
          f"{getattr(jax, '__version__', 'not installed')}; {os.cpu_count()} CPUs; "
          f"{rounds} rounds x {target * 1e3:.0f} ms")
    cases, checks = numeric_cases()
    pool = None
    if not args.no_bytes:
        from pb_tensor.shm import SharedMemoryPool

        pool = SharedMemoryPool.create(1 << 20)
        cases += bytes_cases(pool)
    try:
        for case in cases:
            _calibrate(case, target)
        _sample(cases, rounds)
        table, misses = render(cases)
        print("\nzero copy (checked before timing): " + "; ".join(checks))
        print(f"\n(2, 3) float32 and BYTES tensors, median us per call (ratios: median of "
              f"same-round ratios)\n{table}")
        if args.breakdown:
            stages = breakdown(rounds, target)
            print("\nTensor.from_dlpack by stage, median us per call:")
            width = max(len(c.name) for c in stages)
            for c in stages:
                print(f"  {c.name:<{width}}  {c.median:8.3f}")
        judged = sum(1 for c in cases if c.target is not None and _ratio(c, {x.name: x for x in
                                                                                  cases}))
        print(f"\n{judged - misses}/{judged} targets met" if judged else
              "\ntargets not judged: install torch for the baseline")
    finally:
        cases.clear()
        dl.flush()
        if pool is not None:
            pool.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
