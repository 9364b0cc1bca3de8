"""Shared-memory pool and tensor records, in one process.

Cross-process behaviour is in test_shm_multiprocess.py, corrupted records in
test_shm_corruption.py.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import mmap
import os
import re
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

from pb_tensor import shm
from pb_tensor.errors import TritonModelException
from pb_tensor.shm import (
    MEMORY_CPU,
    MEMORY_CPU_PINNED,
    MEMORY_GPU,
    SharedMemoryPool,
    load_record,
    release,
    save_record,
)
from pb_tensor.shm import _heap as heap

# numpy dtype -> TRITONSERVER_DataType
TRITON_DTYPES = {
    np.dtype(np.bool_): 1,
    np.dtype(np.uint8): 2,
    np.dtype(np.uint16): 3,
    np.dtype(np.uint32): 4,
    np.dtype(np.uint64): 5,
    np.dtype(np.int8): 6,
    np.dtype(np.int16): 7,
    np.dtype(np.int32): 8,
    np.dtype(np.int64): 9,
    np.dtype(np.float16): 10,
    np.dtype(np.float32): 11,
    np.dtype(np.float64): 12,
}
BYTES, BF16 = 13, 14
SHAPES = [(), (0,), (1,), (7,), (3, 0, 2), (2, 3, 4), (1,) * 9, (5, 1, 3)]


def _shm_available() -> int:
    st = os.statvfs(shm.SHM_DIR)
    return st.f_bavail * st.f_frsize


def pool_path(name: str) -> str:
    return os.path.join(shm.SHM_DIR, name)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def name() -> Iterator[str]:
    """A unique pool name; the segment must be gone when the test ends."""
    value = f"pbt_test_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    yield value
    assert not os.path.exists(os.path.join(shm.SHM_DIR, value)), "segment left in /dev/shm"


@pytest.fixture
def pool(name: str) -> Iterator[SharedMemoryPool]:
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as p:
        yield p
        stats = p.stats()  # walks and checks the whole heap
        assert (stats.allocations, stats.used) == (0, 0), f"leaked allocations: {stats}"


def _save(pool: SharedMemoryPool, array: np.ndarray, name: str = "INPUT0") -> int:
    return save_record(
        pool,
        name=name,
        dtype=TRITON_DTYPES[array.dtype],
        dims=array.shape,
        memory_type=MEMORY_CPU,
        memory_type_id=0,
        payload=array,
        byte_size=array.nbytes,
    )


def _as_array(record: shm.TensorRecord, dtype: np.dtype) -> np.ndarray:
    return record.payload.view(dtype).reshape(record.dims)


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", list(TRITON_DTYPES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip(pool: SharedMemoryPool, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(zlib.crc32(repr((str(dtype), shape)).encode()))
    array = rng.integers(0, 100, size=shape).astype(dtype)
    handle = _save(pool, array)
    record = load_record(pool, handle)
    assert record.handle == handle
    assert (record.name, record.dtype, record.dims) == ("INPUT0", TRITON_DTYPES[dtype], shape)
    assert (record.memory_type, record.memory_type_id) == (MEMORY_CPU, 0)
    assert record.byte_size == array.nbytes == record.payload.nbytes
    assert record.ipc_handle is None
    assert record.gpu_pointer_offset == 0
    assert record.payload.dtype == np.uint8
    assert record.payload.flags.writeable
    assert record.payload.ctypes.data % shm.PAYLOAD_ALIGNMENT == 0
    np.testing.assert_array_equal(_as_array(record, dtype), array)
    del record
    release(pool, handle)


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2],  # strided view
        lambda: np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        lambda: np.arange(10, dtype=">i4")[::-1],  # non-native order, negative stride
        lambda: np.arange(6, dtype=np.float32).reshape(2, 3).T,
    ],
    ids=["strided", "fortran", "big-endian-reversed", "transposed"],
)
def test_any_numpy_layout_is_copied_in_c_order(pool: SharedMemoryPool, make: object) -> None:
    array = make()  # type: ignore[operator]
    handle = save_record(
        pool, name="x", dtype=2, dims=[array.nbytes], memory_type=0, memory_type_id=0,
        payload=array, byte_size=array.nbytes,
    )  # fmt: skip
    record = load_record(pool, handle)
    assert bytes(record.payload) == np.ascontiguousarray(array).tobytes()
    del record
    release(pool, handle)


@pytest.mark.parametrize(
    "payload",
    [b"0123456789abcdef", bytearray(range(200)), memoryview(bytes(range(48))).cast("f", (3, 4))],
    ids=["bytes", "bytearray", "memoryview-2d-float"],
)
def test_buffer_payloads(pool: SharedMemoryPool, payload: object) -> None:
    raw = bytes(payload)  # type: ignore[call-overload]
    handle = save_record(
        pool, name="buf", dtype=2, dims=[len(raw)], memory_type=MEMORY_CPU, memory_type_id=0,
        payload=payload, byte_size=len(raw),  # type: ignore[arg-type]
    )  # fmt: skip
    record = load_record(pool, handle)
    assert bytes(record.payload) == raw
    del record
    release(pool, handle)


def _serialize_bytes(items: list[bytes]) -> bytes:
    """Triton's BYTES wire format: each element as uint32 length + bytes."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def _deserialize_bytes(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        out.append(data[pos + 4 : pos + 4 + length])
        pos += 4 + length
    return out


