"""Stress every DLPack and shared-memory path from many threads at once, checking the data.

Eight worker threads loop over every path (dlpack_ctypes export and import, numpy and torch
importing our exports, Tensor construction, export and import, BYTES tensors, and shared-memory
save/load through a SharedMemoryPool) while another thread keeps calling ``gc.collect()`` and
``dlpack_ctypes.flush()``. Every value read back is compared with what was written. At the end
it prints the growth of the resident set (target: under 16 MB after warm-up), the exports still
alive (must be 0) and the pool's allocations (must be 0), each with PASS/MISS; the exit status
is 1 if anything failed.

Then it runs the exit scenario: a child interpreter whose daemon threads keep exporting and
importing through DLPack returns from its main thread; it must exit (within 60 s) with
status 0. And the repeated-interrupt scenario: in a child interpreter a ``SIGALRM`` timer
(re-armed every 20-100 us) raises ``KeyboardInterrupt`` whenever the interrupted frame is in
``dlpack_ctypes`` or ``pb_tensor``, around loops of ``dl.from_dlpack(exporter).numpy()``,
``np.from_dlpack(exporter)`` and ``Tensor.from_dlpack("x", numpy_capsule)``; afterwards
``live_exports()`` must be 0 and the array must have every reference back (each numpy deleter
ran exactly once).

Usage::

    python scripts/stress.py              # 10 seconds
    python scripts/stress.py --seconds 60
    python scripts/stress.py --quick      # 2 seconds (CI smoke run)
    python scripts/stress.py --pool-interrupts 5000   # the pool under a KeyboardInterrupt timer
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dlpack_ctypes as dl
from pb_tensor import Tensor
from pb_tensor.shm import SharedMemoryPool

try:
    import torch
except ImportError:  # torch paths are skipped without it
    torch = None

RSS_TARGET_MB = 16.0
THREADS = 8


def rss_mb() -> float:
    """Resident set size of this process in MB (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class Failure(Exception):
    pass


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise Failure(what)


def make_paths(pool: SharedMemoryPool) -> dict[str, Callable[[int], None]]:
    """Each path takes a seed, builds data from it, round-trips it and checks the values."""

    def data(seed: int, n: int = 64) -> np.ndarray[Any, Any]:
        return (np.arange(n, dtype=np.float32) + seed % 1000).reshape(4, n // 4)

    def ctypes_export_import(seed: int) -> None:
        a = data(seed)
        for capsule in (dl.to_dlpack(a), dl.to_dlpack(a, max_version=(1, 3)),
                        dl.BufferExporter.from_numpy(a).__dlpack__(max_version=(1, 3))):
            t = dl.consume(capsule, legacy_writable=True)
            v = t.numpy()
            expect(np.array_equal(v, a) and np.shares_memory(v, a), "ctypes round trip")
            del v
            t.close()
        dl.to_dlpack(a)  # dropped unconsumed: the sweep releases it

    def numpy_of_ours(seed: int) -> None:
        a = data(seed)
        v = np.from_dlpack(dl.BufferExporter.from_numpy(a))
        expect(np.array_equal(v, a) and np.shares_memory(v, a), "np.from_dlpack of ours")

    def ours_of_numpy(seed: int) -> None:
        a = data(seed)
        t = dl.from_dlpack(a)
        expect(np.array_equal(t.numpy(), a), "from_dlpack of numpy")

    def torch_paths(seed: int) -> None:
        if torch is None:
            return
        a = data(seed)
        x = torch.from_dlpack(dl.BufferExporter.from_numpy(a))
        expect(float(x.sum()) == float(a.sum()), "torch.from_dlpack of ours")
        t = dl.from_dlpack(x)
        expect(np.array_equal(t.numpy(), a), "from_dlpack of torch")
        y = torch.utils.dlpack.from_dlpack(Tensor("t", a).to_dlpack())
        expect(float(y.sum()) == float(a.sum()), "torch of Tensor.to_dlpack")

    def tensor_paths(seed: int) -> None:
        a = data(seed)
        t = Tensor("x", a)
        back = Tensor.from_dlpack("y", t.to_dlpack())
        expect(np.array_equal(back.as_numpy(), a), "Tensor legacy round trip")
        again = Tensor.from_dlpack("z", back)
        expect(np.array_equal(again.as_numpy(), a), "Tensor protocol round trip")
        if torch is not None:
            x = torch.arange(16, dtype=torch.float32) + seed % 1000
            tt = Tensor.from_dlpack("w", x)
            expect(np.array_equal(tt.as_numpy(), x.numpy()), "Tensor from torch")

    def bytes_paths(seed: int) -> None:
        words = np.array([f"s{seed}-{i}".encode() for i in range(6)], dtype=np.object_)
        t = Tensor("b", words.reshape(2, 3))
        out = t.as_numpy()
        expect(out.reshape(-1).tolist() == words.tolist(), "BYTES values")

    def shm_paths(seed: int) -> None:
        a = data(seed, 256)
        t = Tensor("s", a)
        handle = t.save_to_shared_memory(pool)
        loaded = Tensor.load_from_shared_memory(pool, handle)
        expect(np.array_equal(loaded.as_numpy(), a), "shm float32 load")
        words = np.array([f"w{seed}-{i}".encode() for i in range(6)], dtype=np.object_)
        b = Tensor("b", words.reshape(2, 3))
        handle_b = b.save_to_shared_memory(pool)
        loaded_b = Tensor.load_from_shared_memory(pool, handle_b)
        expect(loaded_b.as_numpy().reshape(-1).tolist() == words.tolist(), "shm BYTES load")
        del t, loaded, b, loaded_b

    return {
        "ctypes export/import": ctypes_export_import,
        "np.from_dlpack(ours)": numpy_of_ours,
        "from_dlpack(numpy)": ours_of_numpy,
        "torch": torch_paths,
        "Tensor": tensor_paths,
        "BYTES": bytes_paths,
        "shared memory": shm_paths,
    }


# The daemon-exit scenario: four daemon threads loop over DLPack exports and imports while the
# main thread returns. Interpreter finalization freezes them wherever they are, possibly holding
# the sweep lock; the exit must not wait for it.
DAEMON_EXIT_CHILD = """
import threading, time
import numpy as np
import dlpack_ctypes as dl
from pb_tensor import Tensor

a = np.arange(64, dtype=np.float32)
exporter = dl.BufferExporter.from_numpy(a)
steps = [
    lambda: dl.consume(exporter.__dlpack__(max_version=(1, 3))).numpy(),
    lambda: np.from_dlpack(exporter),
    lambda: np.from_dlpack(Tensor.from_dlpack("y", Tensor("x", a))),
    lambda: dl.from_dlpack(exporter).numpy(),
]
started = threading.Barrier(len(steps) + 1)

def forever(step):
    started.wait()
    while True:
        step()

for step in steps:
    threading.Thread(target=forever, args=(step,), daemon=True).start()
started.wait()
time.sleep(0.5)
"""
DAEMON_EXIT_TIMEOUT = 60.0


def daemon_exit() -> tuple[bool, str]:
    """Run :data:`DAEMON_EXIT_CHILD`; returns (passed, what happened)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", DAEMON_EXIT_CHILD], env=env, cwd=root,
                              capture_output=True, text=True, timeout=DAEMON_EXIT_TIMEOUT,
                              check=False)
    except subprocess.TimeoutExpired:
        return False, f"hung > {DAEMON_EXIT_TIMEOUT:g} s"
    took = time.perf_counter() - start
    if done.returncode != 0:
        return False, f"exit {done.returncode}: {done.stderr.strip()[-200:]}"
    return True, f"{took:.1f} s"


# The repeated-interrupt scenario (docs/guarantees.md, "Signals and other asynchronous
# exceptions"): each loop runs for the given seconds under the timer.
INTERRUPTS_CHILD = """
import gc, json, random, signal, sys, time
import numpy as np
import dlpack_ctypes as dl
from pb_tensor import Tensor

seconds = float(sys.argv[1])
a = np.arange(6, dtype=np.float32).reshape(2, 3)
rng = random.Random(22)
delays = [rng.uniform(20e-6, 100e-6) for _ in range(1009)]
ticks = [0]
hits = [0]

def handler(signum, frame):
    ticks[0] += 1
    signal.setitimer(signal.ITIMER_REAL, delays[ticks[0] % 1009])
    if frame is not None and frame.f_globals.get("__name__", "").startswith(
            ("dlpack_ctypes", "pb_tensor")):
        hits[0] += 1
        raise KeyboardInterrupt

def consume():
    t = dl.from_dlpack(dl.BufferExporter.from_numpy(a))
    v = t.numpy()
    del v, t

def numpy_import():
    x = np.from_dlpack(dl.BufferExporter.from_numpy(a))
    del x

def foreign():
    t = Tensor.from_dlpack("x", a.__dlpack__(max_version=(1, 0)))
    v = t.as_numpy()
    del v, t

report = {}
for step in (consume, numpy_import, foreign):
    for _ in range(20):
        step()
    gc.collect()
    dl.flush()
    base = sys.getrefcount(a)
    hits[0] = 0
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, delays[0])
    end = time.perf_counter() + seconds
    n = 0
    while True:
        try:
            try:
                if time.perf_counter() > end:
                    break
                n += 1
                step()
            except KeyboardInterrupt:
                pass
        except KeyboardInterrupt:
            pass
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    for _ in range(3):
        gc.collect()
    report[step.__name__] = [n, hits[0], dl.flush(), sys.getrefcount(a) - base]
print(json.dumps(report))
"""


def interrupts(seconds: float) -> list[tuple[str, bool, str]]:
    """Run :data:`INTERRUPTS_CHILD`; returns (label, passed, value) rows."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    try:
        done = subprocess.run([sys.executable, "-c", INTERRUPTS_CHILD, str(seconds)], env=env,
                              cwd=root, capture_output=True, text=True,
                              timeout=60 + 6 * seconds, check=False)
    except subprocess.TimeoutExpired:
        return [("interrupts", False, "hung")]
    if done.returncode != 0:
        return [("interrupts", False, f"exit {done.returncode}: {done.stderr.strip()[-200:]}")]
    rows = []
    for name, (n, hits, live, refs) in json.loads(done.stdout.strip().splitlines()[-1]).items():
        rows.append((f"interrupts, {name}: live, refs", live == 0 and refs == 0 and hits > 0,
                     f"{live}, {refs} ({hits}/{n})"))
    return rows


def run(seconds: float) -> int:
    pool = SharedMemoryPool.create(16 << 20, growth=16 << 20, max_size=256 << 20)
    paths = make_paths(pool)
    errors: list[str] = []
    counts = dict.fromkeys(paths, 0)
    counts_lock = threading.Lock()
    stop = threading.Event()

    def worker(index: int) -> None:
        seed = index
        local = dict.fromkeys(paths, 0)
        try:
            while not stop.is_set():
                for name, fn in paths.items():
                    fn(seed)
                    local[name] += 1
                    seed += THREADS
        except BaseException:  # report anything, including a wrong value
            errors.append(f"thread {index}: {traceback.format_exc()}")
            stop.set()
        with counts_lock:
            for name, n in local.items():
                counts[name] += n

    def collector() -> None:
        while not stop.is_set():
            gc.collect()
            dl.flush()
            time.sleep(0.001)

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        # Warm-up: first-use caches (dtype tables, prototypes, torch's lazy state) are not growth.
        for fn in paths.values():
            for seed in range(50):
                fn(seed)
        gc.collect()
        dl.flush()
        rss_start = rss_mb()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        threads.append(threading.Thread(target=collector))
        for t in threads:
            t.start()
        stop.wait(seconds)
        stop.set()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(previous)
    gc.collect()
    live = dl.live_exports()
    gc.collect()
    rss_growth = rss_mb() - rss_start
    used = pool.stats().allocations
    pool.close()

    print(f"stress: {THREADS} threads + gc/flush thread, {seconds:g} s")
    for name, n in counts.items():
        print(f"  {name:<24} {n:>8} iterations")
    ok = True
    for label, good, value in (
        ("errors / wrong data", not errors, str(len(errors))),
        (f"RSS growth < {RSS_TARGET_MB:g} MB", rss_growth < RSS_TARGET_MB,
         f"{rss_growth:.1f} MB"),
        ("live_exports() == 0", live == 0, str(live)),
        ("pool allocations == 0", used == 0, str(used)),
        ("exit, DLPack daemon threads", *daemon_exit()),
        *interrupts(max(1.0, seconds / 5)),
    ):
        print(f"  {label:<38} {value:>18}  {'PASS' if good else 'MISS'}")
        ok = ok and good
    for e in errors[:3]:
        print(e)
    return 0 if ok else 1


POOL_INTERVALS = (20e-6, 50e-6, 100e-6, 200e-6)


def run_pool_interrupts(iterations: int) -> int:
    """Save and load through a pool while a timer raises KeyboardInterrupt in the library.

    For each interval of :data:`POOL_INTERVALS` a ``SIGALRM`` timer fires; its handler raises
    ``KeyboardInterrupt`` whenever the interrupted frame is in ``pb_tensor`` or
    ``dlpack_ctypes`` (never in this loop, so a handle the library returned is never lost on
    its way here). Each iteration saves a temporary ``Tensor`` and loads the handle; a handle
    received whose load did not complete is released. Afterwards (timer off, three
    collections) the pool must hold no allocation and no unloaded record.
    """
    import signal

    def handler(signum: int, frame: Any) -> None:
        if frame is not None and frame.f_globals.get("__name__", "").startswith(
            ("pb_tensor", "dlpack_ctypes")
        ):
            raise KeyboardInterrupt

    pool = SharedMemoryPool.create(4 << 20)
    a = np.arange(16, dtype=np.float32)
    ok = True
    print(f"pool interrupts: {iterations} save + load per interval")
    for interval in POOL_INTERVALS:
        received: list[int] = []
        interrupts = 0
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, interval, interval)
        try:
            for _ in range(iterations):
                handle = None
                try:
                    handle = Tensor("x", a).save_to_shared_memory(pool)
                    Tensor.load_from_shared_memory(pool, handle)
                    handle = None
                except KeyboardInterrupt:
                    interrupts += 1
                    if handle is not None:
                        received.append(handle)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
        for handle in received:
            pool.release(handle)
        for _ in range(3):
            gc.collect()
        stats = pool.stats()
        good = stats.allocations == 0 and stats.unloaded_records == 0
        ok = ok and good
        print(
            f"  every {interval * 1e6:>4.0f} us: {interrupts:>6} calls interrupted, "
            f"allocations {stats.allocations}, unloaded {stats.unloaded_records}  "
            f"{'PASS' if good else 'MISS'}"
        )
    pool.close()
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="run time (default 10)")
    parser.add_argument("--quick", action="store_true", help="a 2-second smoke run")
    parser.add_argument(
        "--pool-interrupts", type=int, default=0, metavar="N",
        help="instead: N pool save + load per timer interval, interrupted in the library",
    )  # fmt: skip
    args = parser.parse_args()
    if args.pool_interrupts:
        return run_pool_interrupts(args.pool_interrupts)
    return run(2.0 if args.quick else args.seconds)


if __name__ == "__main__":
    sys.exit(main())
