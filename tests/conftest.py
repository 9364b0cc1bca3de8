"""Shared pytest fixtures and helpers.

Sections (add new ones at the end, each under its own banner):

1. dlpack_ctypes leak check: an autouse fixture asserting that no export is alive after a test.
2. Hand-built DLPack capsules: ``make_capsule`` builds a capsule with plain ctypes, independently
   of ``dlpack_ctypes``' producer, with a counting deleter and a C-style capsule destructor.
3. Subprocess runner: ``run_python`` for crash-prone cases (exit, native threads ...).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import glob
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from cuda_fake import FakeCudaRuntime

import dlpack_ctypes
from dlpack_ctypes import abi
from pb_tensor import cuda


def _have_protobuf() -> bool:
    try:
        import google.protobuf  # noqa: F401
    except ImportError:
        return False
    return True


# The model runtime reads config.pbtxt with protobuf (the [runtime] extra). Where it is not
# installed (the numpy-only wheel check), the modules that load models are not collected;
# test_runtime_cli.py still checks what the command line says without protobuf.
collect_ignore = [] if _have_protobuf() else [
    *sorted(
        os.path.basename(path)
        for pattern in ("test_runtime_*.py", "test_upstream_*.py")
        for path in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), pattern))
        if os.path.basename(path) != "test_runtime_cli.py"
    ),
    "typing/test_runtime_types.py",
]

# Triton's own files (tests/upstream, byte-for-byte copies) are data for the tests that run them,
# never collected themselves: upstream's *_test.py files need a Triton server.
collect_ignore_glob = ["upstream/*"]

# Where the packages under test are imported from (the checkout, or site-packages when the
# tests run against an installed wheel), and this folder (cuda_fake, conftest helpers).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dlpack_ctypes.__file__)))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# ================================================================================================
# 1. dlpack_ctypes leak check


def _pool_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("pb_tensor_")}
    except OSError:
        return set()


def _orphaned(names: set[str]) -> set[str]:
    """The pool segments among ``names`` whose creator (the pid in the name) is gone."""
    found = set()
    for name in names:
        parts = name.split("_")
        if len(parts) < 4 or not parts[2].isdigit():
            continue
        pid = int(parts[2])
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            found.add(name)
    return found


_SEGMENTS_AT_START = _pool_segments()
# (test id, segment name) for each segment that a test left behind, its creator gone.
_SEGMENTS_LEFT: list[tuple[str, str]] = []
_SEGMENTS_REMOVED: list[str] = []


@pytest.fixture(autouse=True)
def _no_orphaned_segments(request: pytest.FixtureRequest) -> Iterator[None]:
    """Note the pool segments a test leaves in /dev/shm whose creator process is gone.

    A creator killed with SIGKILL cannot unlink its segment (documented behaviour, as in
    Triton); tests that do that on purpose unlink the names themselves (see
    ``unlink_segments_of``). What is still left is reported at the end of the session.
    """
    before = _pool_segments()
    yield
    for name in sorted(_orphaned(_pool_segments() - before)):
        _SEGMENTS_LEFT.append((request.node.nodeid, name))


def unlink_segments_of(pids: Iterable[int]) -> list[str]:
    """Unlink the pool segments created by the (dead) processes ``pids``; their names.

    For tests that SIGKILL a pool's creator: its segment outlives it by design.
    """
    prefixes = tuple(f"pb_tensor_{pid}_" for pid in pids)
    removed = []
    for name in sorted(_pool_segments()):
        if name.startswith(prefixes):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
    return removed


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove the pool segments that tests' dead creator processes left in /dev/shm.

    Only names that appeared during this session and whose creator process (the pid in the
    name) is gone are removed; the terminal summary lists them with the tests that left them.
    """
    for name in sorted(_orphaned(_pool_segments() - _SEGMENTS_AT_START)):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", name))
            _SEGMENTS_REMOVED.append(name)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    """Warn (not fail) about pool segments the session had to remove for its tests.

    The test named is the one during which the segment appeared: where other sessions share
    /dev/shm at the same time, one of theirs can show up here too.
    """
    if not _SEGMENTS_REMOVED:
        return
    left = dict((name, test) for test, name in _SEGMENTS_LEFT)
    terminalreporter.section("shared-memory segments left by tests", sep="-", yellow=True)
    for name in _SEGMENTS_REMOVED:
        terminalreporter.line(
            f"WARNING: removed /dev/shm/{name} (its creator is gone); it appeared during "
            f"{left.get(name, 'no single test')}",
            yellow=True,
        )