def test_bytes_tensor_payload(pool: SharedMemoryPool) -> None:
    items = [b"", b"a", "ünïcødé".encode(), b"\x00\xff" * 50, b"x" * 1000]
    data = _serialize_bytes(items)
    handle = save_record(
        pool, name="TEXT", dtype=BYTES, dims=[len(items)], memory_type=MEMORY_CPU,
        memory_type_id=0, payload=np.frombuffer(data, np.uint8), byte_size=len(data),
    )  # fmt: skip
    record = load_record(pool, handle)
    assert record.dtype == BYTES
    assert record.dims == (len(items),)
    assert _deserialize_bytes(bytes(record.payload)) == items
    del record
    release(pool, handle)


def test_bf16_pinned_and_unicode_name(pool: SharedMemoryPool) -> None:
    bits = np.arange(6, dtype=np.uint16)
    handle = save_record(
        pool, name="résumé ✓", dtype=BF16, dims=(2, 3), memory_type=MEMORY_CPU_PINNED,
        memory_type_id=3, payload=bits, byte_size=12,
    )  # fmt: skip
    record = load_record(pool, handle, readonly=True)
    assert (record.name, record.memory_type, record.memory_type_id) == ("résumé ✓", 1, 3)
    assert not record.payload.flags.writeable
    np.testing.assert_array_equal(record.payload.view(np.uint16), bits)
    del record
    release(pool, handle)


def test_empty_name_and_payload_none_filled_through_view(pool: SharedMemoryPool) -> None:
    handle = save_record(
        pool, name="", dtype=8, dims=(4,), memory_type=MEMORY_CPU, memory_type_id=0,
        payload=None, byte_size=16,
    )  # fmt: skip
    writer = load_record(pool, handle)
    writer.payload.view(np.int32)[:] = [1, 2, 3, 4]
    del writer
    reader = load_record(pool, handle)
    assert reader.name == ""
    assert reader.payload.view(np.int32).tolist() == [1, 2, 3, 4]
    del reader
    release(pool, handle)


def test_gpu_record_keeps_ipc_handle_slot(pool: SharedMemoryPool) -> None:
    ipc = bytes(range(64))
    handle = save_record(
        pool, name="OUTPUT0", dtype=11, dims=(1024,), memory_type=MEMORY_GPU, memory_type_id=1,
        payload=None, byte_size=4096, gpu_pointer_offset=256, ipc_handle=ipc,
        memory_release_id=7,
    )  # fmt: skip
    record = load_record(pool, handle)
    assert (record.memory_type, record.memory_type_id, record.byte_size) == (2, 1, 4096)
    assert (record.gpu_pointer_offset, record.memory_release_id) == (256, 7)
    assert record.ipc_handle == ipc
    assert bytes(record.payload) == ipc
    record.payload[:] = 0  # the slot is writable, as upstream's SetCudaIpcHandle needs
    del record
    again = load_record(pool, handle)
    assert again.ipc_handle == bytes(64)
    del again
    release(pool, handle)


