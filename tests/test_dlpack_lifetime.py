"""dlpack_ctypes lifetime: every deleter runs exactly once, on every path, on any thread.

Our producer's deleter is observed through ``live_exports()`` and weak references to the exported
owner; foreign deleters through the counting deleter of the hand-built capsules in conftest.py
(``make_capsule``; its teardown also checks that every hand-built tensor was released exactly
once). Crash-prone cases (interpreter exit, native threads) run in a subprocess.
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from typing import Any

import numpy as np
import pytest

import dlpack_ctypes as dl
from dlpack_ctypes import DataType


class Owner(np.ndarray):  # type: ignore[type-arg]
    """A weak-referenceable owner: ndarray subclass instances get a ``__dict__``."""


def owned(n: int = 6) -> tuple[Owner, weakref.ref[Owner]]:
    a = np.arange(n, dtype=np.float64).view(Owner)
    return a, weakref.ref(a)


class Holder:
    """Hands a given capsule to a consumer that only accepts producers (numpy)."""

    def __init__(self, capsule: object) -> None:
        self.capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> object:
        capsule, self.capsule = self.capsule, None
        return capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def run_in_thread(fn: Any) -> int:
    """Run ``fn`` on a new Python thread; returns that thread's ident."""
    errors: list[BaseException] = []
    ident: list[int] = []

    def body() -> None:
        ident.append(threading.get_ident())
        try:
            fn()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    return ident[0]


# ------------------------------------------------------------------------------------------------
# Our producer


def test_consumed_by_our_consumer() -> None:
    a, ref = owned()
    capsule = dl.to_dlpack(a, max_version=(1, 3))
    del a
    t = dl.consume(capsule)
    del capsule
    assert dl.live_exports() == 1
    v = t.numpy()
    del t
    assert dl.live_exports() == 1  # the view keeps it alive
    assert ref() is not None
    v[0] = 5.0
    del v
    assert dl.live_exports() == 0
    assert ref() is None


def test_consumed_by_numpy() -> None:
    a, ref = owned()
    b = np.from_dlpack(dl.BufferExporter.from_numpy(a))
    del a
    assert dl.live_exports() == 1
    assert ref() is not None
    assert b[3] == 3.0
    del b
    assert dl.live_exports() == 0
    assert ref() is None


def test_unconsumed_capsule_released_at_flush() -> None:
    a, ref = owned()
    for version in (None, (1, 3)):
        capsule = dl.to_dlpack(a, max_version=version)
        assert dl.live_exports() == 1  # still referenced: a flush keeps it
        del capsule
        assert dl.flush() == 0
    exporter = dl.BufferExporter.from_numpy(a)
    exporter.__dlpack__(max_version=(1, 0))  # result dropped at once
    del exporter, a
    assert ref() is not None  # pending until a sweep
    assert dl.flush() == 0
    assert ref() is None


def test_unconsumed_capsule_released_after_gc() -> None:
    a, ref = owned()
    capsule = dl.to_dlpack(a)
    del a, capsule
    assert ref() is not None
    gc.collect()  # the gc callback sweeps
    assert ref() is None


def test_unconsumed_capsules_released_during_exports() -> None:
    a, ref = owned()
    gc.disable()
    try:
        capsules = [dl.to_dlpack(a) for _ in range(10)]
        del a, capsules
        assert ref() is not None
        keep = np.zeros(1)
        for _ in range(200):  # passes the sweep threshold: dropped capsules are swept
            dl.to_dlpack(keep)
        assert ref() is None
    finally:
        gc.enable()


def test_consumed_capsule_not_released_by_sweep() -> None:
    # A renamed (consumed) capsule belongs to its consumer: dropping it must not free the data.
    a, ref = owned()
    capsule = dl.to_dlpack(a, max_version=(1, 3))
    t = dl.consume(capsule)
    del capsule, a
    assert dl.flush() == 1
    gc.collect()
    assert ref() is not None
    assert t.numpy()[5] == 5.0
    del t
    assert ref() is None


