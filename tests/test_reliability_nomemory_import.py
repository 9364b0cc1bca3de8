"""``_testcapi.set_nomemory(k, k + 1)`` around one import of a foreign capsule, k = 1 .. 160.

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
