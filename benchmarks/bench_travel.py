"""Benchmark: Tensors across processes and machines (pickle protocol 5, Ray, multiprocessing).

Run it as a script (``python benchmarks/bench_travel.py [--quick]``); it is not a test. All
baselines are measured in the same run, on the same bytes:

* pickle protocol 5 with out-of-band buffers (``dumps(buffer_callback=...)`` then
  ``loads(buffers=...)``, what Ray and Dask do): a ``pb_tensor.Tensor`` against the numpy array
  it wraps and a torch tensor over the same memory, at 4 KiB and 64 MiB;
* Ray (when installed; a local instance with one CPU): ``ray.put`` and ``ray.get`` of the same
  three objects, default settings;
* multiprocessing, one tensor to a child and an acknowledgement back: pickling it through a
  ``multiprocessing.Pipe`` against saving it to the shared-memory pool and sending the handle,
  from 4 KiB to 64 MiB, to place the size where the pool starts to pay.

Targets (printed as PASS/MISS): ``ray.get`` of a 64 MiB Tensor within 1.5x of the numpy
array's and at least 5x faster than the torch tensor's; protocol-5 ``dumps``+``loads`` of a
64 MiB Tensor within 1.5x of the numpy array's; both independent of size (64 MiB within 2x of
4 KiB).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from pb_tensor import Tensor
from pb_tensor.shm import SharedMemoryPool

SIZES = {"4 KiB": 4 << 10, "64 MiB": 64 << 20}
MP_SIZES = {
    "4 KiB": 4 << 10, "64 KiB": 64 << 10, "128 KiB": 128 << 10, "256 KiB": 256 << 10,
    "1 MiB": 1 << 20,
    "4 MiB": 4 << 20, "16 MiB": 16 << 20, "64 MiB": 64 << 20,
}  # fmt: skip
KINDS = ("Tensor", "numpy", "torch")
K = TypeVar("K")
GET_VS_NUMPY = 1.5  # ray.get(Tensor) / ray.get(numpy), 64 MiB
GET_VS_TORCH = 5.0  # ray.get(torch) / ray.get(Tensor), 64 MiB
PICKLE_VS_NUMPY = 1.5  # dumps+loads(Tensor) / dumps+loads(numpy), 64 MiB
SIZE_RATIO = 2.0  # 64 MiB time / 4 KiB time


def _median_ns(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn`` in ns, call by call, after a short warm-up."""
    return _interleaved({"fn": fn}, reps)["fn"]