def test_record_layout_matches_triton(pool: SharedMemoryPool) -> None:
    """upstream.md 4.2's worked example: FP32 "INPUT0" [2, 3], plus our 64-byte padding."""
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    handle = _save(pool, array)
    raw = pool.view(handle)  # starts right after the 16-byte ref-count prefix
    assert pool.refcount(handle) == 1
    assert struct.unpack_from("=qi4xQ", raw, 0) == (0, 11, 2)  # TensorShm @0
    assert struct.unpack_from("=2q", raw, 24) == (2, 3)  # dims @24
    assert struct.unpack_from("=Q", raw, 48) == (6,)  # StringShm.length @48
    assert bytes(raw[56:62]) == b"INPUT0"  # name @56
    mem = struct.unpack_from("=Q?7xQi4xqQQ", raw, 62)  # MemoryShm @62
    assert mem[3:] == (MEMORY_CPU, 0, 24, 0)  # memory_type, id, byte_size, release id
    assert mem[1] is False  # use_cuda_shared_pool
    assert shm.record_payload_offset(2, 6) == 128  # upstream: 118, unaligned
    assert bytes(raw[118:128]) == bytes(10)  # the padding is zeroed
    assert bytes(raw[128:152]) == array.tobytes()
    assert raw[128:].ctypes.data % 64 == 0
    del raw
    release(pool, handle)


# ------------------------------------------------------------------------- reference counts
def test_record_and_derived_views_hold_the_reference(pool: SharedMemoryPool) -> None:
    handle = _save(pool, np.arange(100, dtype=np.int64))
    record = load_record(pool, handle)
    assert pool.refcount(handle) == 2
    typed = _as_array(record, np.dtype(np.int64))[10:20]
    mv = memoryview(record.payload)
    del record
    gc.collect()
    assert pool.refcount(handle) == 2  # views alive
    del typed
    assert pool.refcount(handle) == 2
    del mv
    assert pool.refcount(handle) == 1
    release(pool, handle)
    with pytest.raises(TritonModelException, match=f"handle {handle} refers to freed memory"):
        pool.refcount(handle)


def test_payload_base_is_an_owner_object(pool: SharedMemoryPool) -> None:
    handle = _save(pool, np.zeros(8, np.uint8))
    record = load_record(pool, handle)
    assert "shared-memory allocation" in repr(record.payload.base)
    assert "INPUT0" in repr(record)
    assert "byte_size=8" in repr(record)
    with pytest.raises(AttributeError):
        record.name = "other"  # type: ignore[misc]
    del record
    release(pool, handle)


def test_torch_view_keeps_allocation_alive(pool: SharedMemoryPool) -> None:
    torch = pytest.importorskip("torch")
    handle = _save(pool, np.arange(16, dtype=np.float32))
    record = load_record(pool, handle)
    tensor = torch.from_numpy(record.payload.view(np.float32))
    del record
    gc.collect()
    assert pool.refcount(handle) == 2
    assert tensor.sum().item() == sum(range(16))
    del tensor
    gc.collect()
    assert pool.refcount(handle) == 1
    release(pool, handle)


def test_raw_allocations_incref_decref_and_views(pool: SharedMemoryPool) -> None:
    handles = [pool.allocate(n) for n in (0, 1, 63, 64, 65, 5000)]
    for h in handles:
        assert h % 64 == 48  # the ref-count prefix; data is 64-byte aligned
        assert pool.view(h).ctypes.data % 64 == 0
    assert [pool.nbytes(h) for h in handles] == [0, 1, 63, 64, 65, 5000]
    view = pool.view(handles[-1])
    view[:] = 7
    held = pool.view(handles[-1], hold=True)
    assert pool.refcount(handles[-1]) == 2
    pool.incref(handles[0])
    pool.decref(handles[0])
    for h in handles:
        pool.decref(h)
    assert int(held.sum()) == 7 * 5000  # still ours
    del view, held
    with pytest.raises(TritonModelException, match="freed"):
        pool.decref(handles[-1])