@pytest.fixture(autouse=True)
def _dlpack_no_live_exports() -> Iterator[None]:
    """Every test must leave ``dlpack_ctypes.live_exports() == 0`` behind (after a gc)."""
    before = dlpack_ctypes.live_exports()
    yield
    live = dlpack_ctypes.live_exports()
    if live:
        # Only cycles can still hold exports; a full collection costs ~0.2 s once torch and JAX
        # are loaded, so it runs only when needed.
        gc.collect()
        live = dlpack_ctypes.live_exports()
    assert live == 0, (
        f"dlpack_ctypes leak: {live} export(s) still alive after the test (gc.collect() and "
        f"flush() done): a deleter did not run, or the test kept a capsule, array or "
        f"DLPackTensor alive in a global. Live before the test: {before}"
        + (" (an earlier test leaked)" if before else "")
    )


# ================================================================================================
# 2. Hand-built DLPack capsules

VOIDFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api = ctypes.pythonapi
# Private prototypes: never set argtypes/restype on ctypes.pythonapi.X (shared by the process).
_PyCapsule_New = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)(("PyCapsule_New", _api))
_PyCapsule_GetName = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", _api)
)
_PyCapsule_SetName = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p)(
    ("PyCapsule_SetName", _api)
)
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_void_p)(
    ("PyCapsule_GetPointer", _api)
)
# Raw-address variants for the capsule destructor: the dying capsule's refcount is already 0, so
# it must not be passed as py_object (that would INCREF/DECREF it back into dealloc).
_PyCapsule_GetName_raw = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_GetName", _api)
)
_PyCapsule_GetPointer_raw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(
    ("PyCapsule_GetPointer", _api)
)
_Py_IncRef = ctypes.PYFUNCTYPE(None, ctypes.py_object)(("Py_IncRef", _api))


def _immortal(obj: Any) -> Any:
    """Leak one reference: C may hold pointers to ``obj`` until the process ends."""
    _Py_IncRef(obj)
    return obj


# Capsule names must outlive every capsule pointing at them: immortal buffers.
_NAMES: dict[bytes, ctypes.Array[ctypes.c_char]] = _immortal(
    {
        name: _immortal(ctypes.create_string_buffer(name))
        for name in (
            b"dltensor",
            b"dltensor_versioned",
            b"used_dltensor",
            b"used_dltensor_versioned",
            b"not_a_dltensor",
        )
    }
)


def _name_addr(name: bytes) -> int:
    buf = _NAMES.get(name)
    if buf is None:
        buf = _NAMES[name] = _immortal(ctypes.create_string_buffer(name))
    return ctypes.addressof(buf)


# struct address -> thread idents of every call of the counting deleter for it.
_DELETER_CALLS: dict[int, list[int]] = _immortal({})
# struct address -> the object owning the data, released by the deleter (like a real producer).
_DATA_OWNERS: dict[int, object] = _immortal({})
# Blocks (struct + shape + strides) are never freed, so no struct address is ever reused and a
# buggy second deleter call or late read is observable instead of a use-after-free.
_BLOCKS: list[object] = _immortal([])