def _interleaved(fns: dict[K, Callable[[], object]], reps: int) -> dict[K, float]:
    """Median wall time in ns of each function, calls interleaved (one of each per round) so
    that load from other processes on the machine hits all of them alike."""
    for fn in fns.values():
        for _ in range(min(reps, 5)):
            fn()
    samples: dict[K, list[int]] = {name: [] for name in fns}
    clock = time.perf_counter_ns
    for _ in range(reps):
        for name, fn in fns.items():
            start = clock()
            fn()
            samples[name].append(clock() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def _objects(nbytes: int) -> dict[str, Any]:
    """The same float32 data as a Tensor, a numpy array and (if installed) a torch tensor."""
    array = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
    objects: dict[str, Any] = {"Tensor": Tensor("INPUT0", array), "numpy": array}
    try:
        import torch
    except ImportError:
        pass
    else:
        objects["torch"] = torch.from_numpy(array)
    return objects


def _reps(nbytes: int, kind: str, quick: bool) -> int:
    # torch copies: tens of milliseconds a call at 64 MiB.
    reps = 20 if kind == "torch" and nbytes > 1 << 20 else 3_000
    return max(5, reps // 20) if quick else reps


def _measure(fn: Callable[[Any], object], objects: dict[str, dict[str, Any]],
             quick: bool) -> dict[str, dict[str, float]]:  # fmt: skip
    """``fn(obj)`` timed for each size and kind: the Tensor and numpy calls of every size
    interleaved (the ratios compare calls made side by side), torch on its own (it is orders of
    magnitude slower at 64 MiB). ``objects``: size label -> kind -> object."""
    close: dict[tuple[str, str], Callable[[], object]] = {
        (label, kind): functools.partial(fn, by_kind[kind])
        for label, by_kind in objects.items()
        for kind in ("Tensor", "numpy")
    }
    times = _interleaved(close, _reps(0, "Tensor", quick))
    results: dict[str, dict[str, float]] = {label: {} for label in objects}
    for (label, kind), ns in times.items():
        results[label][kind] = ns
    for label, by_kind in objects.items():
        if "torch" in by_kind:
            reps = _reps(SIZES[label], "torch", quick)
            results[label]["torch"] = _median_ns(functools.partial(fn, by_kind["torch"]), reps)
    return results


# --------------------------------------------------------------------------------- pickling
def _pickle_round_trip(obj: object) -> object:
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(stream, buffers=buffers)


def bench_pickle(quick: bool) -> dict[str, dict[str, float]]:
    objects = {label: _objects(nbytes) for label, nbytes in SIZES.items()}
    return _measure(_pickle_round_trip, objects, quick)


# -------------------------------------------------------------------------------------- Ray
def bench_ray(quick: bool) -> dict[str, dict[str, dict[str, float]]] | None:
    try:
        import ray
    except ImportError:
        print("ray is not installed (pip install 'pb-tensor[ray]'): Ray rows skipped")
        return None
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        objects = {label: _objects(nbytes) for label, nbytes in SIZES.items()}
        # put: every call stores a new object (its ref is dropped right away, freeing it). One
        # size at a time: a 4 KiB put right after a 64 MiB one would pay for freeing it.
        puts: dict[str, dict[str, float]] = {}
        for label, by_kind in objects.items():
            puts.update(_measure(ray.put, {label: by_kind}, True))
        refs = {
            label: {kind: ray.put(obj) for kind, obj in by_kind.items()}
            for label, by_kind in objects.items()
        }
        gets = _measure(ray.get, refs, quick)
        del refs
    finally:
        ray.shutdown()
    return {"put": puts, "get": gets}


# -------------------------------------------------------------------------- multiprocessing
def _pipe_child(conn: Any) -> None:
    while (tensor := conn.recv()) is not None:
        conn.send(tensor.byte_size)
        del tensor


def _pool_child(name: str, conn: Any) -> None:
    with SharedMemoryPool.attach(name) as pool:
        while (handle := conn.recv()) is not None:
            tensor = Tensor.load_from_shared_memory(pool, handle)
            conn.send(tensor.byte_size)
            del tensor


def _transfer(
    child: Callable[..., None], args: tuple[Any, ...], send: Callable[[Any, np.ndarray], object],
    payloads: dict[str, np.ndarray], quick: bool,
) -> dict[str, float]:  # fmt: skip
    """Median time per size: build a Tensor, send it, wait for the child's acknowledgement."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=child, args=(*args, theirs))
    proc.start()
    times = {}
    try:
        for label, payload in payloads.items():

            def once(p: np.ndarray = payload) -> None:
                send(ours, p)
                ours.recv()

            n = payload.nbytes
            reps = 2_000 if n <= 64 << 10 else 300 if n <= 1 << 20 else 30
            times[label] = _median_ns(once, max(5, reps // 10) if quick else reps)
    finally:
        ours.send(None)
        proc.join(60)
    return times


def bench_multiprocessing(quick: bool) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(1)
    payloads = {label: rng.integers(0, 256, n, dtype=np.uint8) for label, n in MP_SIZES.items()}
    with SharedMemoryPool.create(160 << 20, growth=16 << 20) as pool:
        held: list[Tensor] = []

        def via_pool(conn: Any, payload: np.ndarray) -> None:
            # A fresh Tensor each time (its save is the one copy); the previous one, already
            # loaded and acknowledged by the child, is dropped (its record with it).
            held.clear()
            t = Tensor("INPUT0", payload)
            conn.send(t.save_to_shared_memory(pool))
            held.append(t)

        methods = {
            "pickle + Pipe": _transfer(
                _pipe_child, (), lambda c, p: c.send(Tensor("INPUT0", p)), payloads, quick
            ),
            "shm pool + handle": _transfer(_pool_child, (pool.name,), via_pool, payloads, quick),
        }
        held.clear()
    return {label: {m: times[label] for m, times in methods.items()} for label in MP_SIZES}


# ----------------------------------------------------------------------------------- report
def _fmt(ns: float | None) -> str:
    if ns is None:
        return f"{'-':>10}"
    if ns < 10_000:
        return f"{ns / 1e3:7.2f} us"
    if ns < 10_000_000:
        return f"{ns / 1e6:7.3f} ms"
    return f"{ns / 1e6:7.1f} ms"


def _table(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}")
    print(f"{'size':>7} | " + " | ".join(f"{k:>10}" for k in KINDS)
          + " | Tensor/numpy | torch/Tensor")  # fmt: skip
    for label, r in rows.items():
        cells = " | ".join(_fmt(r.get(k)) for k in KINDS)
        vs_numpy = f"{r['Tensor'] / r['numpy']:11.2f}x"
        vs_torch = f"{r['torch'] / r['Tensor']:11.1f}x" if "torch" in r else f"{'-':>12}"
        print(f"{label:>7} | {cells} | {vs_numpy} | {vs_torch}")


def report(
    pickled: dict[str, dict[str, float]],
    ray_results: dict[str, dict[str, dict[str, float]]] | None,
    transfers: dict[str, dict[str, float]],
) -> bool:
    _table("pickle protocol 5, dumps + loads with out-of-band buffers (median per call)", pickled)
    if ray_results is not None:
        _table("ray.put (median per call)", ray_results["put"])
        _table("ray.get of one stored object (median per call)", ray_results["get"])
    print("\nmultiprocessing: build a Tensor, send it to a child, child acknowledges (median)")
    methods = list(next(iter(transfers.values())))
    print(f"{'size':>7} | " + " | ".join(f"{m:>18}" for m in methods) + " | pickle/pool")
    crossover = None
    for label, r in transfers.items():
        ratio = r["pickle + Pipe"] / r["shm pool + handle"]
        if crossover is None and ratio > 1.0:
            crossover = label
        print(f"{label:>7} | " + " | ".join(f"{_fmt(r[m]):>18}" for m in methods)
              + f" | {ratio:10.2f}x")  # fmt: skip
    print(f"  the pool is faster from {crossover or 'no measured size'} on")

    big, small = "64 MiB", "4 KiB"
    checks: list[tuple[str, float, bool]] = []
    p_big, p_small = pickled[big], pickled[small]
    ratio = p_big["Tensor"] / p_big["numpy"]
    checks.append((f"pickle 64 MiB Tensor <= {PICKLE_VS_NUMPY}x numpy", ratio,
                   ratio <= PICKLE_VS_NUMPY))  # fmt: skip
    ratio = p_big["Tensor"] / p_small["Tensor"]
    checks.append((f"pickle Tensor 64 MiB <= {SIZE_RATIO}x 4 KiB", ratio, ratio <= SIZE_RATIO))
    if ray_results is not None:
        g_big, g_small = ray_results["get"][big], ray_results["get"][small]
        ratio = g_big["Tensor"] / g_big["numpy"]
        checks.append((f"ray.get 64 MiB Tensor <= {GET_VS_NUMPY}x numpy", ratio,
                       ratio <= GET_VS_NUMPY))  # fmt: skip
        if "torch" in g_big:
            ratio = g_big["torch"] / g_big["Tensor"]
            checks.append((f"ray.get 64 MiB Tensor >= {GET_VS_TORCH}x faster than torch",
                           ratio, ratio >= GET_VS_TORCH))  # fmt: skip
        ratio = g_big["Tensor"] / g_small["Tensor"]
        checks.append((f"ray.get Tensor 64 MiB <= {SIZE_RATIO}x 4 KiB", ratio,
                       ratio <= SIZE_RATIO))  # fmt: skip
    print("\nTargets")
    for text, value, ok in checks:
        print(f"  {'PASS' if ok else 'MISS'}  {text:<46} measured {value:.2f}")
    return all(ok for _, _, ok in checks)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray rows")
    args = parser.parse_args()
    print(f"Python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs",
          flush=True)  # fmt: skip
    pickled = bench_pickle(args.quick)
    ray_results = None if args.no_ray else bench_ray(args.quick)
    transfers = bench_multiprocessing(args.quick)
    return 0 if report(pickled, ray_results, transfers) else 1


if __name__ == "__main__":
    raise SystemExit(main())