def test_consumer_failure_our_capsule() -> None:
    # Our consumer rejects it before renaming: the producer (the sweep) frees it.
    a, ref = owned()
    capsule = dl.export_buffer(a, a.__array_interface__["data"][0], (6,), None,
                               DataType(99, 8, 1))
    del a
    with pytest.raises(BufferError, match=r"invalid DLPack tensor: unknown dtype code 99"):
        dl.consume(capsule)
    assert ref() is not None
    del capsule
    assert dl.flush() == 0
    assert ref() is None


def test_dlpack_tensor_dropped_without_view(make_capsule: Any) -> None:
    a, ref = owned()
    capsule = dl.to_dlpack(a, max_version=(1, 3))
    del a
    dl.consume(capsule)  # result dropped at once
    assert ref() is None
    capsule, info = make_capsule(np.zeros(3))
    dl.consume(capsule)
    assert info.calls == 1


def test_copy_export_owns_its_copy() -> None:
    a, ref = owned()
    t = dl.from_dlpack(dl.BufferExporter.from_numpy(a), copy=True)
    del a
    assert ref() is None  # a copy does not keep the source alive
    assert dl.live_exports() == 1
    assert t.numpy().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    del t
    assert dl.live_exports() == 0


# ------------------------------------------------------------------------------------------------
# Our consumer with a foreign (counting) deleter


@pytest.mark.parametrize("version", [(1, 3), None])
def test_consume_calls_deleter_once(make_capsule: Any, version: tuple[int, int] | None) -> None:
    a = np.arange(4.0)
    capsule, info = make_capsule(a, version=version)
    t = dl.consume(capsule)
    used = b"used_dltensor_versioned" if version else b"used_dltensor"
    assert make_capsule.name(capsule) == used
    v = t.numpy()
    del t
    assert info.calls == 0
    del v
    assert info.calls == 1
    del capsule  # the destructor sees the used_ name and does nothing
    gc.collect()
    assert info.calls == 1


def test_numpy_consumer_calls_deleter_once(make_capsule: Any) -> None:
    a = np.arange(4.0)
    capsule, info = make_capsule(a)
    b = np.from_dlpack(Holder(capsule))
    del capsule
    assert info.calls == 0
    assert b.tolist() == [0.0, 1.0, 2.0, 3.0]
    del b
    assert info.calls == 1


def test_unconsumed_hand_built_capsule(make_capsule: Any) -> None:
    capsule, info = make_capsule(np.arange(4.0))
    assert info.calls == 0
    del capsule  # the C-style destructor calls the deleter
    assert info.calls == 1


def test_null_deleter(make_capsule: Any) -> None:
    a = np.arange(3.0)
    capsule, info = make_capsule(a, deleter=False)
    v = dl.consume(capsule).numpy()
    assert v.tolist() == [0.0, 1.0, 2.0]
    del v, capsule
    gc.collect()
    assert info.calls == 0


INVALID = [
    ({"dtype": (99, 8, 1)}, r"unknown dtype code 99"),
    ({"dtype": (2, 7, 1)}, r"dtype code 2 with bits=7 lanes=1 is not valid"),
    ({"dtype": (6, 1, 1)}, r"dtype code 6 with bits=1 lanes=1 is not valid"),
    ({"dtype": (2, 32, 0)}, r"dtype code 2 with bits=32 lanes=0 is not valid"),
    ({"device": (99, 0)}, r"unknown device type 99"),
    ({"device": (0, 0)}, r"unknown device type 0"),
    ({"ndim": -1}, r"ndim=-1 outside \[0, 64\]"),
    ({"ndim": 65}, r"ndim=65 outside \[0, 64\]"),
    ({"null_shape": True}, r"NULL shape with ndim=1"),
    ({"shape": (2, -3)}, r"negative dimension in shape=\(2, -3\)"),
    ({"data": 0}, r"NULL data pointer with shape=\(4,\)"),
    ({"data": 0, "shape": ()}, r"NULL data pointer for a 0-d tensor"),
]