def _counting_deleter_impl(
    addr: int | None,
    _calls: dict[int, list[int]] = _DELETER_CALLS,
    _owners: dict[int, object] = _DATA_OWNERS,
    _ident: Callable[[], int] = threading.get_ident,
) -> None:
    key = addr or 0
    _calls.setdefault(key, []).append(_ident())
    _owners.pop(key, None)


COUNTING_DELETER = _immortal(VOIDFN(_counting_deleter_impl))
COUNTING_DELETER_ADDRESS: int = ctypes.cast(COUNTING_DELETER, ctypes.c_void_p).value or 0

_LEGACY_DELETER_OFFSET = abi.DLManagedTensor.deleter.offset
_VERSIONED_DELETER_OFFSET = abi.DLManagedTensorVersioned.deleter.offset


def _capsule_destructor_impl(capsule: int | None) -> None:
    # What a C producer's destructor does (dlpack.md 5.1): call the deleter only if the capsule
    # still carries its fresh name, i.e. nobody consumed it.
    name = _PyCapsule_GetName_raw(capsule)
    if name == b"dltensor":
        offset = _LEGACY_DELETER_OFFSET
    elif name == b"dltensor_versioned":
        offset = _VERSIONED_DELETER_OFFSET
    else:
        return
    ptr = _PyCapsule_GetPointer_raw(capsule, _name_addr(name))
    deleter = ctypes.c_void_p.from_address(ptr + offset).value
    if deleter:
        VOIDFN(deleter)(ptr)


CAPSULE_DESTRUCTOR = _immortal(VOIDFN(_capsule_destructor_impl))
_CAPSULE_DESTRUCTOR_ADDRESS: int = ctypes.cast(CAPSULE_DESTRUCTOR, ctypes.c_void_p).value or 0

_KIND_CODE = {"b": 6, "i": 0, "u": 1, "f": 2, "c": 5}


def _c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


@dataclasses.dataclass(frozen=True)
class ManualInfo:
    """What a test needs to know about a hand-built capsule (it holds no reference to it)."""

    address: int  # of the DLManagedTensor[Versioned]
    data: int  # the DLTensor.data field (byte_offset not added)
    has_deleter: bool

    @property
    def calls(self) -> int:
        """How many times the deleter ran for this tensor."""
        return len(_DELETER_CALLS.get(self.address, ()))

    @property
    def threads(self) -> list[int]:
        """``threading.get_ident()`` of each deleter call."""
        return list(_DELETER_CALLS.get(self.address, ()))