def test_kind_mismatch(pool: SharedMemoryPool) -> None:
    raw = pool.allocate(256)
    with pytest.raises(TritonModelException, match="is not a tensor record"):
        load_record(pool, raw)
    with pytest.raises(TritonModelException, match="is not a tensor record"):
        release(pool, raw)
    assert pool.refcount(raw) == 1
    pool.decref(raw)


@pytest.mark.parametrize("handle", [0, -1, 1, 47, 1072 + 1, 1 << 40, 2**64 + 48])
def test_bad_handles(pool: SharedMemoryPool, handle: int) -> None:
    with pytest.raises(TritonModelException, match=f"handle {handle}"):
        load_record(pool, handle)
    with pytest.raises(TritonModelException, match=f"handle {handle}"):
        pool.incref(handle)


def test_handle_type_checked(pool: SharedMemoryPool) -> None:
    with pytest.raises(TritonModelException, match="must be an int"):
        load_record(pool, 1072.0)  # type: ignore[arg-type]
    with pytest.raises(TritonModelException, match="must be an int"):
        pool.decref(True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": 15}, "dtype 15 is out of range"),
        ({"dtype": -1}, "dtype -1 is out of range"),
        ({"dtype": "FP32"}, "dtype must be an int"),
        ({"memory_type": 3}, "memory_type 3"),
        ({"memory_type_id": -1}, "memory_type_id -1"),
        ({"dims": (2, -2)}, "dimension -2"),
        ({"dims": (1,) * 256, "payload": np.zeros(1, np.float32), "byte_size": 4}, "at most 255"),
        ({"dims": (2, 3)}, "byte_size 16 does not match dims"),
        ({"byte_size": 12}, "byte_size 12 does not match"),
        ({"payload": np.zeros(5, np.float32)}, "payload holds 20 bytes but byte_size is 16"),
        ({"payload": np.array([None] * 4, dtype=object)}, "object dtype"),
        ({"payload": 42}, "numpy array or a buffer"),
        ({"payload": memoryview(bytes(32))[::2]}, "C-contiguous"),
        ({"ipc_handle": bytes(64)}, "only stored for GPU"),
        ({"name": "\ud800"}, "not valid UTF-8"),
        ({"name": b"INPUT0"}, "name must be a str"),
        ({"memory_type": 2}, "pass payload=None"),
        ({"memory_type": 2, "payload": None, "ipc_handle": b"short"}, "64 bytes"),
        ({"gpu_pointer_offset": -1}, "gpu_pointer_offset -1"),
    ],
)
def test_save_rejects(pool: SharedMemoryPool, kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "name": "x", "dtype": 11, "dims": (4,), "memory_type": 0, "memory_type_id": 0,
        "payload": np.zeros(4, np.float32), "byte_size": 16,
    }  # fmt: skip
    args.update(kwargs)
    with pytest.raises(TritonModelException, match=match):
        save_record(pool, **args)  # type: ignore[arg-type]


