"""What importing the packages loads, and that everything deferred loads correctly on first use.

Every check runs in a fresh interpreter (the test session itself has imported everything). No
timing is asserted here: ``benchmarks/bench_import.py`` measures the cost.
"""

from __future__ import annotations

import importlib.util
import platform
import subprocess
import sys
from collections.abc import Callable

import pytest

RunPython = Callable[..., "subprocess.CompletedProcess[str]"]

# Loaded only when a call needs them.
DEFERRED_BY_PB_TENSOR_IMPORT = (
    "pb_tensor.tensor",
    "pb_tensor.dtypes",
    "pb_tensor.errors",
    "pb_tensor.bytes_codec",
    "pb_tensor._pickling",
    "pb_tensor.shm",
    "pb_tensor.cuda",
    "pb_tensor.runtime",
    "pb_tensor.serve",
    "pb_tensor.utils",
    "dlpack_ctypes.consumer",
    "dlpack_ctypes.exporters",
    "dlpack_ctypes.exchange",
)
DEFERRED_BY_FIRST_TENSOR = (
    "pb_tensor.bytes_codec",
    "pb_tensor._bytes_join",
    "pb_tensor._bytes_split",
    "pb_tensor._bytes_lengths",
    "pb_tensor._pickling",
    "pb_tensor.shm",
    "pb_tensor.cuda",
    "pb_tensor.runtime",
    "pb_tensor.utils",
    "dlpack_ctypes._claim",
    "dlpack_ctypes._tensor",
    "dlpack_ctypes._views",
    "dlpack_ctypes.dtypes",
    "dlpack_ctypes.consumer",
    "dlpack_ctypes.producer",
    "dlpack_ctypes.exporters",
    "dlpack_ctypes.exchange",
)
# Standard-library modules numpy does not import and the common first uses must not either.
STDLIB_AVOIDED = ("threading", "sysconfig", "dataclasses", "zlib")
# What ``import dlpack_ctypes`` loads: the export registry, whose fork hook must be registered
# before the packages' own (see dlpack_ctypes/__init__.py), with what it needs. atexit and gc
# are built into the interpreter.
DLPACK_CTYPES_EAGER = {
    "dlpack_ctypes",
    "dlpack_ctypes._blocks",
    "dlpack_ctypes._capi",
    # the consumed tensors' registry, which the export registry's sweeps release (issue 22)
    "dlpack_ctypes._owned",
    "dlpack_ctypes.abi",
    "atexit",
    "gc",
}

# __future__ is loaded by any module's `from __future__ import` statement: counted as already
# there (some numpy installs load it, others do not).
_ADDED = """
import sys
import __future__
import numpy
before = set(sys.modules)
{statement}
added = sorted(set(sys.modules) - before)
print(" ".join(added))
"""


def _added_modules(run_python: RunPython, statement: str) -> set[str]:
    """The modules ``statement`` imports in a fresh interpreter that imported numpy first."""
    proc = run_python(_ADDED.format(statement=statement))
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