def build_capsule(
    array: np.ndarray[Any, Any] | None = None,
    *,
    shape: Sequence[int] | None = None,
    strides: Sequence[int] | str | None = "c",
    dtype: tuple[int, int, int] | None = None,
    data: int | None = None,
    byte_offset: int = 0,
    device: tuple[int, int] = (1, 0),
    version: tuple[int, int] | None = (1, 3),
    flags: int = 0,
    ndim: int | None = None,
    null_shape: bool = False,
    deleter: bool = True,
    destructor: bool = True,
    name: bytes | None = None,
) -> tuple[Any, ManualInfo]:
    """Build a DLPack capsule by hand: one ctypes block ``[managed struct | shape | strides]``.

    Args:
        array: the memory (kept alive until the deleter runs); ``shape``/``dtype``/``data``
            default from it.
        strides: ``"c"`` for C-order strides, None for a NULL strides pointer, or the strides in
            elements.
        version: None for a legacy ``"dltensor"`` capsule, else ``"dltensor_versioned"`` with
            this version (any major, to test rejection).
        ndim: override ``DLTensor.ndim`` (to write invalid values); shape/strides arrays still
            follow ``shape``.
        null_shape: write a NULL shape pointer.
        deleter: False writes a NULL deleter.
        destructor: give the capsule a C-style destructor that calls the deleter when the capsule
            is dropped unconsumed, as C producers do. Being a ctypes callback, it cannot run while
            an exception is pending (dlpack.md 8.6): pass False for capsules handed to a C consumer
            that may reject them (numpy drops rejected capsules with its error set).
        name: override the capsule name.

    Returns:
        ``(capsule, info)``; ``info`` holds no reference to the capsule.
    """
    if array is not None:
        shape = array.shape if shape is None else shape
        if dtype is None:
            dtype = (_KIND_CODE[array.dtype.kind], array.dtype.itemsize * 8, 1)
        data = (array.__array_interface__["data"][0] or 0) if data is None else data
    shape = tuple(shape or ())
    dtype = dtype or (2, 32, 1)
    data = data or 0
    n = len(shape)
    head_type = abi.DLManagedTensorVersioned if version is not None else abi.DLManagedTensor
    head = ctypes.sizeof(head_type)
    block = (ctypes.c_char * (head + 16 * n))()
    _BLOCKS.append(block)
    addr = ctypes.addressof(block)
    dims = (ctypes.c_int64 * n).from_buffer(block, head)
    strd = (ctypes.c_int64 * n).from_buffer(block, head + 8 * n)
    dims[:] = shape
    if isinstance(strides, str):
        strd[:] = _c_strides(shape)
    elif strides is not None:
        strd[:] = tuple(strides)
    managed = head_type.from_buffer(block)
    tensor = managed.dl_tensor
    tensor.data = data
    tensor.device.device_type, tensor.device.device_id = device
    tensor.ndim = n if ndim is None else ndim
    tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = dtype
    if n and not null_shape:
        tensor.shape = ctypes.cast(addr + head, ctypes.POINTER(ctypes.c_int64))
    if n and strides is not None:
        tensor.strides = ctypes.cast(addr + head + 8 * n, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = byte_offset
    managed.deleter = COUNTING_DELETER_ADDRESS if deleter else None
    if version is not None:
        managed.version.major, managed.version.minor = version
        managed.flags = flags
    if array is not None:
        _DATA_OWNERS[addr] = array
    if name is None:
        name = b"dltensor_versioned" if version is not None else b"dltensor"
    capsule = _PyCapsule_New(
        addr, _name_addr(name), _CAPSULE_DESTRUCTOR_ADDRESS if destructor else None
    )
    return capsule, ManualInfo(addr, data, deleter)


def capsule_name(capsule: object) -> bytes | None:
    """The current name of a capsule (``used_...`` once consumed)."""
    name: bytes | None = _PyCapsule_GetName(capsule)
    return name


def capsule_pointer(capsule: object, name: bytes) -> int:
    """``PyCapsule_GetPointer`` (raises ValueError on a wrong name)."""
    ptr: int | None = _PyCapsule_GetPointer(capsule, _name_addr(name))
    return ptr or 0


def rename_capsule(capsule: object, name: bytes) -> None:
    """``PyCapsule_SetName`` with an immortal name string."""
    assert _PyCapsule_SetName(capsule, _name_addr(name)) == 0


class CapsuleFactory:
    """The ``make_capsule`` fixture: ``make_capsule(...)`` is :func:`build_capsule`."""

    name = staticmethod(capsule_name)
    pointer = staticmethod(capsule_pointer)
    rename = staticmethod(rename_capsule)
    deleter_address = COUNTING_DELETER_ADDRESS

    def __init__(self) -> None:
        self.created: list[ManualInfo] = []

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, ManualInfo]:
        capsule, info = build_capsule(*args, **kwargs)
        self.created.append(info)
        return capsule, info


@pytest.fixture
def make_capsule() -> Iterator[CapsuleFactory]:
    """Build DLPack capsules by hand; after the test, every one must be released exactly once."""
    factory = CapsuleFactory()
    yield factory
    if any(i.has_deleter and i.calls != 1 for i in factory.created):
        gc.collect()
    bad = [(hex(i.address), i.calls) for i in factory.created if i.has_deleter and i.calls != 1]
    assert not bad, (
        f"hand-built DLPack tensors not released exactly once by the end of the test "
        f"(struct address, deleter calls): {bad}"
    )


