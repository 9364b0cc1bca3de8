"""Tensors through a real local Ray: the object store (zero-copy gets), tasks and actors.

One Ray instance serves the whole run (starting Ray takes seconds). Skipped, with the reason,
where ray is not installed: ``pip install -e ".[ray]"`` in a clone.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import travel_workers as w

import dlpack_ctypes as dl
from pb_tensor import MemoryType, Tensor, TritonDtype, TritonModelException, cuda

pytestmark = pytest.mark.ray

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
MIB = 1 << 20


@pytest.fixture(scope="session")
def ray() -> Iterator[Any]:
    """The ``ray`` module with a local instance started for this test run."""
    ray = pytest.importorskip(
        "ray",
        reason='ray is not installed (pip install -e ".[ray]" in a clone; ray publishes wheels '
        "for some Python versions only)",
    )
    # Ray's workers inherit the environment of the processes ray.init starts: give them the
    # repository (pb_tensor) and this folder (travel_workers) to import.
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, TESTS_DIR, previous]))
    try:
        with warnings.catch_warnings():
            # Ray starts its processes through subprocess with a preexec_fn, which runs fork
            # hooks: JAX's (when an earlier test imported JAX) warns about fork() in a threaded
            # process. The child execs at once, so the warning does not apply.
            warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
            ray.init(num_cpus=1, include_dashboard=False)
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous
    yield ray
    ray.shutdown()


def _mapping_of(address: int) -> tuple[str, str]:
    """(permissions, path) of this process's memory mapping holding ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[1], " ".join(fields[5:])
    raise AssertionError(f"address {address:#x} is not mapped")


def _in_object_store(address: int) -> bool:
    """Whether ``address`` lies in Ray's shared object store (plasma) mapping."""
    permissions, path = _mapping_of(address)
    return permissions[3] == "s" and "plasma" in path


