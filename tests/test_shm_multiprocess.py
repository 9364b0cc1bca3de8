"""Shared-memory pool across processes: spawn children, unrelated processes, fork, crashes.

Every child is bounded by a timeout; workers run for a fixed wall-clock time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing as mp
import os
import queue
import select
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pb_tensor import shm
from pb_tensor.shm import SharedMemoryPool, load_record, release, save_record

REPO = Path(__file__).resolve().parent.parent
CTX = mp.get_context("spawn")
TIMEOUT = 60  # seconds; nothing here should take more than a few


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["OPENBLAS_NUM_THREADS"] = "1"  # keep children single-threaded (fork warnings)
    return env


def _python(code: str, *args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@contextlib.contextmanager
def _child(code: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A child process with pipes; killed if still running when the block ends."""
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=_env(),
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(TIMEOUT)


def _readline(proc: subprocess.Popen[str], timeout: float = TIMEOUT) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "child did not answer in time"
    return proc.stdout.readline().strip()


def _save_bytes(pool: SharedMemoryPool, data: np.ndarray, name: str) -> int:
    return save_record(
        pool, name=name, dtype=2, dims=data.shape, memory_type=0, memory_type_id=0,
        payload=data, byte_size=data.nbytes,
    )  # fmt: skip


def _crc(pool: SharedMemoryPool, handle: int) -> tuple[str, int]:
    record = load_record(pool, handle)
    return record.name, zlib.crc32(record.payload)


@pytest.fixture
def name() -> Iterator[str]:
    value = f"pbt_mp_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    yield value
    assert not os.path.exists(os.path.join(shm.SHM_DIR, value)), "segment left in /dev/shm"


# ------------------------------------------------------------------------- spawn children
_KEEP: list[Any] = []  # records a child still holds when it exits


def _spawn_echo(name: str, handle: int, crc: int, results: Any) -> None:
    pool = SharedMemoryPool.attach(name)
    record = load_record(pool, handle)
    ok = zlib.crc32(record.payload) == crc and record.name == "from_parent"
    ok = ok and record.payload.ctypes.data % shm.PAYLOAD_ALIGNMENT == 0
    data = np.arange(5000, dtype=np.float64)
    new = save_record(
        pool, name="from_child", dtype=12, dims=data.shape, memory_type=0, memory_type_id=0,
        payload=data, byte_size=data.nbytes,
    )  # fmt: skip
    _KEEP.append(record)  # held at exit: the exit hook must give the reference back
    results.put((ok, new, zlib.crc32(data.tobytes())))


def test_spawn_child_both_directions(name: str) -> None:
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:
        data = np.random.default_rng(0).integers(0, 256, 30000, dtype=np.uint8)
        handle = _save_bytes(pool, data, "from_parent")
        results = CTX.Queue()
        child = CTX.Process(target=_spawn_echo, args=(name, handle, zlib.crc32(data), results))
        child.start()
        ok, new, crc = results.get(timeout=TIMEOUT)
        child.join(TIMEOUT)
        assert child.exitcode == 0
        assert ok
        assert pool.refcount(handle) == 1  # the child's load was given back at its exit
        assert pool.refcount(new) == 1  # the saver's reference outlives the saver
        assert _crc(pool, new) == ("from_child", crc)
        release(pool, new)
        release(pool, handle)
        assert pool.stats().allocations == 0


_UNRELATED_CHILD = """
    import json, sys, zlib
    import numpy as np
    from pb_tensor.shm import SharedMemoryPool, load_record, save_record
    pool = SharedMemoryPool.attach(sys.argv[1])
    record = load_record(pool, int(sys.argv[2]))
    data = np.full(123457, 7, dtype=np.uint8)
    new = save_record(
        pool, name="unrelated", dtype=2, dims=data.shape, memory_type=0, memory_type_id=0,
        payload=data, byte_size=data.nbytes,
    )
    print(json.dumps({
        "name": record.name, "crc": zlib.crc32(record.payload), "dims": record.dims,
        "new": new, "new_crc": zlib.crc32(data), "size": pool.size,
    }))
    del record
    pool.close()
"""


def test_unrelated_process_both_directions(name: str) -> None:
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:
        data = np.arange(4000, dtype=np.uint8)
        handle = _save_bytes(pool, data, "to_unrelated")
        done = _python(_UNRELATED_CHILD, name, str(handle))
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["name"] == "to_unrelated"
        assert answer["crc"] == zlib.crc32(data)
        assert answer["dims"] == [4000]
        assert pool.size == answer["size"] > 1 << 16  # the child grew the pool; we see it
        assert pool.refcount(handle) == 1
        assert _crc(pool, answer["new"]) == ("unrelated", answer["new_crc"])
        release(pool, answer["new"])
        release(pool, handle)
        assert os.path.exists(os.path.join(shm.SHM_DIR, name))  # the attacher did not unlink


