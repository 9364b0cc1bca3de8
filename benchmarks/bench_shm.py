"""Benchmark: tensors through pb_tensor's shared-memory pool versus the usual alternatives.

Run it as a script (``python benchmarks/bench_shm.py [--quick]``); it is not a test. All
baselines are measured in the same run:

* in-process: ``save_record`` against ``np.copyto`` of the same bytes into a warm buffer (the
  memcpy a save cannot avoid); ``load_record`` on its own, and with dropping the record.
* across processes, one transfer and an acknowledgement: the pool (save, send the handle,
  load in the child), pickle through a ``multiprocessing.Pipe``, and ``torch.multiprocessing``
  queues when torch is installed.

Targets (printed as PASS/MISS): saving 64 MiB reaches at least 0.7x the ``np.copyto``
bandwidth; loading is O(1): 64 MiB at most 2x the 4 KiB time, and at most 20 us at any size.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from pb_tensor.shm import SharedMemoryPool, load_record, release, save_record

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
SAVE_TARGET = 0.7  # save bandwidth / np.copyto bandwidth at 64 MiB
LOAD_RATIO_TARGET = 2.0  # load(64 MiB) / load(4 KiB)
LOAD_US_TARGET = 20.0  # microseconds, any size


def _reps(nbytes: int, quick: bool) -> int:
    reps = 20_000 if nbytes <= 4096 else 2_000 if nbytes <= 1 << 20 else 40
    return max(5, reps // 10) if quick else reps


def _median_ns(
    fn: Callable[[], object], reps: int, after: Callable[[Any], object] = lambda _: None
) -> float:
    """Median wall time of ``fn`` in ns, call by call after a warm-up; ``after`` gets each
    result outside the timed region (to release what ``fn`` made)."""
    for _ in range(min(reps, 10)):
        after(fn())
    samples = []
    clock = time.perf_counter_ns
    for _ in range(reps):
        start = clock()
        result = fn()
        samples.append(clock() - start)
        after(result)
        del result
    return statistics.median(samples)


def _save(pool: SharedMemoryPool, payload: np.ndarray) -> int:
    return save_record(
        pool, name="INPUT0", dtype=2, dims=payload.shape, memory_type=0, memory_type_id=0,
        payload=payload, byte_size=payload.nbytes,
    )  # fmt: skip


# ------------------------------------------------------------------------------ in-process
def bench_local(pool: SharedMemoryPool, quick: bool) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(0)
    for label, nbytes in SIZES.items():
        reps = _reps(nbytes, quick)
        src = rng.integers(0, 256, nbytes, dtype=np.uint8)
        dst = np.ones_like(src)  # warm pages, like the pool's
        copy_ns = _median_ns(lambda: np.copyto(dst, src), reps)  # noqa: B023

        save_ns = _median_ns(lambda: _save(pool, src), reps, lambda h: release(pool, h))  # noqa: B023
        h = _save(pool, src)
        load_ns = _median_ns(lambda: load_record(pool, h), reps)  # noqa: B023  (dropped untimed)

        def load_and_drop() -> None:
            load_record(pool, h)  # noqa: B023  (the record dies here, inside the timed call)

        cycle_ns = _median_ns(load_and_drop, reps)
        release(pool, h)
        results[label] = {
            "bytes": nbytes,
            "copyto_ns": copy_ns,
            "save_ns": save_ns,
            "load_ns": load_ns,
            "load_drop_ns": cycle_ns,
        }
    return results


# --------------------------------------------------------------------------- cross-process
def _pool_child(name: str, conn: Any) -> None:
    with SharedMemoryPool.attach(name) as pool:
        while (handle := conn.recv()) is not None:
            record = load_record(pool, handle)
            conn.send(record.byte_size)
            del record


def _pipe_child(conn: Any) -> None:
    while (array := conn.recv()) is not None:
        conn.send(array.nbytes)


def _torch_child(tensors: Any, conn: Any) -> None:
    while (tensor := tensors.get()) is not None:
        conn.send(tensor.numel())
        del tensor


def _transfers(
    ctx: Any,
    child: Callable[..., None],
    args: tuple[Any, ...],
    send: Callable[[Any, np.ndarray], object],
    stop: Callable[[Any], None],
    payloads: dict[str, np.ndarray],
    quick: bool,
) -> dict[str, float]:
    """Median time per size for: ``send`` a payload, wait for the child's acknowledgement."""
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=child, args=(*args, theirs))
    proc.start()
    times = {}
    try:
        for label, payload in payloads.items():

            def once() -> None:
                send(ours, payload)  # noqa: B023
                ours.recv()

            times[label] = _median_ns(once, max(5, _reps(payload.nbytes, quick) // 20))
    finally:
        stop(ours)
        proc.join(60)
    return times


def bench_transfer(pool: SharedMemoryPool, quick: bool) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(1)
    payloads = {label: rng.integers(0, 256, n, dtype=np.uint8) for label, n in SIZES.items()}
    ctx = mp.get_context("spawn")
    sent: list[int] = []

    def send_handle(conn: Any, payload: np.ndarray) -> None:
        # The saver's reference goes once the child has acknowledged (its load holds one).
        while sent:
            release(pool, sent.pop())
        sent.append(_save(pool, payload))
        conn.send(sent[-1])

    methods = {
        "pb_tensor pool": _transfers(
            ctx, _pool_child, (pool.name,), send_handle, lambda c: c.send(None), payloads, quick
        ),
        "pickle + Pipe": _transfers(
            ctx, _pipe_child, (), lambda c, p: c.send(p), lambda c: c.send(None), payloads, quick
        ),
    }
    while sent:
        release(pool, sent.pop())
    try:
        import torch
        import torch.multiprocessing as tmp
    except ImportError:
        print("torch not installed: no torch.multiprocessing baseline")
    else:
        tctx = tmp.get_context("spawn")
        queue = tctx.Queue()
        # A new tensor over the payload each time: torch moves its storage into shared memory
        # (one copy) when it is first sent, as it would for any freshly computed tensor.
        methods["torch.mp queue"] = _transfers(
            tctx, _torch_child, (queue,), lambda c, p: queue.put(torch.from_numpy(p)),
            lambda c: queue.put(None), payloads, quick,
        )  # fmt: skip
    return {label: {m: times[label] for m, times in methods.items()} for label in SIZES}


# ---------------------------------------------------------------------------------- report
def _fmt_time(ns: float) -> str:
    if ns < 10_000:
        return f"{ns / 1e3:8.2f} us"
    if ns < 10_000_000:
        return f"{ns / 1e6:8.3f} ms"
    return f"{ns / 1e6:8.1f} ms"


def _gbps(nbytes: int, ns: float) -> str:
    return f"{nbytes / ns:7.2f} GB/s"


def report(local: dict[str, dict[str, float]], transfer: dict[str, dict[str, float]]) -> bool:
    print("\nIn-process (median per call)")
    print(f"{'size':>7} | {'np.copyto':>22} | {'save_record':>22} | {'save/copyto':>11} | "
          f"{'load_record':>11} | {'load+drop':>11}")  # fmt: skip
    for label, r in local.items():
        n = int(r["bytes"])
        print(
            f"{label:>7} | {_fmt_time(r['copyto_ns'])} {_gbps(n, r['copyto_ns'])} | "
            f"{_fmt_time(r['save_ns'])} {_gbps(n, r['save_ns'])} | "
            f"{r['copyto_ns'] / r['save_ns']:10.2f}x | {_fmt_time(r['load_ns'])} | "
            f"{_fmt_time(r['load_drop_ns'])}"
        )
    order = ["pb_tensor pool", "pickle + Pipe", "torch.mp queue"]
    methods = [m for m in order if m in transfer["4 KiB"]]
    print("\nAcross processes: send one tensor, child receives it, acknowledges (median)")
    print(f"{'size':>7} | " + " | ".join(f"{m:>24}" for m in methods) + " | pool speed-up")
    for label, r in transfer.items():
        n = SIZES[label]
        cells = [f"{_fmt_time(r[m])} {_gbps(n, r[m]):>12}" for m in methods]
        others = [r[m] for m in methods if m != "pb_tensor pool"]
        speedup = f"{min(others) / r['pb_tensor pool']:.1f}x vs best other" if others else ""
        print(f"{label:>7} | " + " | ".join(f"{c:>24}" for c in cells) + f" | {speedup}")

    big, small = local["64 MiB"], local["4 KiB"]
    checks = [
        (
            f"save 64 MiB >= {SAVE_TARGET}x np.copyto bandwidth",
            big["copyto_ns"] / big["save_ns"],
            big["copyto_ns"] / big["save_ns"] >= SAVE_TARGET,
        ),
        (
            f"load 64 MiB <= {LOAD_RATIO_TARGET}x load 4 KiB",
            big["load_ns"] / small["load_ns"],
            big["load_ns"] / small["load_ns"] <= LOAD_RATIO_TARGET,
        ),
    ]
    for label, r in local.items():
        us = r["load_ns"] / 1e3
        checks.append((f"load {label} <= {LOAD_US_TARGET:.0f} us", us, us <= LOAD_US_TARGET))
    print("\nTargets")
    for text, value, ok in checks:
        print(f"  {'PASS' if ok else 'MISS'}  {text:<40} measured {value:.2f}")
    return all(ok for _, _, ok in checks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    print(f"Python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs")
    with SharedMemoryPool.create(160 << 20, growth=16 << 20) as pool:
        local = bench_local(pool, args.quick)
        transfer = bench_transfer(pool, args.quick)
    return 0 if report(local, transfer) else 1


if __name__ == "__main__":
    raise SystemExit(main())
