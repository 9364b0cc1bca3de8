"""Reliability of the DLPack core under threads, fork, garbage collection and odd tensors.

Races run with ``sys.setswitchinterval(1e-6)`` and many trials; anything that can crash or hang
runs in a subprocess. Fault injection (asynchronous exceptions, allocation failures) lives in
``test_reliability_faults.py``.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import dlpack_ctypes as dl

TRIALS = 300


@pytest.fixture
def fast_switches() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def race(*fns: Callable[[], None]) -> None:
    """Run ``fns`` on their own threads, released together."""
    barrier = threading.Barrier(len(fns))

    def body(fn: Callable[[], None]) -> None:
        barrier.wait()
        fn()

    threads = [threading.Thread(target=body, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def sweep_state() -> Any:
    """The module that holds the pending queue (named differently before the restructuring)."""
    return getattr(dl, "_blocks", None) or dl.producer


def pending() -> int:
    state = sweep_state()
    queue = getattr(state, "PENDING", None)
    if queue is None:
        queue = state._PENDING
    return len(queue)


class Holder:
    """A DLPack producer returning a fixed capsule (numpy's from_dlpack wants an object)."""

    def __init__(self, capsule: object) -> None:
        self.capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


# ================================================================================================
# Item 1: a capsule handed to several threads is consumed exactly once


@pytest.mark.parametrize("version", [(1, 3), None], ids=["versioned", "legacy"])
def test_capsule_consumed_once_by_racing_threads(
    make_capsule: Any, fast_switches: None, version: tuple[int, int] | None
) -> None:
    a = np.arange(6.0)
    for _ in range(TRIALS):
        capsule, info = make_capsule(a, version=version)
        won: list[dl.DLPackTensor] = []
        lost: list[str] = []

        def take(capsule: object = capsule, won: Any = won, lost: Any = lost) -> None:
            try:
                won.append(dl.consume(capsule))
            except ValueError as exc:
                lost.append(str(exc))

        race(take, take, take, take)
        assert len(won) == 1, f"{len(won)} consumers took the same capsule"
        assert all("already consumed" in m for m in lost), lost
        assert info.calls == 0
        won.clear()
        del capsule
        assert info.calls == 1


def test_capsule_consumed_once_against_numpy(make_capsule: Any, fast_switches: None) -> None:
    a = np.arange(6.0)
    outcomes = {"ours": 0, "numpy": 0}
    for _ in range(TRIALS):
        capsule, info = make_capsule(a)
        won: list[object] = []

        def ours(capsule: object = capsule, won: Any = won) -> None:
            try:
                won.append(dl.consume(capsule))
                outcomes["ours"] += 1
            except ValueError:
                pass

        def theirs(capsule: object = capsule, won: Any = won) -> None:
            try:
                won.append(np.from_dlpack(Holder(capsule)))
                outcomes["numpy"] += 1
            except (ValueError, BufferError, RuntimeError):
                pass

        race(ours, theirs)
        assert len(won) == 1, f"{len(won)} consumers took the same capsule"
        won.clear()
        del capsule
        assert info.calls == 1
    assert sum(outcomes.values()) == TRIALS


CONCURRENT_TORCH = """
import sys, threading
import torch
from torch.utils.dlpack import to_dlpack
import dlpack_ctypes as dl

sys.setswitchinterval(1e-6)
x = torch.arange(64, dtype=torch.float32)
for trial in range(400):
    capsule = to_dlpack(x) if trial % 2 else x.__dlpack__(max_version=(1, 3))
    barrier = threading.Barrier(4)
    won = []
    def take():
        barrier.wait()
        try:
            won.append(dl.consume(capsule))
        except ValueError:
            pass
    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1, len(won)
    assert float(won[0].numpy().sum()) == 2016.0
    del won, capsule
print("ok")
"""


def test_torch_capsule_consumed_once_by_racing_threads(run_python: Any) -> None:
    pytest.importorskip("torch")
    # Two winners means torch's deleter runs twice: a double free (SIGSEGV).
    result = run_python(CONCURRENT_TORCH, timeout=240)
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr[-2000:]


# ================================================================================================
# Item 2: close() racing numpy() never yields a view of released memory


def test_close_racing_numpy(make_capsule: Any, fast_switches: None) -> None:
    a = np.arange(6.0)
    for _ in range(TRIALS):
        capsule, info = make_capsule(a)
        t = dl.consume(capsule)
        del capsule
        views: list[np.ndarray[Any, Any]] = []

        def view(t: dl.DLPackTensor = t, views: Any = views) -> None:
            with contextlib.suppress(BufferError):
                views.append(t.numpy())

        race(view, t.close)
        if views:
            assert info.calls == 0, "a view exists but the deleter already ran"
            assert views[0].sum() == 15.0
        views.clear()
        del t, view  # the function's default argument holds the tensor too
        assert info.calls == 1


def test_close_racing_close(make_capsule: Any, fast_switches: None) -> None:
    a = np.arange(6.0)
    for _ in range(TRIALS):
        capsule, info = make_capsule(a)
        t = dl.consume(capsule)
        del capsule
        race(t.close, t.close, t.close)
        assert info.calls == 1
        del t
        assert info.calls == 1


# ================================================================================================
# Item 4: fork() while another thread sweeps


FORK_WHILE_SWEEPING = """
import os, sys, threading, time
import numpy as np
import dlpack_ctypes as dl

a = np.zeros(4)
stop = False

def sweeper():
    while not stop:
        capsules = [dl.to_dlpack(a) for _ in range(200)]
        del capsules
        dl.flush()

thread = threading.Thread(target=sweeper, daemon=True)
thread.start()
hung = 0
for i in range(60):
    pid = os.fork()
    if pid == 0:
        dl.live_exports()
        dl.flush()
        dl.to_dlpack(a)
        sys.exit(0)  # runs the atexit flush as well
    deadline = time.monotonic() + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, status
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            hung += 1
            break
        time.sleep(0.005)
    if hung:
        break
stop = True
thread.join()
print("hung" if hung else "ok")
"""


def test_fork_while_sweeping(run_python: Any) -> None:
    result = run_python(FORK_WHILE_SWEEPING, timeout=240, dev_mode=False,
                        warnings_as_errors=False)
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr[-2000:]


FORK_CUDA_FACADE = """
import os, threading, time
from pb_tensor import cuda
from pb_tensor.cuda import _backend

class Runtime:
    pass

cuda.set_runtime(Runtime())
backend = _backend.active_backend()
held = threading.Event()
release = threading.Event()

def holder():
    with _backend._lock, backend.lock:
        held.set()
        release.wait()

thread = threading.Thread(target=holder)
thread.start()
held.wait()
pid = os.fork()
if pid == 0:
    cuda.set_runtime(None)  # takes the module lock
    backend.check_fork()    # takes the backend lock
    os._exit(0)
release.set()
thread.join()
deadline = time.monotonic() + 10
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("ok" if os.waitstatus_to_exitcode(status) == 0 else "failed")
        break
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("hung")
        break
    time.sleep(0.005)
"""


def test_fork_while_cuda_facade_locked(run_python: Any) -> None:
    result = run_python(FORK_CUDA_FACADE, timeout=120, dev_mode=False, warnings_as_errors=False)
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr[-2000:]


# ================================================================================================
# Items 7 and 8: bounded sweeps, bounded queue


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_gc_sweep_work_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    state = sweep_state()
    examined = [0]
    real = state._getrefcount

    def counting(obj: object) -> int:
        examined[0] += 1
        return int(real(obj)) + 1  # + 1: this wrapper's own argument

    a = np.zeros(1)
    held = [dl.to_dlpack(a) for _ in range(5000)]
    monkeypatch.setattr(state, "_getrefcount", counting)
    for _ in range(20):
        examined[0] = 0
        gc.collect(0)
        # A collection examines a bounded number of held capsules, not all 5,000.
        assert examined[0] <= 64, examined[0]
    monkeypatch.undo()
    del held
    # Dropped capsules are still released by collections alone.
    for _ in range(40000):
        gc.collect(0)
        if pending() == 0:
            break
    assert pending() == 0
    assert dl.live_exports() == 0


def test_pending_queue_bounded_after_a_held_batch(no_gc: None) -> None:
    a = np.zeros(1)
    batch = 5000
    held = [dl.to_dlpack(a) for _ in range(batch)]
    dl.flush()
    del held  # now all dropped, none swept yet (garbage collection is off)
    most = 0
    for _ in range(2 * batch):
        dl.to_dlpack(a)
        most = max(most, pending())
    # The queue never grows past the batch (plus the documented limit) and drains back to the
    # limit, instead of letting dropped exports pile up to twice the earlier batch.
    assert most <= batch + dl.producer.SWEEP_LIMIT, most
    assert pending() <= dl.producer.SWEEP_LIMIT + dl.producer.EXPORT_SWEEP_STEP
    assert dl.live_exports() == 0


def test_held_capsules_cost_bounded_work_per_export(monkeypatch: pytest.MonkeyPatch,
                                                    no_gc: None) -> None:
    state = sweep_state()
    examined = [0]
    real = state._getrefcount

    def counting(obj: object) -> int:
        examined[0] += 1
        return int(real(obj)) + 1

    a = np.zeros(1)
    held = [dl.to_dlpack(a) for _ in range(3000)]
    monkeypatch.setattr(state, "_getrefcount", counting)
    for _ in range(100):
        examined[0] = 0
        capsule = dl.to_dlpack(a)
        held.append(capsule)
        assert examined[0] <= 8, examined[0]
    monkeypatch.undo()
    del held, capsule
    assert dl.live_exports() == 0


# ================================================================================================
# Item 10: exports carry the array's real strides, also for size-1 dimensions


def size_one_arrays() -> list[np.ndarray[Any, Any]]:
    base = np.arange(48, dtype=np.float64).reshape(12, 4)
    return [
        base[::3][:1],  # (1, 4), byte strides (96, 8): C-contiguous for numpy
        base[:, 1:2],  # (12, 1), strides (32, 32)
        base[::6, :1],  # (2, 1)
        base[5:6, 2:3],  # (1, 1)
        base.T[:1],  # (1, 12) F-order row
    ]


@pytest.mark.parametrize("index", range(5))
def test_size_one_strides_match_numpy_exporter(index: int) -> None:
    x = size_one_arrays()[index]
    expected = tuple(s // x.itemsize for s in x.strides)  # the array's real strides
    numpys = dl.consume(x.__dlpack__(max_version=(1, 3))).strides
    # numpy >= 2.4 exports the real strides too; older numpy normalises size-1 dimensions of
    # C-contiguous arrays (the difference this item removes from our exports).
    assert numpys == expected or np.lib.NumpyVersion(np.__version__) < "2.4.0"
    for capsule in (
        dl.to_dlpack(x, max_version=(1, 3)),
        dl.to_dlpack(x),
        dl.BufferExporter.from_numpy(x).__dlpack__(max_version=(1, 3)),
    ):
        t = dl.consume(capsule, legacy_writable=True)
        assert t.strides == expected
        np.testing.assert_array_equal(t.numpy(), x)


def test_size_one_strides_seen_by_torch() -> None:
    torch = pytest.importorskip("torch")
    x = size_one_arrays()[0]
    theirs = torch.from_dlpack(x)
    ours = torch.from_dlpack(dl.BufferExporter.from_numpy(x))
    assert ours.stride() == theirs.stride() == (12, 1)


# ================================================================================================
# Item 12 (DLPackTensor): addresses and byte strides that do not fit are rejected at consume


def test_data_plus_byte_offset_overflow_rejected(make_capsule: Any) -> None:
    a = np.arange(4.0)
    capsule, info = make_capsule(a, data=2**64 - 16, byte_offset=64)
    with pytest.raises(BufferError, match=r"does not fit a 64-bit address"):
        dl.consume(capsule)
    del capsule
    assert info.calls == 1


def test_byte_stride_overflow_rejected(make_capsule: Any) -> None:
    a = np.arange(4.0)
    capsule, info = make_capsule(a, shape=(2, 2), strides=(2**61, 1))
    with pytest.raises(BufferError, match=r"byte stride 2305843009213693952 \* 8 does not fit"):
        dl.consume(capsule)
    capsule2, info2 = make_capsule(a, shape=(2,), strides=(-(2**60),))
    with pytest.raises(BufferError, match=r"does not fit 64 bits"):
        dl.consume(capsule2)
    del capsule, capsule2
    assert (info.calls, info2.calls) == (1, 1)


# ================================================================================================
# Item 14: to_dlpack() and the Tensor's reference count (documented difference)


def test_tensor_to_dlpack_keeps_data_not_tensor() -> None:
    from pb_tensor import Tensor

    a = np.arange(6, dtype=np.float32)
    t = Tensor("x", a)
    before = sys.getrefcount(t)
    capsule = t.to_dlpack()
    # Upstream adds a reference to the Tensor; here the capsule keeps the data's owner alive.
    assert sys.getrefcount(t) == before
    del t
    back = dl.consume(capsule, legacy_writable=True).numpy()
    np.testing.assert_array_equal(back, np.arange(6, dtype=np.float32))
    assert np.shares_memory(back, a)