# ================================================================================================
# 3. Subprocess runner


def run_python_code(
    code: str,
    *args: str,
    timeout: float = 60,
    dev_mode: bool = True,
    warnings_as_errors: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (``-X dev -W error`` by default) with the repository
    and this folder (``cuda_fake``, ``conftest`` helpers) importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [REPO_ROOT, TESTS_DIR, env.get("PYTHONPATH")])
    )
    env.pop("PYTHONWARNINGS", None)
    flags = (["-X", "dev"] if dev_mode else []) + (["-W", "error"] if warnings_as_errors else [])
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO_ROOT,
        check=False,
    )


@pytest.fixture
def run_python() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_python(code, *argv, timeout=60)`` -> CompletedProcess (text, captured)."""
    return run_python_code


# ================================================================================================
# pb_tensor fixtures go below this line, in their own section.


# ================================================================================================
# 4. CUDA: the recording fake runtime


@pytest.fixture
def fake() -> Iterator[FakeCudaRuntime]:
    """Two fake GPUs installed as the CUDA runtime: device 0 current, the availability probe
    done and the call record cleared."""
    runtime = FakeCudaRuntime(devices=2)
    previous = cuda.set_runtime(runtime)
    try:
        assert cuda.is_available()
        runtime.take()
        yield runtime
    finally:
        cuda.set_runtime(previous)


@pytest.fixture
def real_cuda() -> Iterator[None]:
    """The cuda-python runtime (whatever a previous test installed), or a skip: the GPU test
    modules use it for every test."""
    previous = cuda.set_runtime(None)
    try:
        if not cuda.is_available():
            pytest.skip(cuda.unavailable_reason() or "no CUDA device")
        yield
    finally:
        cuda.set_runtime(previous)


# ================================================================================================
# 5. Producers


class ToDlpack:
    """A producer whose ``__dlpack__`` is ``dlpack_ctypes.to_dlpack`` (all kwargs forwarded)."""

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array
        self.calls: list[dict[str, Any]] = []

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return dlpack_ctypes.to_dlpack(self.array, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


# ================================================================================================
# 6. Allocation-failure injection (_testcapi.set_nomemory) and whether this interpreter survives it

# CPython 3.12.1 and 3.13.0 (seen on both) over-release a generator expression's code object
# when allocating the expression's function object fails, so the next use of that expression
# (or the next garbage collection) crashes. This program, which uses nothing of this project,
# shows it; where it crashes, no allocation-failure test can say anything about this package.
NOMEMORY_PROBE = """
import _testcapi

def f():
    return tuple(d for d in (1, 2))

_testcapi.set_nomemory(0, 1)  # fail the first allocation: the generator function object's
try:
    f()
except MemoryError:
    pass
finally:
    _testcapi.remove_mem_hooks()
f()
print("ok")
"""
_nomemory_skip: list[str | None] = []


def nomemory_skip_reason() -> str | None:
    """Why ``_testcapi.set_nomemory`` injection cannot run under this interpreter, or None."""
    if not _nomemory_skip:
        done = subprocess.run(
            [sys.executable, "-c", NOMEMORY_PROBE], capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        if done.returncode == 0 and done.stdout == "ok\n":
            _nomemory_skip.append(None)
        elif "_testcapi" in done.stderr and "Error" in done.stderr.splitlines()[-1]:
            _nomemory_skip.append("no _testcapi.set_nomemory in this build")
        else:
            _nomemory_skip.append(
                f"CPython {sys.version.split()[0]} itself crashes (exit {done.returncode}) "
                "under _testcapi.set_nomemory: a failed allocation of a generator expression's "
                "function object over-releases its code object (tests/conftest.py "
                "NOMEMORY_PROBE reproduces it without this project)"
            )
    return _nomemory_skip[0]