def _ok(run_python: RunPython, code: str, timeout: float = 120) -> str:
    proc = run_python(code, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# ------------------------------------------------------------------------------------------------
# What the imports load


def test_import_pb_tensor_loads_only_the_package_modules(run_python: RunPython) -> None:
    added = _added_modules(run_python, "import pb_tensor")
    assert added == {"pb_tensor", *DLPACK_CTYPES_EAGER}
    for name in DEFERRED_BY_PB_TENSOR_IMPORT:
        assert name not in added


# The serve extra's packages and the front door's modules: nothing but ``serve`` loads them.
SERVE_ONLY = ("uvicorn", "grpc", "httptools", "uvloop", "pb_tensor.serve._server",
              "pb_tensor.serve._core", "pb_tensor.serve._http", "pb_tensor.serve._grpc")


def test_runtime_plugin_and_command_line_leave_serve_out(run_python: RunPython) -> None:
    """The runtime, a model run in-process, the pytest plugin and the command line's parser
    never import the front door's server or its packages (the ``serve`` extra)."""
    pytest.importorskip("google.protobuf", reason="the runtime needs protobuf")
    added = _added_modules(run_python, (
        "from pb_tensor.runtime import ModelRepository, example_repository\n"
        "import pb_tensor.runtime.pytest_plugin\n"
        "from pb_tensor.cli import _parser\n"
        "_parser().parse_args(['serve', '--model-repository', 'x'])\n"
        "with ModelRepository(example_repository()) as repo:\n"
        "    repo.load('add_sub', isolated=False).infer("
        "{'INPUT0': [1.0], 'INPUT1': [2.0]})"
    ))  # fmt: skip
    assert "pb_tensor.runtime._model" in added
    assert sorted(m for m in added if m.split(".")[0] in SERVE_ONLY or m in SERVE_ONLY) == []


def test_import_dlpack_ctypes_loads_only_the_export_registry(run_python: RunPython) -> None:
    assert _added_modules(run_python, "import dlpack_ctypes") == DLPACK_CTYPES_EAGER


def test_first_tensor_leaves_the_deferred_modules_out(run_python: RunPython) -> None:
    added = _added_modules(
        run_python,
        'from pb_tensor import Tensor\nTensor("x", numpy.zeros(3, numpy.float32))',
    )
    assert "pb_tensor.tensor" in added
    assert sorted(set(DEFERRED_BY_FIRST_TENSOR) & added) == []
    assert sorted(set(STDLIB_AVOIDED) & added) == []
    # Nothing outside the two packages but the built-in atexit and gc: every standard-library
    # module it uses numpy loaded.
    outside = {m for m in added if m.split(".")[0] not in ("pb_tensor", "dlpack_ctypes")}
    assert outside == {"atexit", "gc"}


def test_first_from_dlpack_loads_the_consumer_only(run_python: RunPython) -> None:
    added = _added_modules(
        run_python,
        "import dlpack_ctypes\ndlpack_ctypes.from_dlpack(numpy.zeros(3, numpy.float32))",
    )
    assert {"dlpack_ctypes.consumer", "dlpack_ctypes._claim", "dlpack_ctypes.abi"} <= added
    assert "dlpack_ctypes.exporters" not in added
    assert "dlpack_ctypes.producer" not in added
    assert sorted(set(STDLIB_AVOIDED) & added) == []
    assert not any(m.startswith("pb_tensor") for m in added)


# ------------------------------------------------------------------------------------------------
# Every public name resolves, is listed, and is its defining module's object

PB_TENSOR_NAMES = {
    "TRITON_STRING_TO_NUMPY": "pb_tensor.dtypes",
    "MemoryType": "pb_tensor.dtypes",
    "Tensor": "pb_tensor.tensor",
    "TritonBufferError": "pb_tensor.errors",
    "TritonDtype": "pb_tensor.dtypes",
    "TritonModelException": "pb_tensor.errors",
    "__version__": "dlpack_ctypes",
    "deserialize_bytes_tensor": "pb_tensor.bytes_codec",
    "numpy_to_triton_type": "pb_tensor.dtypes",
    "serialize_byte_tensor": "pb_tensor.bytes_codec",
    "triton_string_to_numpy": "pb_tensor.dtypes",
    "triton_to_numpy_type": "pb_tensor.dtypes",
}
DLPACK_CTYPES_NAMES = {
    "DLPACK_ABI_VERSION": "dlpack_ctypes.abi",
    "DLPACK_FLAG_BITMASK_IS_COPIED": "dlpack_ctypes.abi",
    "DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED": "dlpack_ctypes.abi",
    "DLPACK_FLAG_BITMASK_READ_ONLY": "dlpack_ctypes.abi",
    "HOST_DEVICES": "dlpack_ctypes.producer",
    "NUMPY_EXPORTER_KEEPS_RULES": "dlpack_ctypes.exporters",
    "BufferExporter": "dlpack_ctypes.exporters",
    "CapsuleType": "dlpack_ctypes._capi",
    "DLDataTypeCode": "dlpack_ctypes.abi",
    "DLDeviceType": "dlpack_ctypes.abi",
    "DLPackTensor": "dlpack_ctypes.consumer",
    "DataType": "dlpack_ctypes.dtypes",
    "c_strides": "dlpack_ctypes.producer",
    "consume": "dlpack_ctypes.consumer",
    "data_pointer": "dlpack_ctypes.exporters",
    "export_buffer": "dlpack_ctypes.producer",
    "fast_paths": "dlpack_ctypes.exporters",
    "flush": "dlpack_ctypes.producer",
    "from_dlpack": "dlpack_ctypes.consumer",
    "from_numpy_dtype": "dlpack_ctypes.dtypes",
    "live_exports": "dlpack_ctypes.producer",
    "negotiate": "dlpack_ctypes.producer",
    "numpy_dlpack": "dlpack_ctypes.exporters",
    "to_dlpack": "dlpack_ctypes.exporters",
    "to_numpy_dtype": "dlpack_ctypes.dtypes",
}

_RESOLVE = """
import importlib, sys
package = importlib.import_module({package!r})
expected = {expected!r}
modules = {modules!r}
public = sorted([*expected, *modules])
assert sorted(package.__all__) == public, sorted(set(package.__all__) ^ set(public))
listed = dir(package)
for name in package.__all__:
    assert name in listed, name
for name, module in expected.items():
    value = getattr(package, name)
    assert value is getattr(importlib.import_module(module), name), name
    # A second access finds the cached name, the same object.
    assert getattr(package, name) is value, name
for name in modules:
    assert getattr(package, name) is sys.modules[f"{package}.{{name}}"], name
try:
    package.no_such_name
except AttributeError as exc:
    assert str(exc) == "module {package!r} has no attribute 'no_such_name'", str(exc)
else:
    raise AssertionError("no AttributeError")
print("ok")
"""


@pytest.mark.parametrize(
    ("package", "expected", "modules"),
    [("pb_tensor", PB_TENSOR_NAMES, []), ("dlpack_ctypes", DLPACK_CTYPES_NAMES, ["abi"])],
    ids=["pb_tensor", "dlpack_ctypes"],
)
def test_every_public_name_resolves_to_its_defining_object(
    run_python: RunPython, package: str, expected: dict[str, str], modules: list[str]
) -> None:
    code = _RESOLVE.format(package=package, expected=expected, modules=modules)
    assert _ok(run_python, code).strip() == "ok"


def test_from_import_of_every_name_in_a_fresh_interpreter(run_python: RunPython) -> None:
    out = _ok(
        run_python,
        """
        from pb_tensor import *
        from dlpack_ctypes import *
        import pb_tensor, dlpack_ctypes
        print(len(pb_tensor.__all__), len(dlpack_ctypes.__all__), Tensor.__name__, abi.__name__)
        """,
    )
    assert out.split() == ["12", "26", "Tensor", "dlpack_ctypes.abi"]


# ------------------------------------------------------------------------------------------------
# First use of each deferred feature, in an interpreter that imported only the package


def test_first_bytes_tensor(run_python: RunPython) -> None:
    out = _ok(
        run_python,
        """
        import sys
        import numpy as np
        import pb_tensor
        t = pb_tensor.Tensor("s", np.array([b"a", b"bc"], dtype=object))
        assert "pb_tensor.bytes_codec" in sys.modules
        assert t.triton_dtype() == pb_tensor.TritonDtype.TYPE_BYTES
        assert t.byte_size == 4 + 1 + 4 + 2
        wire = pb_tensor.serialize_byte_tensor(np.array([b"xyz"], dtype=object))
        print(list(pb_tensor.deserialize_bytes_tensor(wire)), list(t.as_numpy()))
        """,
    )
    assert out.strip() == "[b'xyz'] [b'a', b'bc']"


def test_first_export_through_dlpack(run_python: RunPython) -> None:
    out = _ok(
        run_python,
        """
        import numpy as np
        import pb_tensor
        a = np.arange(6, dtype=np.float32)
        t = pb_tensor.Tensor("x", a)
        b = np.from_dlpack(t)
        assert np.shares_memory(a, b)
        legacy = t.to_dlpack()
        print(type(legacy).__name__, b.tolist())
        """,
    )
    assert out.strip() == "PyCapsule [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]"


@pytest.mark.parametrize(
    "make",
    [
        "a.__dlpack__(max_version=(1, 0))",  # a raw capsule first: the capsule type is bound
        "a.__dlpack__()",
        "dlpack_ctypes.BufferExporter.from_numpy(a)",
        "a[::2]",  # not C-contiguous: the DLPack path and its error
    ],
    ids=["versioned-capsule", "legacy-capsule", "buffer-exporter", "strided"],
)
def test_first_import_through_dlpack(run_python: RunPython, make: str) -> None:
    out = _ok(
        run_python,
        f"""
        import numpy as np
        import dlpack_ctypes
        import pb_tensor
        a = np.arange(6, dtype=np.float32)
        try:
            t = pb_tensor.Tensor.from_dlpack("x", {make})
        except pb_tensor.TritonModelException as exc:
            print("error", exc)
        else:
            assert np.shares_memory(t.as_numpy(), a)
            print("ok", t.shape(), t.__dlpack_device__())
        """,
    )
    if make == "a[::2]":
        assert out.startswith("error DLPack tensor is not contiguous."), out
    else:
        assert out.strip() == "ok [6] (<DLDeviceType.kDLCPU: 1>, 0)"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_first_import_of_a_torch_tensor(run_python: RunPython) -> None:
    out = _ok(
        run_python,
        """
        import torch
        import pb_tensor
        import dlpack_ctypes
        x = torch.arange(4, dtype=torch.int32)
        t = pb_tensor.Tensor.from_dlpack("x", x)
        d = dlpack_ctypes.from_dlpack(torch.ones(2))
        back = torch.from_dlpack(t)
        assert back.data_ptr() == x.data_ptr()
        print(t.as_numpy().tolist(), d.numpy().tolist())
        """,
        timeout=240,
    )
    assert out.strip() == "[0, 1, 2, 3] [1.0, 1.0]"


def test_first_shared_memory_and_pickle(run_python: RunPython) -> None:
    out = _ok(
        run_python,
        """
        import pickle
        import numpy as np
        import pb_tensor
        from pb_tensor.shm import SharedMemoryPool
        with SharedMemoryPool.create(1 << 16) as pool:
            t = pb_tensor.Tensor("x", np.arange(3, dtype=np.int64))
            u = pb_tensor.Tensor.load_from_shared_memory(pool, t.save_to_shared_memory(pool))
            loaded = u.as_numpy().tolist()
            del t, u
        v = pickle.loads(pickle.dumps(pb_tensor.Tensor("y", np.ones(2, np.float32)), protocol=5))
        print(loaded, v.name(), v.as_numpy().tolist())
        """,
    )
    assert out.strip() == "[0, 1, 2] y [1.0, 1.0]"


def test_first_dlpack_ctypes_export(run_python: RunPython) -> None:
    out = _ok(
        run_python,
        """
        import numpy as np
        import dlpack_ctypes as dl
        a = np.arange(4, dtype=np.uint8)
        b = np.from_dlpack(dl.BufferExporter.from_numpy(a))
        c = dl.consume(dl.to_dlpack(a, max_version=(1, 0)))
        shared = np.shares_memory(a, b) and np.shares_memory(a, c.numpy())
        del b, c
        print(shared, dl.flush())
        """,
    )
    assert out.split() == ["True", "0"]


# ------------------------------------------------------------------------------------------------
# Loading from several threads at once, and across fork()

_THREADS = """
import threading
import numpy as np
import dlpack_ctypes as dl
import pb_tensor
n = 8
barrier = threading.Barrier(n)
results = [None] * n
errors = []
def work(i):
    try:
        barrier.wait()
        a = np.full(3, i, dtype=np.float32)
        if i % 2:
            t = pb_tensor.Tensor.from_dlpack("x", dl.BufferExporter.from_numpy(a))
        else:
            t = pb_tensor.Tensor.from_dlpack("x", a.__dlpack__(max_version=(1, 0)))
        results[i] = (np.from_dlpack(t).tolist(), dl.from_dlpack(a).numpy().tolist())
    except BaseException as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
for th in threads:
    th.start()
for th in threads:
    th.join()
assert not errors, errors
assert results == [([float(i)] * 3, [float(i)] * 3) for i in range(n)], results
print("ok")
"""


def test_first_use_from_many_threads_at_once(run_python: RunPython) -> None:
    for _ in range(3):
        assert _ok(run_python, _THREADS).strip() == "ok"


_FORK = """
import os
import numpy as np
import dlpack_ctypes as dl
import pb_tensor
{before}
pid = os.fork()
if pid == 0:
    try:
        from dlpack_ctypes import _claim
        a = np.arange(3, dtype=np.float32)
        t = pb_tensor.Tensor.from_dlpack("x", a.__dlpack__(max_version=(1, 0)))
        ok = np.from_dlpack(t).tolist() == [0.0, 1.0, 2.0] and _claim.MODE in ("cas", "lock")
        with _claim.LOCK:  # the child's claim lock is usable
            pass
        os._exit(0 if ok else 1)
    except BaseException:
        os._exit(2)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize(
    "before",
    ["", "dl.from_dlpack(np.zeros(1)).close()"],
    ids=["machinery-loaded-after-fork", "machinery-loaded-before-fork"],
)
def test_first_use_after_fork(run_python: RunPython, before: str) -> None:
    assert _ok(run_python, _FORK.format(before=before), timeout=60).strip() == "0"


def test_claim_self_check_runs_before_the_first_claim(run_python: RunPython) -> None:
    out = _ok(
        run_python,
        """
        import sys
        import numpy as np
        import dlpack_ctypes as dl
        assert "dlpack_ctypes._claim" not in sys.modules
        consume = dl.consume  # loads the consumer, which loads the claim: its self-check runs
        from dlpack_ctypes import _claim
        assert (_claim.MODE == "cas") == (_claim.CAS is not None)
        t = consume(np.arange(2.0).__dlpack__(max_version=(1, 0)))
        print(_claim.MODE, t.numpy().tolist())
        """,
    )
    mode, values = out.strip().split(" ", 1)
    assert values == "[0.0, 1.0]"
    if sys.platform == "linux" and platform.python_implementation() == "CPython":
        assert mode == "cas"  # the compare-and-swap passed its self-check before the claim


# Appended to the fork scripts: the parent prints the child's exit code, or "hung" (and kills
# it) when it has not exited within 30 s.
_AWAIT_CHILD = """
deadline = time.monotonic() + 30
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print(os.waitstatus_to_exitcode(status))
        break
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("hung")
        break
    time.sleep(0.01)
"""

_FORK_DURING_FIRST_LOAD = """
import os, sys, threading, time
import numpy as np
import pb_tensor
import dlpack_ctypes as dl

def first_use():
    t = pb_tensor.Tensor("s", np.array([b"a"], dtype=object))  # tensor, the BYTES codec
    u = pb_tensor.Tensor.from_dlpack("x", dl.BufferExporter.from_numpy(np.ones(2)))
    np.from_dlpack(u)

thread = threading.Thread(target=first_use)
thread.start()
pid = os.fork()  # most likely while the thread loads the modules behind those names
if pid == 0:
    t = pb_tensor.Tensor.from_dlpack("y", dl.BufferExporter.from_numpy(np.arange(2.0)))
    ok = pb_tensor.serialize_byte_tensor(np.array([b"b"], dtype=object)) is not None
    os._exit(0 if ok and np.from_dlpack(t).tolist() == [0.0, 1.0] else 1)
thread.join()
""" + _AWAIT_CHILD


def test_fork_while_another_thread_loads_the_lazy_modules(run_python: RunPython) -> None:
    # The packages' fork hooks let that import finish first: the child never waits for an
    # import lock held by a thread it does not have.
    for _ in range(5):
        proc = run_python(_FORK_DURING_FIRST_LOAD, timeout=120, dev_mode=False,
                          warnings_as_errors=False)
        assert (proc.returncode, proc.stdout.strip()) == (0, "0"), proc.stderr[-2000:]


def test_first_calls_bind_the_real_functions(run_python: RunPython) -> None:
    # The deferred names are resolved once: afterwards the hot paths call the real objects
    # through module globals, with no binder and no import statement in between.
    out = _ok(
        run_python,
        """
        import pickle
        import numpy as np
        import dlpack_ctypes, pb_tensor
        from pb_tensor import tensor as m, _tensor_import
        from pb_tensor.shm import SharedMemoryPool
        a = np.arange(3, dtype=np.float32)
        t = pb_tensor.Tensor.from_dlpack("x", dlpack_ctypes.BufferExporter.from_numpy(a))
        np.from_dlpack(pb_tensor.Tensor("y", a))
        pb_tensor.Tensor("s", np.array([b"a"], dtype=object))
        pickle.loads(pickle.dumps(t))
        with SharedMemoryPool.create(1 << 16) as pool:
            u = pb_tensor.Tensor.load_from_shared_memory(pool, t.save_to_shared_memory(pool))
            del u
        from dlpack_ctypes.exchange import exchange_api
        from pb_tensor import _pickling, bytes_codec
        from pb_tensor.shm import _tensors
        pairs = [
            (m._exchange_api, exchange_api),
            (m._CapsuleType, dlpack_ctypes.CapsuleType),
            (m._numpy_dlpack, dlpack_ctypes.numpy_dlpack),
            (m._serialize_with_lengths, bytes_codec.serialize_with_lengths),
            (m._save_tensor, _tensors.save_tensor),
            (m._load_tensor, _tensors.load_tensor),
            (m._encode, _pickling.encode),
            (m._decode, _pickling.decode),
            (_tensor_import._c_strides, dlpack_ctypes.c_strides),
        ]
        print(all(bound is real for bound, real in pairs))
        """,
    )
    assert out.strip() == "True"


# Another thread's first pickling of a Tensor is held inside the import of the pickling module
# (a loader that waits) while this thread forks: the fork hook must wait for that import to
# finish, or the child would inherit its module lock held by a thread it does not have.
_FORK_DURING_HELD_IMPORT = """
import importlib.abc, importlib.machinery, os, pickle, sys, threading, time
import numpy as np
import pb_tensor

started, go = threading.Event(), threading.Event()


class HeldLoader(importlib.abc.Loader):
    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        started.set()
        go.wait()
        self.real.exec_module(module)


class HoldPickling(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "pb_tensor._pickling":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = HeldLoader(spec.loader)
        return spec


sys.meta_path.insert(0, HoldPickling())
t = pb_tensor.Tensor("x", np.arange(3.0))
thread = threading.Thread(target=pickle.dumps, args=(t,))
thread.start()
started.wait()
threading.Timer(0.5, go.set).start()
pid = os.fork()
if pid == 0:
    ok = pickle.loads(pickle.dumps(t)).as_numpy().tolist() == [0.0, 1.0, 2.0]
    os._exit(0 if ok else 1)
thread.join()
""" + _AWAIT_CHILD


def test_fork_while_another_thread_is_inside_a_first_use_import(run_python: RunPython) -> None:
    proc = run_python(_FORK_DURING_HELD_IMPORT, timeout=120, dev_mode=False,
                      warnings_as_errors=False)
    assert (proc.returncode, proc.stdout.strip()) == (0, "0"), proc.stderr[-2000:]