def test_put_get_is_zero_copy(ray: Any) -> None:
    a = np.arange(16 * MIB // 4, dtype=np.float32).reshape(4, -1)
    ref = ray.put(Tensor("INPUT0", a))
    first = ray.get(ref)
    second = ray.get(ref)
    assert type(first) is Tensor
    assert (first.name(), first.triton_dtype(), first.shape()) == (
        "INPUT0", TritonDtype.TYPE_FP32, list(a.shape)
    )
    assert first.memory_type is MemoryType.CPU
    out = first.as_numpy()
    np.testing.assert_array_equal(out, a)
    # Both gets view the one copy in the object store, read-only, as Ray's numpy arrays do.
    assert np.shares_memory(out, second.as_numpy())
    assert first.data_ptr == second.data_ptr
    assert _in_object_store(first.data_ptr)
    assert not out.flags.writeable
    assert first.data_ptr % 64 == 0


@pytest.mark.parametrize(
    "array",
    [np.array(3.5), np.zeros((0, 4), dtype=np.int16), np.arange(10, dtype=np.uint8)],
    ids=["0-d", "size-0", "small"],
)
def test_put_get_small_and_empty(ray: Any, array: np.ndarray[Any, Any]) -> None:
    got = ray.get(ray.put(Tensor("s", array)))
    assert got.shape() == list(array.shape)
    assert got.as_numpy().dtype == array.dtype
    np.testing.assert_array_equal(got.as_numpy(), array)


def test_put_get_bytes(ray: Any) -> None:
    array = np.array([b"x" * 1000, "é" * 10, b""] * 1000, dtype=object).reshape(3, 1000)
    t = Tensor("text", array)
    ref = ray.put(t)
    got = ray.get(ref)
    assert got.triton_dtype() is TritonDtype.TYPE_BYTES
    assert got.shape() == [3, 1000]
    assert got.as_numpy().tolist() == [
        [x if isinstance(x, bytes) else x.encode() for x in row] for row in array.tolist()
    ]
    # The wire bytes stay in the store; the elements are Python bytes objects, as always.
    assert got.byte_size == t.byte_size
    assert _in_object_store(got.data_ptr)
    assert got.data_ptr == ray.get(ref).data_ptr


def test_put_get_bf16(ray: Any) -> None:
    values = [float(x) for x in range(-256, 256)] * 256
    t = w.make_bf16(values)
    ref = ray.put(t)
    got = ray.get(ref)
    assert got.triton_dtype() is TritonDtype.TYPE_BF16
    assert w.raw_bytes(got) == w.raw_bytes(t)
    assert got.data_ptr == ray.get(ref).data_ptr
    assert _in_object_store(got.data_ptr)
    assert not w.writable(got)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert got.as_numpy().dtype == ml_dtypes.bfloat16
    assert got.as_numpy().astype(np.float32).tolist() == values
    del t, got


def test_tasks_take_and_return_tensors(ray: Any) -> None:
    describe = ray.remote(w.describe)
    double = ray.remote(w.double)
    make = ray.remote(w.make)
    tensors = [
        Tensor("fp32", np.arange(MIB, dtype=np.float32)),
        Tensor("i64", np.array(7, dtype=np.int64)),
        Tensor("text", np.array([b"a", b"bc"], dtype=object)),
        w.make_bf16([1.0, -2.0]),
    ]
    seen = ray.get([describe.remote(t) for t in tensors])
    for t, (name, dtype, shape, memory_type, _writable, digest) in zip(tensors, seen):
        local = w.describe(t)
        assert (name, dtype, shape, memory_type, digest) == (
            local[0], local[1], local[2], local[3], local[5]
        )
    # A large argument arrives as a read-only view of the object store.
    assert seen[0][4] is False
    doubled = ray.get([double.remote(t) for t in tensors[:3]])
    for t, d in zip(tensors, doubled):
        assert d.name() == t.name() + "_out"
        np.testing.assert_array_equal(d.as_numpy(), w.double(t).as_numpy())
    big = ray.get(make.remote("made", 4 * MIB))
    assert big.shape() == [4 * MIB]
    assert big.as_numpy()[-1] == 4 * MIB - 1
    assert _in_object_store(big.data_ptr)


def test_actor_takes_and_returns_tensors(ray: Any) -> None:
    accumulator = ray.remote(w.Accumulator).remote(4)
    for i in range(3):
        total = ray.get(accumulator.add.remote(Tensor(f"step{i}", np.full(4, i + 1.0))))
    assert total.name() == "total"
    assert total.as_numpy().tolist() == [6.0, 6.0, 6.0, 6.0]
    ray.kill(accumulator)


def test_task_result_into_dlpack_consumers_without_copy(ray: Any) -> None:
    torch = pytest.importorskip("torch")
    make = ray.remote(w.make)
    got = ray.get(make.remote("made", MIB))
    assert _in_object_store(got.data_ptr)
    again = Tensor.from_dlpack("again", got)
    assert again.data_ptr == got.data_ptr
    as_torch = torch.from_dlpack(got)
    assert as_torch.data_ptr() == got.data_ptr
    assert as_torch[-1].item() == MIB - 1
    with dl.consume(got.__dlpack__(max_version=(1, 3))) as imported:
        assert imported.readonly  # DLPack 1.x consumers learn the store is read-only
    del as_torch, again, got


def test_large_get_is_a_view(ray: Any) -> None:
    """A 256 MiB get views the store as a 4 KiB one does: no copy, so the cost does not grow
    with the size (benchmarks/bench_travel.py times both)."""
    for nbytes in (4 << 10, 256 * MIB):
        ref = ray.put(Tensor("big", np.ones(nbytes, dtype=np.uint8)))
        first, second = ray.get(ref), ray.get(ref)
        assert first.data_ptr == second.data_ptr
        assert first.byte_size == nbytes
        assert not first.as_numpy().flags.writeable
        if nbytes > MIB:
            assert _in_object_store(first.data_ptr)
        del first, second, ref


def test_gpu_tensor_put_names_to_host(ray: Any) -> None:
    from cuda_fake import FakeCudaRuntime

    runtime = FakeCudaRuntime(devices=2)
    previous = cuda.set_runtime(runtime)
    try:
        ptr = cuda.malloc(24, device=1)
        exporter = dl.BufferExporter(object(), ptr, (6,), None, dl.DataType(2, 32, 1), (2, 1))
        t = Tensor.from_dlpack("gpu", exporter.__dlpack__(max_version=(1, 3)))
        with pytest.raises(Exception, match=r"call to_host\(\) first") as info:
            ray.put(t)
        chain = [info.value, info.value.__cause__, info.value.__context__]
        assert any(isinstance(e, TritonModelException) for e in chain)
        del t
    finally:
        cuda.set_runtime(previous)
