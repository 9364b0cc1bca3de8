"""``_testcapi.set_nomemory(k, k + 1)`` around one import of a foreign capsule, k = 1 .. 160,
and around one sweep of dropped capsules.

Every failure reaches the caller as ``MemoryError`` (ctypes reports a failed argument
conversion as ``ctypes.ArgumentError: argument N: MemoryError``; the consumer's claim turns
that back into ``MemoryError``), and the producer's deleter runs exactly once. Where the failing
allocation is outside this package (the interpreter pushing the frame of a call into it),
CPython 3.11 itself keeps one reference to the call's arguments, so the tensor never dies: those
k are left out, as in ``tests/test_reliability_faults.py`` (docs/guarantees.md).
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import nomemory_skip_reason

NOMEMORY_IMPORT = r"""
import gc, os, sys, traceback
import numpy as np
import _testcapi
import dlpack_ctypes as dl
from conftest import build_capsule

PKG = os.path.dirname(dl.__file__) + os.sep
a = np.arange(12, dtype=np.float32).reshape(3, 4)
capsule, info = build_capsule(a)
dl.from_dlpack(capsule).numpy()  # load and warm every module of the path first
del capsule
failures = []
for k in range(1, 161):
    capsule, info = build_capsule(a)
    error = None
    inside = True
    _testcapi.set_nomemory(k, k + 1)
    try:
        view = dl.from_dlpack(capsule).numpy()
    except BaseException as exc:
        _testcapi.remove_mem_hooks()
        error = exc
        tb = exc.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        inside = tb.tb_frame.f_code.co_filename.startswith(PKG)
        traceback.clear_frames(exc.__traceback__)
    finally:
        _testcapi.remove_mem_hooks()
    view = capsule = None
    if error is not None:
        gc.collect()  # only cycles (the traceback's) can still hold the tensor
    if error is not None and type(error) is not MemoryError:
        failures.append(f"k={k}: {type(error).__name__}: {error}")
    elif inside and info.calls != 1:
        failures.append(f"k={k}: deleter ran {info.calls} times after {error!r}")
print("\n".join(failures) or "ok")
"""


def test_memory_error_importing_a_foreign_capsule(run_python: Any) -> None:
    reason = nomemory_skip_reason()
    if reason:
        pytest.skip(reason)
    result = run_python(NOMEMORY_IMPORT, timeout=300, dev_mode=False, warnings_as_errors=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "ok\n", result.stdout[-3000:]


# The sweep holds its lock in a `with` statement. Calling the lock's __exit__ (a C method taking
# its three arguments as a tuple) allocates that tuple; with the 3-tuple free list drained, a
# MemoryError there skipped the exit and left the lock held by this thread, and the next sweep
# of any other thread (an export past SWEEP_LIMIT pending capsules, flush(), live_exports())
# waited for ever. Each allocation of one flush() fails in turn; then another thread's flush()
# must return.
NOMEMORY_SWEEP = r"""
import threading, _testcapi
import numpy as np
import dlpack_ctypes as dl
from dlpack_ctypes import _blocks

a = np.arange(4, dtype=np.float32)
dl.flush()
failed, held = 0, []
for k in range(80):
    dropped = [dl.BufferExporter.from_numpy(a).__dlpack__() for _ in range(3)]
    del dropped  # three capsules for the sweep to release
    drained = [tuple([i, i, i]) for i in range(3000)]
    _testcapi.set_nomemory(k, k + 1)
    try:
        dl.flush()
    except MemoryError:
        failed += 1
    finally:
        _testcapi.remove_mem_hooks()
    del drained
    if _blocks._is_owned():
        held.append(k)
        break
    dl.flush()  # the same queue, so the same allocations, for every k

worker = threading.Thread(target=dl.flush, daemon=True)
worker.start()
worker.join(30)
print(failed > 3, held, worker.is_alive(), dl.live_exports())
"""


def test_memory_error_in_the_sweeps_lock_exit_leaves_the_lock_free(run_python: Any) -> None:
    reason = nomemory_skip_reason()
    if reason:
        pytest.skip(reason)
    result = run_python(NOMEMORY_SWEEP, timeout=120, dev_mode=False, warnings_as_errors=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "[]", "False", "0"], result.stdout