@pytest.mark.parametrize("version", [(1, 3), None])
@pytest.mark.parametrize(("fields", "message"), INVALID, ids=[m for _, m in INVALID])
def test_validation_failure_leaves_capsule_to_producer(
    make_capsule: Any, fields: dict[str, Any], message: str, version: tuple[int, int] | None
) -> None:
    a = np.arange(4.0)
    capsule, info = make_capsule(a, **{"shape": (4,), **fields, "version": version})
    fresh = make_capsule.name(capsule)
    with pytest.raises(BufferError, match=rf"invalid DLPack tensor: {message}"):
        dl.consume(capsule)
    with pytest.raises(BufferError, match=message):
        dl.from_dlpack(capsule)
    assert make_capsule.name(capsule) == fresh  # not renamed
    assert info.calls == 0
    del capsule  # its producer (destructor) frees it
    assert info.calls == 1


def test_unsupported_major_version(make_capsule: Any) -> None:
    # Everything after ``flags`` is garbage: a consumer must not read it for major != 1.
    capsule, info = make_capsule(
        np.arange(4.0), version=(2, 0), ndim=7, null_shape=True, dtype=(255, 3, 0),
        device=(1234, 5),
    )
    with pytest.raises(
        BufferError, match=r"unsupported DLPack version: 2.0; this consumer understands 1.x"
    ):
        dl.consume(capsule)
    assert make_capsule.name(capsule) == b"dltensor_versioned"
    capsule2, info2 = make_capsule(np.arange(4.0), version=(0, 9))
    with pytest.raises(BufferError, match=r"unsupported DLPack version: 0.9"):
        dl.consume(capsule2)
    assert info.calls == info2.calls == 0
    del capsule, capsule2
    assert info.calls == info2.calls == 1


def test_check_callback_raising_leaves_capsule_unconsumed(make_capsule: Any) -> None:
    a = np.arange(6.0)
    capsule, info = make_capsule(a, shape=(2, 3))
    seen: list[dl.DLPackTensor] = []

    def check(t: dl.DLPackTensor) -> None:
        seen.append(t)
        if t.shape != (3, 2):
            raise ValueError(f"wrong shape {t.shape}")

    with pytest.raises(ValueError, match=r"wrong shape \(2, 3\)"):
        dl.consume(capsule, check=check)
    assert make_capsule.name(capsule) == b"dltensor_versioned"
    assert seen[0].released  # the rejected tensor never owned anything
    seen.clear()
    assert info.calls == 0
    # Still consumable.
    t = dl.from_dlpack(capsule, check=lambda t: None)
    assert t.numpy().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    del t
    assert info.calls == 1


def test_check_callback_with_our_producer() -> None:
    a, ref = owned()

    def reject(t: dl.DLPackTensor) -> None:
        raise BufferError("rejected by check")

    with pytest.raises(BufferError, match="rejected by check"):
        dl.from_dlpack(dl.BufferExporter.from_numpy(a), check=reject)
    del a
    assert dl.flush() == 0
    assert ref() is None


def test_close_without_views(make_capsule: Any) -> None:
    capsule, info = make_capsule(np.arange(4.0))
    t = dl.consume(capsule)
    keep = t  # a second reference: close() must release regardless
    t.close()
    assert info.calls == 1  # immediately, no gc needed
    assert keep.closed
    t.close()  # idempotent
    assert info.calls == 1
    with pytest.raises(BufferError, match=r"the tensor was closed"):
        t.numpy()