def test_failed_copy_frees_the_allocation(
    pool: SharedMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(np, "copyto", boom)
    n = 1 << 15  # past the small-payload path, which copies without np.copyto
    with pytest.raises(RuntimeError, match="copy failed"):
        save_record(
            pool, name="x", dtype=11, dims=(n,), memory_type=0, memory_type_id=0,
            payload=np.zeros(n, np.float32), byte_size=4 * n,
        )  # fmt: skip
    monkeypatch.undo()
    assert pool.stats().allocations == 0


# ------------------------------------------------------------------------------- lifecycle
def test_creator_unlinks_and_attacher_does_not(name: str) -> None:
    path = os.path.join(shm.SHM_DIR, name)
    fds = _fd_count()
    creator = SharedMemoryPool.create(name=name)
    assert os.path.exists(path)
    assert creator.is_creator
    assert creator.name == name
    assert creator.size == shm.DEFAULT_SIZE
    assert creator.growth == shm.DEFAULT_GROWTH
    assert creator.max_size is None
    other = SharedMemoryPool.attach(name)
    assert not other.is_creator
    assert other.size == creator.size
    other.close()
    other.close()  # idempotent
    assert os.path.exists(path)
    with pytest.raises(TritonModelException, match="is closed"):
        other.allocate(1)
    creator.close()
    assert not os.path.exists(path)
    assert _fd_count() == fds
    with pytest.raises(TritonModelException, match="Unable to find shared memory pool"):
        SharedMemoryPool.attach(name)


def test_close_with_live_record_defers_unmapping(name: str) -> None:
    fds = _fd_count()
    pool = SharedMemoryPool.create(name=name)
    handle = _save(pool, np.arange(10, dtype=np.int32))
    record = load_record(pool, handle)
    pool.close()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name))  # the name is gone at once
    assert pool.closed
    with pytest.raises(TritonModelException, match="is closed"):
        load_record(pool, handle)
    with pytest.raises(TritonModelException, match="is closed"):
        release(pool, handle)
    assert _as_array(record, np.dtype(np.int32)).tolist() == list(range(10))
    assert _fd_count() > fds  # still mapped for the record
    del record
    gc.collect()
    assert _fd_count() == fds


def test_context_manager_and_repr(name: str) -> None:
    with SharedMemoryPool.create(10_000, name=name, max_size=1 << 20) as pool:
        assert pool.size == 12288  # whole pages
        assert pool.max_size == 1 << 20
        assert name in repr(pool)
        assert "creator" in repr(pool)
    assert "closed" in repr(pool)


def test_name_clash_and_invalid_names(name: str) -> None:
    with (
        SharedMemoryPool.create(name=name),
        pytest.raises(TritonModelException, match="already exists"),
    ):
        SharedMemoryPool.create(name=name)
    for bad in ["", "a/b", ".hidden", "nul\x00", "x" * 201]:
        with pytest.raises(TritonModelException, match="Invalid shared memory pool name"):
            SharedMemoryPool.create(name=bad)
    with pytest.raises(TritonModelException, match="must be positive"):
        SharedMemoryPool.create(0, name=name)
    with pytest.raises(TritonModelException, match="must be an int"):
        SharedMemoryPool.create(1.5, name=name)  # type: ignore[arg-type]


def test_attach_rejects_foreign_segment(name: str) -> None:
    path = os.path.join(shm.SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"not a pool" * 1000)
    try:
        with pytest.raises(TritonModelException, match="is not a pb_tensor shared memory pool"):
            SharedMemoryPool.attach(name)
    finally:
        os.unlink(path)


def test_default_name_is_unique() -> None:
    with SharedMemoryPool.create(4096) as a, SharedMemoryPool.create(4096) as b:
        assert a.name != b.name
        assert a.name.startswith("pb_tensor_")


# ---------------------------------------------------------------------------------- growth
def test_growth_keeps_old_views_valid(name: str) -> None:
    with SharedMemoryPool.create(8192, growth=4096, name=name) as pool:
        first = np.arange(512, dtype=np.int32)
        h0 = _save(pool, first)
        early = load_record(pool, h0)
        handles, sizes = [], [pool.size]
        for i in range(12):
            handles.append(_save(pool, np.full(1000 + 300 * i, i, np.int16), name=f"t{i}"))
            sizes.append(pool.size)
        assert len(set(sizes)) >= 5, sizes  # grew in several steps
        assert _as_array(early, np.dtype(np.int32)).tolist() == first.tolist()
        for i, h in enumerate(handles):
            rec = load_record(pool, h)
            assert rec.name == f"t{i}"
            assert int(rec.payload.view(np.int16)[-1]) == i
            del rec
            release(pool, h)
        del early
        release(pool, h0)
        stats = pool.stats()
        assert stats.allocations == 0
        assert stats.free_blocks == 1


def test_growth_step_covers_large_request(name: str) -> None:
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:
        h = pool.allocate(1 << 20)
        assert pool.size == (1 << 16) + 16 * (1 << 16)  # whole steps, reusing the free tail
        pool.decref(h)