_CREATOR_CHILD = """
    import sys
    import numpy as np
    from pb_tensor.shm import SharedMemoryPool, save_record
    with SharedMemoryPool.create(1 << 16, name=sys.argv[1]) as pool:
        data = np.arange(10, dtype=np.int64)
        h = save_record(
            pool, name="made_elsewhere", dtype=9, dims=(2, 5), memory_type=0,
            memory_type_id=0, payload=data, byte_size=80,
        )
        print(h, flush=True)
        sys.stdin.readline()  # wait until the other process is done
        print(pool.stats().allocations, flush=True)  # the other process freed the record
"""


def test_attach_to_pool_of_unrelated_creator(name: str) -> None:
    with _child(_CREATOR_CHILD, name) as child:
        handle = int(_readline(child))
        with SharedMemoryPool.attach(name) as pool:
            record = load_record(pool, handle)
            assert record.name == "made_elsewhere"
            assert record.dims == (2, 5)
            assert record.payload.view(np.int64).tolist() == list(range(10))
            del record
            release(pool, handle)  # take over the saver's reference
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert _readline(child) == "0"
        child.wait(TIMEOUT)
    assert child.returncode == 0
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))  # the creator unlinked


# --------------------------------------------------------------------------- stress test
def _stress_worker(
    name: str, wid: int, nworkers: int, seconds: float, inboxes: list[Any], results: Any
) -> None:
    pool = SharedMemoryPool.attach(name)
    rng = np.random.default_rng(wid)
    mine: list[tuple[int, int]] = []
    counts = {"saved": 0, "verified": 0, "passed": 0, "received": 0}
    errors: list[str] = []

    def verify_and_release(handle: int, crc: int) -> None:
        record = load_record(pool, handle)
        if zlib.crc32(record.payload) != crc or not record.name.endswith(f":{crc}"):
            errors.append(f"corrupted record {handle}: {record.name}")
        del record
        release(pool, handle)
        counts["verified"] += 1

    deadline = time.monotonic() + seconds
    neighbour_done = False  # the previous worker sends None after its last record
    try:
        while time.monotonic() < deadline:
            r = rng.random()
            if r < 0.45 or not mine:
                n = int(rng.choice([0, 1, 100, 4000, 30000, 200000]))
                data = rng.integers(0, 256, n, dtype=np.uint8)
                crc = zlib.crc32(data)
                mine.append((_save_bytes(pool, data, f"w{wid}:{crc}"), crc))
                counts["saved"] += 1
            elif r < 0.85:
                verify_and_release(*mine.pop(int(rng.integers(len(mine)))))
            else:
                inboxes[(wid + 1) % nworkers].put(mine.pop(int(rng.integers(len(mine)))))
                counts["passed"] += 1
            while not neighbour_done:
                try:
                    item = inboxes[wid].get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    neighbour_done = True
                else:
                    verify_and_release(*item)
                    counts["received"] += 1
        for handle, crc in mine:
            verify_and_release(handle, crc)
    except Exception as exc:  # reported to the parent
        errors.append(repr(exc))
    finally:
        inboxes[(wid + 1) % nworkers].put(None)
    try:
        while not neighbour_done:
            item = inboxes[wid].get(timeout=TIMEOUT / 2)
            if item is None:
                break
            verify_and_release(*item)
            counts["received"] += 1
    except Exception as exc:
        errors.append(repr(exc))
    results.put((wid, counts, errors, pool.size))
    pool.close()


def test_four_processes_concurrently(name: str) -> None:
    nworkers, seconds = 4, 2.0
    with SharedMemoryPool.create(1 << 18, growth=1 << 18, name=name) as pool:
        inboxes = [CTX.Queue() for _ in range(nworkers)]
        results = CTX.Queue()
        workers = [
            CTX.Process(target=_stress_worker, args=(name, w, nworkers, seconds, inboxes, results))
            for w in range(nworkers)
        ]
        for w in workers:
            w.start()
        reports = [results.get(timeout=TIMEOUT) for _ in workers]
        for w in workers:
            w.join(TIMEOUT)
            assert w.exitcode == 0
        for wid, counts, errors, _ in reports:
            assert not errors, (wid, errors)
            assert counts["saved"] > 20, counts
            assert counts["received"] > 0, counts
        assert sum(r[1]["passed"] for r in reports) == sum(r[1]["received"] for r in reports)
        stats = pool.stats()  # walks and checks the heap
        assert (stats.allocations, stats.used, stats.free_blocks) == (0, 0, 1), stats
        assert stats.recoveries == 0
        assert pool.size > 1 << 18  # grew while four processes were using it