def test_close_with_live_views(make_capsule: Any) -> None:
    a = np.arange(4.0)
    capsule, info = make_capsule(a)
    t = dl.consume(capsule)
    v1 = t.numpy()
    v2 = t.numpy()[1:]
    t.close()
    assert info.calls == 0  # the views still use the memory
    with pytest.raises(BufferError, match=r"the tensor was closed"):
        t.numpy()
    del v1
    assert info.calls == 0
    assert v2.tolist() == [1.0, 2.0, 3.0]
    del v2
    assert info.calls == 0  # t is still referenced here
    assert not t.released
    del t
    assert info.calls == 1


def test_context_manager_closes(make_capsule: Any) -> None:
    capsule, info = make_capsule(np.arange(4.0))
    with dl.consume(capsule) as t:
        assert not t.closed
        assert info.calls == 0
    assert info.calls == 1


# ------------------------------------------------------------------------------------------------
# Threads


def test_numpy_array_dropped_on_another_thread(make_capsule: Any) -> None:
    # numpy's internal capsule calls our counting deleter on the thread that drops the array.
    capsule, info = make_capsule(np.arange(4.0))
    box = [np.from_dlpack(Holder(capsule))]
    del capsule
    ident = run_in_thread(box.clear)
    assert info.threads == [ident]
    assert ident != threading.get_ident()


def test_our_export_released_on_another_thread() -> None:
    a, ref = owned()
    box: list[Any] = [np.from_dlpack(dl.BufferExporter.from_numpy(a))]
    box.append(dl.from_dlpack(dl.BufferExporter.from_numpy(a)).numpy())
    del a
    assert dl.live_exports() == 2
    run_in_thread(box.clear)
    assert dl.live_exports() == 0
    assert ref() is None


def test_foreign_deleter_called_from_another_thread(make_capsule: Any) -> None:
    # Our consumer's owner calls the producer's deleter on whichever thread drops the last view.
    capsule, info = make_capsule(np.arange(4.0))
    box = [dl.consume(capsule).numpy()]
    ident = run_in_thread(box.clear)
    assert info.threads == [ident]
    a = np.arange(5.0)
    base = sys.getrefcount(a)
    box = [dl.from_dlpack(a).numpy()]  # numpy's deleter, called by our owner on the thread
    run_in_thread(box.clear)
    assert sys.getrefcount(a) == base


def test_concurrent_exports_and_sweeps() -> None:
    a, ref = owned(64)
    box = [a]
    del a

    def work() -> None:
        a = box[0]
        for i in range(300):
            capsule = dl.to_dlpack(a, max_version=(1, 3) if i % 2 else None)
            if i % 3 == 0:
                b = np.from_dlpack(dl.BufferExporter.from_numpy(a))
                assert b[7] == 7.0
            elif i % 3 == 1:
                assert dl.consume(capsule).numpy()[9] == 9.0
            del capsule

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    box.clear()
    assert dl.live_exports() == 0
    assert ref() is None


# ------------------------------------------------------------------------------------------------
# Subprocess: native threads, interpreter exit, shared prototypes