def test_attach_while_another_process_grows(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pool may grow between an attaching process's two reads of it (its header, its file
    # size). CI met the order size-then-header: the old size and the new total read as a
    # corrupted pool. The growth here runs exactly between the two reads, whichever order
    # they come in.
    from pb_tensor.shm import _segment

    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:
        reads: list[str] = []
        real_pread, real_fstat = os.pread, os.fstat
        handles: list[int] = []
        growing = threading.Event()

        def grow_once() -> None:
            if not growing.is_set():
                growing.set()
                handles.append(pool.allocate(1 << 18))

        def pread(fd: int, n: int, offset: int) -> bytes:
            if handles or not growing.is_set():  # the growth's own reads are not the attach's
                reads.append("header")
            result = real_pread(fd, n, offset)
            grow_once()  # after the first read, before the second
            return result

        def fstat(fd: int) -> os.stat_result:
            if handles or not growing.is_set():
                reads.append("size")
            result = real_fstat(fd)
            grow_once()
            return result

        monkeypatch.setattr(os, "pread", pread)
        monkeypatch.setattr(os, "fstat", fstat)
        fd, total = _segment.open_segment(name)
        monkeypatch.undo()
        try:
            assert reads == ["header", "size"]
            assert total == 1 << 16 < pool.size  # the total it read: a later use remaps
        finally:
            os.close(fd)
            pool.decref(handles[0])


def test_growth_past_maximum_fails_before_touching_memory(name: str) -> None:
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, max_size=3 << 16, name=name) as pool:
        h = pool.allocate(100_000)  # fits after one capped growth step
        size = pool.size
        with pytest.raises(TritonModelException) as info:
            pool.allocate(200_000)
        message = str(info.value)
        assert message.startswith("Failed to increase the shared memory pool size to ")
        assert "200000 bytes" in message
        assert f"limited to {3 << 16} bytes" in message
        assert pool.size == size
        assert os.path.getsize(pool_path(name)) == size
        pool.decref(h)
        pool.decref(pool.allocate(150_000))  # still usable, up to the maximum
        assert pool.size <= 3 << 16


def test_growth_past_shm_free_space(name: str) -> None:
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:
        available = _shm_available()
        with pytest.raises(TritonModelException) as info:
            pool.allocate(available + (1 << 30))
        message = str(info.value)
        assert "Failed to increase the shared memory pool size to" in message
        assert re.search(r"only \d+ bytes are available in /dev/shm", message), message
        assert "--shm-size" in message
        assert pool.size == 1 << 16
        assert os.path.getsize(pool_path(name)) == 1 << 16
        pool.decref(pool.allocate(100))