# ----------------------------------------------------------------------- crash recovery
_DIE_HOLDING_LOCK = """
    import os, sys, time
    from pb_tensor.shm import _heap as heap
    from pb_tensor.shm import SharedMemoryPool
    pool = SharedMemoryPool.attach(sys.argv[1])
    import fcntl
    fcntl.flock(pool._lock_fd, fcntl.LOCK_EX)
    m = pool._map
    # Die in the middle of a heap mutation: dirty word set, free lists half rewritten.
    heap.U64.pack_into(m.mm, heap.OFF_DIRTY, os.getpid())
    for b in range(heap.NBINS):
        heap.U64.pack_into(m.mm, heap.OFF_BINS + 8 * b, 0)
    print("locked", flush=True)
    time.sleep(TIMEOUT)
""".replace("TIMEOUT", str(TIMEOUT))


def _lock_is_free(name: str) -> bool:
    fd = os.open(os.path.join(shm.SHM_DIR, name), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # also drops the lock if we got it
    return True


def test_child_killed_holding_the_lock(name: str) -> None:
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:
        rng = np.random.default_rng(3)
        kept = {}
        for i in range(12):
            data = rng.integers(0, 256, 1000 * (i + 1), dtype=np.uint8)
            kept[_save_bytes(pool, data, f"k{i}")] = zlib.crc32(data)
        for h in list(kept)[::3]:  # make holes: the free lists matter
            release(pool, h)
            del kept[h]
        early = load_record(pool, next(iter(kept)))
        with _child(_DIE_HOLDING_LOCK, name) as child:
            assert _readline(child) == "locked", child.stderr.read() if child.stderr else ""
            assert not _lock_is_free(name)
            child.send_signal(signal.SIGKILL)
            child.wait(TIMEOUT)
        assert child.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while not _lock_is_free(name):  # the kernel releases it with the process
            assert time.monotonic() < deadline, "lock still held after the holder died"
            time.sleep(0.01)
        handle = pool.allocate(5000)  # rebuilds the heap the dead process left dirty
        stats = pool.stats()
        assert stats.recoveries == 1
        assert stats.free_blocks >= 1
        for h, crc in kept.items():
            assert _crc(pool, h)[1] == crc
        del early
        pool.decref(handle)
        for h in kept:
            release(pool, h)
        stats = pool.stats()
        assert (stats.allocations, stats.free_blocks) == (0, 1), stats


_CHURN = """
    import sys
    import numpy as np
    from pb_tensor.shm import SharedMemoryPool, release, save_record
    pool = SharedMemoryPool.attach(sys.argv[1])
    rng = np.random.default_rng(int(sys.argv[2]))
    live = []
    first = True
    while True:
        if live and rng.random() < 0.5:
            release(pool, live.pop(int(rng.integers(len(live)))))
        else:
            n = int(rng.integers(0, 50000))
            live.append(save_record(
                pool, name="churn", dtype=2, dims=(n,), memory_type=0, memory_type_id=0,
                payload=np.zeros(n, np.uint8), byte_size=n,
            ))
        if first:
            print("running", flush=True)
            first = False
"""


def test_children_killed_at_random_points(name: str) -> None:
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:
        data = np.arange(256, dtype=np.uint8)
        survivor = _save_bytes(pool, data, "survivor")
        rng = np.random.default_rng(4)
        for seed in range(4):
            with _child(_CHURN, name, str(seed)) as child:
                assert _readline(child) == "running"
                time.sleep(float(rng.uniform(0.05, 0.3)))
                child.kill()
            # The others go on: allocate, free, and the heap checks out.
            pool.decref(pool.allocate(int(rng.integers(0, 100000))))
            stats = pool.stats()
            assert stats.size >= 1 << 16
            assert _crc(pool, survivor) == ("survivor", zlib.crc32(data))
        release(pool, survivor)


# ------------------------------------------------------------------- growth, everywhere
def _growth_child(name: str, handle: int, crc: int, commands: Any, results: Any) -> None:
    pool = SharedMemoryPool.attach(name)
    early = load_record(pool, handle)  # mapped before the pool grows
    early_view = early.payload[:100]
    results.put(("ready", pool.size))
    handles = commands.get(timeout=TIMEOUT)
    ok = all(_crc(pool, h) == (f"g{i}", c) for i, (h, c) in enumerate(handles))
    ok = ok and zlib.crc32(early.payload) == crc and bytes(early_view) == bytes(early.payload[:100])
    big = np.full(600_000, 3, dtype=np.uint8)
    new = _save_bytes(pool, big, "child_big")  # the child grows it too
    results.put((ok, new, zlib.crc32(big), pool.size))
    del early, early_view
    pool.close()


def test_growth_seen_by_every_process(name: str) -> None:
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:
        first = np.arange(20000, dtype=np.uint16).view(np.uint8)
        h0 = _save_bytes(pool, first, "first")
        mine = load_record(pool, h0)
        commands, results = CTX.Queue(), CTX.Queue()
        child = CTX.Process(
            target=_growth_child, args=(name, h0, zlib.crc32(first), commands, results)
        )
        child.start()
        assert results.get(timeout=TIMEOUT) == ("ready", 1 << 16)
        rng = np.random.default_rng(5)
        handles, sizes = [], [pool.size]
        for i in range(10):
            data = rng.integers(0, 256, 30000, dtype=np.uint8)
            handles.append((_save_bytes(pool, data, f"g{i}"), zlib.crc32(data)))
            sizes.append(pool.size)
        assert len(set(sizes)) >= 4, sizes
        commands.put(handles)
        ok, new, crc, child_size = results.get(timeout=TIMEOUT)
        child.join(TIMEOUT)
        assert child.exitcode == 0
        assert ok
        assert pool.size == child_size > sizes[-1]
        assert _crc(pool, new) == ("child_big", crc)
        assert zlib.crc32(mine.payload) == zlib.crc32(first)  # our pre-growth view too
        del mine
        for h, _ in handles:
            release(pool, h)
        release(pool, new)
        release(pool, h0)
        assert pool.stats().allocations == 0


# ------------------------------------------------------------- lifetime of the segment
def _attach_and_leave(name: str, close: bool) -> None:
    pool = SharedMemoryPool.attach(name)
    pool.decref(pool.allocate(100))
    if close:
        pool.close()


def test_children_never_unlink_the_segment(name: str) -> None:
    """multiprocessing's resource_tracker must not unlink what others still use."""
    path = os.path.join(shm.SHM_DIR, name)
    with SharedMemoryPool.create(name=name) as pool:
        for close in (True, False, True):
            child = CTX.Process(target=_attach_and_leave, args=(name, close))
            child.start()
            child.join(TIMEOUT)
            assert child.exitcode == 0
            assert os.path.exists(path)
        done = _python(
            "import sys; from pb_tensor.shm import SharedMemoryPool as P; "
            "print(P.attach(sys.argv[1]).size)",
            name,
        )
        assert done.returncode == 0, done.stderr
        assert int(done.stdout) == pool.size
        assert "leaked" not in done.stderr
        assert "resource_tracker" not in done.stderr
        pool.decref(pool.allocate(100))
    assert not os.path.exists(path)


_FORK = """
    import multiprocessing as mp, os, sys
    import numpy as np
    from pb_tensor.shm import SharedMemoryPool, load_record, release, save_record
    KEEP = []

    def keep_loaded(pool, handle):
        KEEP.append(load_record(pool, handle))  # dropped by the fork child's exit hook

    with SharedMemoryPool.create(1 << 16, name=sys.argv[1]) as pool:
        data = np.arange(64, dtype=np.uint8)
        h = save_record(pool, name="f", dtype=2, dims=(64,), memory_type=0,
                        memory_type_id=0, payload=data, byte_size=64)
        record = load_record(pool, h)
        assert pool.refcount(h) == 2
        pid = os.fork()
        if pid == 0:
            mine = load_record(pool, h)
            ok = pool.refcount(h) == 3 and bytes(mine.payload) == bytes(data)
            del mine, record  # ours goes back, the inherited one is the parent's
            ok = ok and pool.refcount(h) == 2
            pool.close()  # a forked copy of the creator must not unlink
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.path.exists("/dev/shm/" + sys.argv[1])
        assert pool.refcount(h) == 2
        child = mp.get_context("fork").Process(target=keep_loaded, args=(pool, h))
        child.start()
        child.join(60)
        assert child.exitcode == 0 and pool.refcount(h) == 2
        del record
        release(pool, h)
        assert pool.stats().allocations == 0
    print("OK")
"""


def test_fork_children_keep_their_own_references(name: str) -> None:
    done = _python(_FORK, name)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "OK"