def test_deleter_called_from_native_pthread(run_python: Any) -> None:
    # pthread_create is given our deleter's C address as the start routine (``void (*)(void*)``
    # called as ``void *(*)(void*)``: the ignored return register is harmless on the 64-bit ABIs
    # we support), so a brand-new native thread with no Python frame calls it directly. The main
    # thread waits in pthread_join through a CFUNCTYPE, which releases the GIL.
    if not sys.platform.startswith("linux"):
        pytest.skip("pthread via ctypes.CDLL(None) is tested on Linux")
    code = """
    import ctypes, sys, weakref
    import numpy as np
    import dlpack_ctypes as dl
    from dlpack_ctypes import abi

    libc = ctypes.CDLL(None)
    pthread_create = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
    )(("pthread_create", libc))
    pthread_join = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
        ("pthread_join", libc))
    get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p)(
        ("PyCapsule_SetName", ctypes.pythonapi))
    USED = {b"dltensor": ctypes.create_string_buffer(b"used_dltensor"),
            b"dltensor_versioned": ctypes.create_string_buffer(b"used_dltensor_versioned")}

    class Owner(np.ndarray):
        pass

    for name, version, struct in ((b"dltensor_versioned", (1, 3), abi.DLManagedTensorVersioned),
                                  (b"dltensor", None, abi.DLManagedTensor)):
        a = np.arange(6.0).view(Owner)
        ref = weakref.ref(a)
        base = sys.getrefcount(a)
        capsule = dl.to_dlpack(a, max_version=version)
        # Act as a C consumer: take the pointer and rename the capsule.
        ptr = get_pointer(capsule, name)
        assert set_name(capsule, ctypes.addressof(USED[name])) == 0
        deleter = struct.from_address(ptr).deleter
        assert deleter
        assert dl.live_exports() == 1
        tid = ctypes.c_ulong()
        assert pthread_create(ctypes.byref(tid), None, deleter, ptr) == 0
        assert pthread_join(tid.value, None) == 0
        # Only the deleter can have released it: the capsule was renamed.
        assert dl.live_exports() == 0, dl.live_exports()
        assert sys.getrefcount(a) == base
        del capsule, a
        assert ref() is None
    print("ok")
    """
    result = run_python(code)
    assert (result.returncode, result.stderr, result.stdout) == (0, "", "ok\n")


EXIT_SCRIPT = """
import sys
import numpy as np
import dlpack_ctypes as dl

a = np.arange(12, dtype=np.float32).reshape(3, 4)
unconsumed = [dl.to_dlpack(a), dl.to_dlpack(a, max_version=(1, 3)),
              dl.BufferExporter.from_numpy(a).__dlpack__(max_version=(1, 0))]
numpy_views = [np.from_dlpack(dl.BufferExporter.from_numpy(a)) for _ in range(3)]
ours_of_numpy = dl.from_dlpack(a)
ours_of_numpy_view = ours_of_numpy.numpy()
ours_of_ours = dl.from_dlpack(dl.BufferExporter.from_numpy(a))
ours_of_ours_view = ours_of_ours.numpy()
closed_with_view = dl.from_dlpack(a)
closed_view = closed_with_view.numpy()
closed_with_view.close()
consumed_capsule = dl.to_dlpack(a, max_version=(1, 3))
consumed = dl.consume(consumed_capsule)


class Cycle:
    pass


cycle = Cycle()
cycle.self = cycle
cycle.keep = [dl.to_dlpack(a), np.from_dlpack(dl.BufferExporter.from_numpy(a)),
              dl.from_dlpack(a), dl.from_dlpack(dl.BufferExporter.from_numpy(a)).numpy()]
del cycle
dropped = dl.to_dlpack(a)
del dropped  # pending, never swept before exit
assert dl._blocks.LIVE, "exports must still be alive at exit for this test"

mode = sys.argv[1]
if mode == "raise":
    def fail(keep=(unconsumed, numpy_views, ours_of_numpy_view)):
        local_capsule = dl.to_dlpack(a)
        local_view = np.from_dlpack(dl.BufferExporter.from_numpy(a))
        local_ours = dl.from_dlpack(a).numpy()
        raise RuntimeError("boom at exit")

    fail()
elif mode == "exit_in_except":
    try:
        raise KeyError("pending")
    except KeyError:
        sys.exit(0)
elif mode == "exit_in_finally":
    try:
        raise KeyError("pending")
    finally:
        local = dl.to_dlpack(a)
        sys.exit(0)
"""


@pytest.mark.parametrize("mode", ["normal", "exit_in_except", "exit_in_finally"])
def test_interpreter_exit_with_live_exports(run_python: Any, mode: str) -> None:
    result = run_python(EXIT_SCRIPT, mode)
    assert (result.returncode, result.stderr) == (0, "")