def test_growth_with_simulated_small_dev_shm(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:
        fake = os.statvfs_result((4096, 4096, 100, 10, 10, 100, 10, 10, 0, 255))
        monkeypatch.setattr(os, "statvfs", lambda path: fake)
        with pytest.raises(TritonModelException) as info:
            pool.allocate(1 << 17)
        message = str(info.value)
        assert "requested 131072 more bytes" in message
        assert "only 40960 bytes are available in /dev/shm" in message
        monkeypatch.undo()
        pool.decref(pool.allocate(1 << 17))


def test_fallocate_failure_is_reported(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:

        def no_space(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "posix_fallocate", no_space)
        with pytest.raises(TritonModelException, match="No space left on device"):
            pool.allocate(1 << 17)
        assert pool.size == 1 << 16
        monkeypatch.undo()
        pool.decref(pool.allocate(1 << 17))


def test_create_larger_than_dev_shm(name: str) -> None:
    too_big = _shm_available() + (1 << 30)
    with pytest.raises(TritonModelException, match="Unable to initialize shared memory key"):
        SharedMemoryPool.create(too_big, name=name)
    with pytest.raises(TritonModelException, match="pool maximum is 4096 bytes"):
        SharedMemoryPool.create(1 << 16, max_size=4096, name=name)


def test_allocator_reuses_and_coalesces(pool: SharedMemoryPool) -> None:
    rng = np.random.default_rng(1)
    live: dict[int, int] = {}
    for step in range(3000):
        if live and (rng.random() < 0.5 or len(live) > 60):
            h = list(live)[int(rng.integers(len(live)))]
            view = pool.view(h)
            assert zlib.crc32(view) == live.pop(h)
            del view
            pool.decref(h)
        else:
            n = int(rng.choice([0, 8, 100, 1000, 5000, 40000]))
            h = pool.allocate(n)
            view = pool.view(h)
            view[:] = rng.integers(1, 255, n, dtype=np.uint8)
            live[h] = zlib.crc32(view)
            del view
        if step % 500 == 0:
            pool.stats()
    for h in live:
        pool.decref(h)
    stats = pool.stats()
    assert stats.free_blocks == 1
    assert stats.free == stats.size - 1024 - 64


# ------------------------------------------------------------------------ crash recovery
@contextlib.contextmanager
def _raw_segment(name: str, size: int) -> Iterator[mmap.mmap]:
    """An independent mapping of the segment, as another (crashing) process would have."""
    fd = os.open(pool_path(name), os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, size)
        with mmap.mmap(fd, size) as mm:
            yield mm
    finally:
        os.close(fd)


def test_recovery_after_interrupted_growth(name: str) -> None:
    """A grower died after committing the new size, before freeing the old sentinel."""
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as pool:
        kept = _save(pool, np.arange(1000, dtype=np.int32))
        total, new_total = pool.size, pool.size + (1 << 16)
        with _raw_segment(name, new_total) as mm:
            heap.BLOCK.pack_into(
                mm, new_total - 64, heap.BLOCK_MAGIC, heap.END, 64, 1 << 16, 0, 0, 0, 1
            )
            heap.U64.pack_into(mm, heap.OFF_TOTAL, new_total)
            heap.U64.pack_into(mm, heap.OFF_DIRTY, 999_999)  # a dead process mid-mutation
        handle = pool.allocate(100_000)  # needs the new space: the repair made it free
        stats = pool.stats()
        assert stats.recoveries == 1
        assert stats.size == new_total
        assert stats.allocations == 2
        assert _as_array(load_record(pool, kept), np.dtype(np.int32))[-1] == 999
        pool.decref(handle)
        release(pool, kept)
        assert pool.stats().free_blocks == 1
        assert total < pool.size


def test_heap_beyond_repair_refuses_allocations(name: str) -> None:
    with SharedMemoryPool.create(1 << 16, name=name) as pool:
        kept = _save(pool, np.arange(10, dtype=np.int64))
        other = pool.allocate(100)
        with _raw_segment(name, pool.size) as mm:
            heap.U32.pack_into(mm, other - heap.BLOCK_HDR, 0xDEAD)  # block magic
            heap.U64.pack_into(mm, heap.OFF_DIRTY, 999_999)
        with pytest.raises(TritonModelException, match="bad block header at offset"):
            pool.allocate(10)
        with pytest.raises(TritonModelException, match="could not be rebuilt"):
            pool.allocate(10)
        with pytest.raises(TritonModelException, match="could not be rebuilt"):
            pool.stats()
        record = load_record(pool, kept)  # intact records still load: no heap walk needed
        assert record.payload.view(np.int64).tolist() == list(range(10))
        del record


# --------------------------------------------------------------------------------- threads
def test_threads_share_a_pool(pool: SharedMemoryPool) -> None:
    errors: list[BaseException] = []
    deadline = time.monotonic() + 1.0

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        mine: list[tuple[int, int]] = []
        try:
            while time.monotonic() < deadline:
                if mine and rng.random() < 0.45:
                    h, crc = mine.pop(int(rng.integers(len(mine))))
                    record = load_record(pool, h)
                    assert zlib.crc32(record.payload) == crc
                    assert record.name == f"t{seed}"
                    del record
                    release(pool, h)
                else:
                    data = rng.integers(0, 255, int(rng.integers(0, 20000)), dtype=np.uint8)
                    h = _save(pool, data, name=f"t{seed}")
                    mine.append((h, zlib.crc32(data)))
            for h, _ in mine:
                release(pool, h)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
