"""Interpreter exit while other threads use the library: nothing at shutdown waits for a lock
another thread can hold (docs/guarantees.md, "Exit while other threads work").

Each scenario runs in a subprocess with a bounded timeout: before the fix the interpreter never
exited (the garbage collection of finalization waited for the sweep lock held by a daemon
thread that finalization had frozen; the CUDA facade's exit hook waited for the proxy-stream
lock held by a thread stuck in a driver call).
"""

from __future__ import annotations

import gc
import subprocess
import threading
from typing import Any

import numpy as np
import pytest

import dlpack_ctypes as dl
from dlpack_ctypes import _blocks

DAEMONS_USING_DLPACK = r"""
import sys, threading, time
import numpy as np
import dlpack_ctypes as dl
from pb_tensor import Tensor

a = np.arange(64, dtype=np.float32)
started = threading.Barrier(5)

def forever(step):
    started.wait()
    while True:
        step()

exporter = dl.BufferExporter.from_numpy(a)
steps = [
    lambda: dl.consume(exporter.__dlpack__(max_version=(1, 3))).numpy(),
    lambda: np.from_dlpack(exporter),
    lambda: np.from_dlpack(Tensor.from_dlpack("y", Tensor("x", a))),
    lambda: dl.from_dlpack(exporter).numpy(),
]
for step in steps:
    threading.Thread(target=forever, args=(step,), daemon=True).start()
started.wait()
time.sleep(float(sys.argv[1]))
print("main returns", flush=True)
"""


def test_exit_with_daemon_threads_using_dlpack(run_python: Any) -> None:
    # Before the fix this hung in 3 of 3 runs (killed by the timeout); now it exits at once.
    try:
        result = run_python(DAEMONS_USING_DLPACK, "0.5", timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the interpreter did not exit within 120 s while daemon threads used DLPack")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "main returns\n"


CUDA_STREAM_CREATION_STUCK = r"""
import threading
from cuda_fake import FakeCudaRuntime
from pb_tensor import cuda

stuck = threading.Event()

class StuckRuntime(FakeCudaRuntime):
    # Creating a stream on device 1 never returns: a driver call that hangs.
    def cudaStreamCreate(self):
        if self.current == 1:
            stuck.set()
            threading.Event().wait()
        return super().cudaStreamCreate()

runtime = StuckRuntime(devices=2, active=(0, 1))
cuda.set_runtime(runtime)
first = cuda.proxy_stream(0)  # registers the exit hook that destroys the proxy streams
threading.Thread(target=cuda.proxy_stream, args=(1,), daemon=True).start()
assert stuck.wait(60)
print("main returns", flush=True)
"""


def test_exit_while_a_thread_creates_a_cuda_proxy_stream(run_python: Any) -> None:
    # Before the fix the exit hook waited forever for the stream lock that the stuck thread holds.
    try:
        result = run_python(CUDA_STREAM_CREATION_STUCK, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the interpreter did not exit within 120 s: the CUDA exit hook waited")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "main returns\n"


def test_collection_never_waits_for_nor_releases_another_threads_sweep_lock() -> None:
    # A full collection sweeps a step while dropped capsules are pending; when another thread
    # holds the sweep lock it must neither wait for it nor release it.
    a = np.arange(4, dtype=np.float32)
    dropped = [dl.to_dlpack(a) for _ in range(8)]
    del dropped
    holding, done = threading.Event(), threading.Event()
    released: list[str] = []

    def hold() -> None:
        with _blocks._SWEEP_LOCK:
            holding.set()
            done.wait(60)
            released.append("holder")

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert holding.wait(60)
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(60)
    try:
        assert not collector.is_alive(), "gc.collect() waited for the sweep lock"
        free = _blocks._SWEEP_LOCK.acquire(blocking=False)
        if free:
            _blocks._SWEEP_LOCK.release()
        assert not free, "the collection released the holder's sweep lock"
    finally:
        done.set()
        holder.join(60)
    assert released == ["holder"]  # the holder's own release worked (nobody released it first)
    assert dl.flush() == 0