def test_interpreter_exit_with_uncaught_exception(run_python: Any) -> None:
    # The traceback of the user's exception is the only thing on stderr: no SystemError, no
    # "Exception ignored", no crash from deleters or sweeps during teardown.
    result = run_python(EXIT_SCRIPT, "raise")
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: boom at exit"
    assert result.stderr.count("Traceback") == 1
    for bad in ("SystemError", "Exception ignored", "Fatal Python error", "Segmentation"):
        assert bad not in result.stderr


def test_pythonapi_prototypes_untouched(run_python: Any) -> None:
    code = """
    import ctypes
    api = ctypes.pythonapi
    names = ["PyCapsule_New", "PyCapsule_GetPointer", "PyCapsule_SetName", "PyCapsule_GetName",
             "PyCapsule_IsValid", "Py_IncRef", "Py_DecRef", "PyErr_Fetch"]
    before = {n: (getattr(api, n).restype, getattr(api, n).argtypes) for n in names}
    assert before["PyCapsule_New"] == (ctypes.c_int, None), before["PyCapsule_New"]

    import numpy as np
    import dlpack_ctypes as dl

    a = np.arange(4.0)
    np.from_dlpack(dl.BufferExporter.from_numpy(a))
    dl.from_dlpack(a).numpy()
    dl.consume(dl.to_dlpack(a))
    dl.to_dlpack(a, max_version=(1, 3))
    assert dl.live_exports() == 0
    after = {n: (getattr(api, n).restype, getattr(api, n).argtypes) for n in names}
    assert after == before, (before, after)
    print("ok")
    """
    result = run_python(code)
    assert (result.returncode, result.stderr, result.stdout) == (0, "", "ok\n")



def test_runtime_needs_only_numpy(run_python: Any) -> None:
    # typing_extensions and ml_dtypes are not runtime dependencies: block both.
    code = """
    import sys
    sys.modules["typing_extensions"] = None
    sys.modules["ml_dtypes"] = None
    import numpy as np
    import dlpack_ctypes as dl

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert np.from_dlpack(dl.BufferExporter.from_numpy(a)).tolist() == a.tolist()
    assert dl.from_dlpack(a).numpy().tolist() == a.tolist()
    raw = np.array([0x3F80, 0x4000], dtype=np.uint16)  # bfloat16 1.0, 2.0
    t = dl.from_dlpack(dl.BufferExporter(raw, raw.ctypes.data, (2,), None, dl.DataType(4, 16)))
    assert dl.to_numpy_dtype(t.dtype) is None
    assert t.numpy(raw=True).tolist() == [0x3F80, 0x4000]
    try:
        t.numpy()
    except BufferError as exc:
        assert "install ml_dtypes" in str(exc)
    else:
        raise AssertionError("numpy() without ml_dtypes must raise")
    del t
    assert dl.live_exports() == 0
    assert "typing_extensions" not in sys.modules or sys.modules["typing_extensions"] is None
    print("ok")
    """
    result = run_python(code)
    assert (result.returncode, result.stderr, result.stdout) == (0, "", "ok\n")


def test_flush_from_a_finaliser_during_a_sweep_does_not_deadlock() -> None:
    # Dropping an export's owner during a sweep may run user code that calls flush().
    calls: list[int] = []

    class Owner:
        def __del__(self) -> None:
            calls.append(dl.flush())

    buf = np.zeros(4)
    capsule = dl.export_buffer(Owner(), buf.ctypes.data, (4,), None, dl.DataType(2, 64))
    del capsule
    dl.flush()
    assert len(calls) == 1


def test_stream_accepts_numpy_integers_and_rejects_bools() -> None:
    assert dl.negotiate((2, 0), stream=np.int64(7), max_version=(1, 0))[0]
    with pytest.raises(TypeError, match="stream must be an int"):
        dl.negotiate((2, 0), stream=True)


def test_buffer_exporter_rejects_unknown_device_types() -> None:
    buf = np.zeros(4)
    with pytest.raises(ValueError, match="unknown DLPack device type"):
        dl.BufferExporter(buf, buf.ctypes.data, (4,), None, dl.DataType(2, 64), (99, 0))
