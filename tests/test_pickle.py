"""Pickling Tensors: every protocol, protocol-5 out-of-band buffers, every kind of Tensor
(numeric, BYTES, BF16, pinned, DLPack-imported, shared-memory), GPU refusal, corrupted and
truncated pickles, and multiprocessing pools (spawn and fork, in a subprocess)."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from cuda_fake import FakeCudaRuntime
from travel_workers import make_bf16, raw_bytes, writable

import dlpack_ctypes as dl
from pb_tensor import (
    MemoryType,
    Tensor,
    TritonDtype,
    TritonModelException,
    cuda,
    serialize_byte_tensor,
)
from pb_tensor.shm import SharedMemoryPool
from pb_tensor.tensor import _rebuild_tensor

PROTOCOLS = list(range(pickle.HIGHEST_PROTOCOL + 1))
NUMERIC = [np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32,
           np.int64, np.float16, np.float32, np.float64]
SHAPES = [(), (0,), (2, 0, 3), (5,), (2, 3), (3, 1, 2)]
CORRUPT = "Tensor pickle is corrupted or truncated: "
GPU_REFUSAL = (
    "Tensor 'gpu' is stored in GPU memory (device 1) and cannot be pickled: call to_host() "
    "first to pickle a host copy"
)


def _values(dtype: Any, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    n = int(np.prod(shape))
    return (np.arange(n) % 7 + 1).astype(dtype).reshape(shape)


def _oob(t: object) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []
    return pickle.dumps(t, protocol=5, buffer_callback=buffers.append), buffers


def _same(a: Tensor, b: Tensor) -> None:
    assert (a.name(), a.triton_dtype(), a.shape()) == (b.name(), b.triton_dtype(), b.shape())
    assert raw_bytes(a) == raw_bytes(b)


# ================================================================================================
# Round trips


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("dtype", NUMERIC, ids=lambda d: np.dtype(d).name)
def test_numeric_round_trip_every_protocol(protocol: int, dtype: Any) -> None:
    for shape in SHAPES:
        a = _values(dtype, shape)
        loaded = pickle.loads(pickle.dumps(Tensor("INPUT0", a), protocol=protocol))
        assert type(loaded) is Tensor
        assert loaded.name() == "INPUT0"
        assert loaded.triton_dtype() is Tensor("x", a).triton_dtype()
        assert loaded.shape() == list(shape)
        assert loaded.memory_type is MemoryType.CPU
        assert loaded.memory_type_id == 0
        out = loaded.as_numpy()
        assert out.dtype == a.dtype
        assert out.shape == shape
        np.testing.assert_array_equal(out, a)
        # In band, a writable tensor loads writable, as numpy's own pickles do.
        assert out.flags.writeable
        assert out.flags.c_contiguous
        assert not np.shares_memory(out, a)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_read_only_tensor_loads_read_only_in_band(protocol: int) -> None:
    a = np.arange(6, dtype=np.int32)
    a.flags.writeable = False
    loaded = pickle.loads(pickle.dumps(Tensor("ro", a), protocol=protocol))
    out = loaded.as_numpy()
    np.testing.assert_array_equal(out, a)
    assert not out.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        out[0] = 1


def test_name_is_kept_exactly() -> None:
    for name in ["x", "INPUT__0", "naïve ☃ 名前", "a" * 1000, "\udcff lone surrogate"]:
        loaded = pickle.loads(pickle.dumps(Tensor(name, np.zeros(1)), protocol=5))
        assert loaded.name() == name


def test_reduce_and_copy_module() -> None:
    t = Tensor("c", np.arange(4.0))
    rebuild, args = t.__reduce__()
    assert rebuild is _rebuild_tensor
    legacy = rebuild(*args)
    _same(legacy, t)
    assert legacy.as_numpy().flags.writeable
    for clone in (copy.copy(t), copy.deepcopy(t)):
        _same(clone, t)
        assert not np.shares_memory(clone.as_numpy(), t.as_numpy())


def test_repr_after_loading() -> None:
    loaded = pickle.loads(pickle.dumps(Tensor("r", np.zeros((2, 3), np.float32)), protocol=5))
    assert repr(loaded) == "Tensor(name='r', dtype=FP32, shape=[2, 3], device=CPU)"


# ================================================================================================
# Protocol 5: out-of-band buffers


def test_out_of_band_stream_holds_only_metadata() -> None:
    a = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    stream, buffers = _oob(Tensor("big", a))
    assert len(buffers) == 1
    raw = buffers[0].raw()
    assert raw.nbytes == a.nbytes
    assert np.shares_memory(np.frombuffer(raw, dtype=np.float32), a)  # no copy at dumps
    assert len(stream) < 200
    assert a[1:64].tobytes() not in stream


@pytest.mark.parametrize("dtype", NUMERIC, ids=lambda d: np.dtype(d).name)
def test_out_of_band_load_views_the_buffer(dtype: Any) -> None:
    for shape in SHAPES:
        a = _values(dtype, shape)
        stream, buffers = _oob(Tensor("v", a))
        received = bytearray(buffers[0].raw())  # writable memory, as from a socket
        loaded = pickle.loads(stream, buffers=[received])
        out = loaded.as_numpy()
        np.testing.assert_array_equal(out, a)
        assert out.shape == shape
        assert out.dtype == a.dtype
        assert out.flags.writeable
        if a.nbytes:
            assert np.shares_memory(out, np.frombuffer(received, dtype=np.uint8))
            assert received[: a.itemsize] != bytes(a.itemsize)
            out.flat[0] = 0  # writes land in the received buffer
            assert received[: a.itemsize] == bytes(a.itemsize)


def test_out_of_band_read_only_buffer_gives_read_only_view() -> None:
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    stream, buffers = _oob(Tensor("ro", a))
    received = bytes(buffers[0].raw())
    loaded = pickle.loads(stream, buffers=[received])
    out = loaded.as_numpy()
    np.testing.assert_array_equal(out, a)
    assert not out.flags.writeable
    assert loaded.data_ptr == np.frombuffer(received, dtype=np.uint8).ctypes.data
    # DLPack exports say read-only too; a legacy capsule cannot, so it is refused.
    with dl.consume(loaded.__dlpack__(max_version=(1, 3))) as imported:
        assert imported.readonly
        assert imported.data == loaded.data_ptr


def test_in_process_buffers_share_the_source() -> None:
    a = np.arange(10, dtype=np.int16)
    t = Tensor("same", a)
    stream, buffers = _oob(t)
    loaded = pickle.loads(stream, buffers=buffers)
    assert np.shares_memory(loaded.as_numpy(), a)
    assert loaded.data_ptr == t.data_ptr


def test_protocol_5_without_callback_is_in_band() -> None:
    a = np.arange(1 << 16, dtype=np.uint8)
    stream = pickle.dumps(Tensor("inband", a), protocol=5)
    assert len(stream) > a.nbytes
    loaded = pickle.loads(stream)
    np.testing.assert_array_equal(loaded.as_numpy(), a)
    assert loaded.as_numpy().flags.writeable


def test_misaligned_buffer_is_copied_to_aligned_memory() -> None:
    a = np.arange(5, dtype=np.float64)
    stream, buffers = _oob(Tensor("m", a))
    backing = bytearray(a.nbytes + 1)
    backing[1:] = buffers[0].raw()
    received = memoryview(backing)[1:]
    assert np.frombuffer(received, dtype=np.uint8).ctypes.data % 8 != 0
    out = pickle.loads(stream, buffers=[received]).as_numpy()
    np.testing.assert_array_equal(out, a)
    assert out.flags.aligned


def test_numpy_interop_of_loaded_tensor() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    stream, buffers = _oob(Tensor("n", a))
    received = bytearray(buffers[0].raw())
    loaded = pickle.loads(stream, buffers=[received])
    back = np.from_dlpack(loaded)
    np.testing.assert_array_equal(back, a)
    assert np.shares_memory(back, np.frombuffer(received, dtype=np.uint8))
    again = Tensor.from_dlpack("again", loaded)
    assert again.data_ptr == loaded.data_ptr


# ================================================================================================
# BYTES, BF16, pinned, DLPack-imported, shared-memory tensors


BYTES_ARRAYS = [
    np.array([b"ab", b"", b"\x00\xff"], dtype=object),
    np.array([["x", "yz"], ["", "é"]], dtype=object),
    np.array([b"fixed", b"s"], dtype=np.bytes_),
    np.array(b"scalar", dtype=object),
    np.empty((0, 2), dtype=object),
]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("array", BYTES_ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_bytes_round_trip(protocol: int, array: np.ndarray[Any, Any]) -> None:
    t = Tensor("text", array)
    loaded = pickle.loads(pickle.dumps(t, protocol=protocol))
    assert loaded.triton_dtype() is TritonDtype.TYPE_BYTES
    assert loaded.shape() == list(array.shape)
    out = loaded.as_numpy()
    assert out.dtype == object
    assert out.shape == array.shape
    expected = [x if isinstance(x, bytes) else str(x).encode() for x in array.flat]
    assert list(out.flat) == expected
    assert loaded.byte_size == t.byte_size


def test_bytes_go_out_of_band_as_wire_bytes() -> None:
    array = np.array([b"hello", b"", "wörld"], dtype=object)
    t = Tensor("text", array)
    stream, buffers = _oob(t)
    assert len(buffers) == 1
    assert bytes(buffers[0].raw()) == serialize_byte_tensor(array)
    assert b"hello" not in stream
    received = bytes(buffers[0].raw())
    loaded = pickle.loads(stream, buffers=[received])
    assert list(loaded.as_numpy()) == [b"hello", b"", "wörld".encode()]
    # The wire bytes stay a view of the received buffer.
    assert loaded.data_ptr == np.frombuffer(received, dtype=np.uint8).ctypes.data
    assert loaded.byte_size == len(received)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bf16_round_trip(protocol: int) -> None:
    values = [1.0, -2.5, 0.0, 3.140625, 65280.0, -0.0078125]
    t = make_bf16(values)
    loaded = pickle.loads(pickle.dumps(t, protocol=protocol))
    assert loaded.triton_dtype() is TritonDtype.TYPE_BF16
    assert loaded.shape() == [6]
    assert raw_bytes(loaded) == raw_bytes(t)
    assert writable(loaded)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    out = loaded.as_numpy()
    assert out.dtype == ml_dtypes.bfloat16
    assert out.astype(np.float32).tolist() == values


def test_bf16_out_of_band_views_the_buffer() -> None:
    t = make_bf16([1.0, 2.0, 3.0, 4.0])
    stream, buffers = _oob(t)
    assert bytes(buffers[0].raw()) == raw_bytes(t)
    received = bytes(buffers[0].raw())
    loaded = pickle.loads(stream, buffers=[received])
    assert loaded.data_ptr == np.frombuffer(received, dtype=np.uint8).ctypes.data
    assert not writable(loaded)  # the received buffer is read-only
    assert raw_bytes(loaded) == received
    for shape in [(), (0,), (2, 0)]:
        bits = np.zeros(shape, dtype=np.uint16)
        empty = Tensor.from_dlpack(
            "e", dl.BufferExporter(bits, bits.ctypes.data, shape, None, dl.DataType(4, 16, 1))
        )
        stream, buffers = _oob(empty)
        back = pickle.loads(stream, buffers=buffers)
        assert back.shape() == list(shape)
        assert back.triton_dtype() is TritonDtype.TYPE_BF16
        assert raw_bytes(back) == bits.tobytes()
        del empty, back, buffers


def test_pinned_tensor_loads_as_cpu() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    exporter = dl.BufferExporter(a, a.ctypes.data, a.shape, None, dl.DataType(2, 32, 1), (3, 1))
    t = Tensor.from_dlpack("pinned", exporter)
    assert t.memory_type is MemoryType.CPU_PINNED
    for protocol in PROTOCOLS:
        loaded = pickle.loads(pickle.dumps(t, protocol=protocol))
        assert loaded.memory_type is MemoryType.CPU
        assert loaded.memory_type_id == 0
        assert loaded.__dlpack_device__() == (dl.DLDeviceType.kDLCPU, 0)
        np.testing.assert_array_equal(loaded.as_numpy(), a)
    stream, buffers = _oob(t)
    assert np.shares_memory(np.frombuffer(buffers[0].raw(), dtype=np.float32), a)
    del stream, buffers


def test_dlpack_imported_tensors_pickle() -> None:
    a = np.arange(8, dtype=np.int64).reshape(2, 4)
    producers: list[Callable[[], object]] = [
        lambda: dl.to_dlpack(a),  # a raw legacy capsule
        lambda: dl.BufferExporter.from_numpy(a),
        lambda: dl.to_dlpack(a, max_version=(1, 3)),
    ]
    for make in producers:
        t = Tensor.from_dlpack("imported", make())
        for protocol in PROTOCOLS:
            loaded = pickle.loads(pickle.dumps(t, protocol=protocol))
            np.testing.assert_array_equal(loaded.as_numpy(), a)
        stream, buffers = _oob(t)
        assert np.shares_memory(np.frombuffer(buffers[0].raw(), dtype=np.int64), a)
        del t, stream, buffers


def test_torch_imported_tensor_pickles() -> None:
    torch = pytest.importorskip("torch")
    source = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = Tensor.from_dlpack("torch", source)
    stream, buffers = _oob(t)
    received = bytearray(buffers[0].raw())
    loaded = pickle.loads(stream, buffers=[received])
    back = torch.from_dlpack(loaded)
    assert back.data_ptr() == loaded.data_ptr
    assert torch.equal(back, source)


@pytest.fixture
def pool() -> Iterator[SharedMemoryPool]:
    name = f"pbt_pickle_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    with SharedMemoryPool.create(1 << 16, growth=1 << 16, name=name) as p:
        yield p
        gc.collect()
        stats = p.stats()
        assert (stats.allocations, stats.used) == (0, 0), f"leaked allocations: {stats}"


@pytest.mark.parametrize(
    "array",
    [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([b"a", b"bc"], dtype=object)],
    ids=["fp32", "bytes"],
)
def test_shared_memory_tensors_pickle(pool: SharedMemoryPool, array: np.ndarray[Any, Any]) -> None:
    saved = Tensor("shm", array)
    handle = saved.save_to_shared_memory(pool)
    loaded_from_pool = Tensor.load_from_shared_memory(pool, handle)
    for t in (saved, loaded_from_pool):
        for protocol in PROTOCOLS:
            back = pickle.loads(pickle.dumps(t, protocol=protocol))
            _same(back, t)
            assert back.memory_type is MemoryType.CPU
            # The copy does not hold the record: only the two tensors do.
            assert pool.stats().allocations == 1
        stream, buffers = _oob(t)
        assert np.frombuffer(buffers[0].raw(), dtype=np.uint8).ctypes.data == t.data_ptr
        del stream, buffers
    del saved, loaded_from_pool, t


def test_bf16_from_shared_memory_pickles(pool: SharedMemoryPool) -> None:
    t = make_bf16([1.0, 2.0])
    handle = t.save_to_shared_memory(pool)
    loaded = Tensor.load_from_shared_memory(pool, handle)
    back = pickle.loads(pickle.dumps(loaded, protocol=5))
    assert back.triton_dtype() is TritonDtype.TYPE_BF16
    assert raw_bytes(back) == raw_bytes(t)
    del t, loaded, back


# ================================================================================================
# GPU tensors


def _gpu_tensor(fake: FakeCudaRuntime) -> Tensor:
    host = np.arange(6, dtype=np.float32)
    ptr = cuda.malloc(host.nbytes, device=1)
    cuda.memcpy(ptr, host.ctypes.data, host.nbytes, cuda.MemcpyKind.HOST_TO_DEVICE, device=1)
    exporter = dl.BufferExporter(object(), ptr, host.shape, None, dl.DataType(2, 32, 1), (2, 1))
    t = Tensor.from_dlpack("gpu", exporter.__dlpack__(max_version=(1, 3)))
    fake.take()
    return t


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_gpu_tensor_refuses_to_pickle(fake: FakeCudaRuntime, protocol: int) -> None:
    t = _gpu_tensor(fake)
    assert t.memory_type is MemoryType.GPU
    with pytest.raises(TritonModelException) as info:
        pickle.dumps(t, protocol=protocol)
    assert str(info.value) == GPU_REFUSAL
    with pytest.raises(TritonModelException, match="call to_host"):
        pickle.dumps(t, protocol=5, buffer_callback=lambda b: None)
    assert fake.calls == []  # refused before touching the device
    # The advice works: the host copy pickles.
    back = pickle.loads(pickle.dumps(t.to_host(), protocol=protocol))
    np.testing.assert_array_equal(back.as_numpy(), np.arange(6, dtype=np.float32))
    del t


@pytest.mark.gpu
@pytest.mark.usefixtures("real_cuda")
@pytest.mark.skipif(not cuda.is_available(), reason=cuda.unavailable_reason() or "no GPU")
def test_real_gpu_tensor_refuses_to_pickle() -> None:
    host = np.arange(6, dtype=np.float32)
    ptr = cuda.malloc(host.nbytes, device=0)
    try:
        cuda.memcpy(ptr, host.ctypes.data, host.nbytes, cuda.MemcpyKind.HOST_TO_DEVICE,
                    device=0)  # fmt: skip
        exporter = dl.BufferExporter(object(), ptr, host.shape, None, dl.DataType(2, 32, 1),
                                     (2, 0))  # fmt: skip
        t = Tensor.from_dlpack("gpu", exporter.__dlpack__(max_version=(1, 3)))
        with pytest.raises(TritonModelException, match=r"device 0\) and cannot be pickled"):
            pickle.dumps(t, protocol=5)
        back = pickle.loads(pickle.dumps(t.to_host(), protocol=5))
        np.testing.assert_array_equal(back.as_numpy(), host)
        del t, back
        gc.collect()
    finally:
        cuda.free(ptr, device=0)


# ================================================================================================
# Corrupted and truncated pickles


def _header(t: Tensor) -> tuple[bytes, object]:
    _rebuild, (header, payload) = t.__reduce_ex__(5)
    return header, payload


def test_every_damaged_header_byte_is_detected() -> None:
    t = Tensor("INPUT0", np.arange(6, dtype=np.float32).reshape(2, 3))
    header, payload = _header(t)
    assert _rebuild_tensor(header, payload).shape() == [2, 3]
    for i in range(len(header)):
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(header)
            damaged[i] ^= flip
            with pytest.raises(TritonModelException) as info:
                _rebuild_tensor(bytes(damaged), payload)
            assert str(info.value).startswith(CORRUPT)


def test_truncated_and_extended_headers() -> None:
    header, payload = _header(Tensor("x", np.zeros(3)))
    for n in range(len(header)):
        with pytest.raises(TritonModelException, match="^" + CORRUPT):
            _rebuild_tensor(header[:n], payload)
    with pytest.raises(TritonModelException, match="expected"):
        _rebuild_tensor(header + b"\x00", payload)
    with pytest.raises(TritonModelException, match="the header is a str, expected bytes"):
        _rebuild_tensor("header", payload)


def test_other_format_version_is_named() -> None:
    import struct
    import zlib

    header, payload = _header(Tensor("x", np.zeros(3)))
    body = bytearray(header[:-4])
    body[3] = 2
    with pytest.raises(TritonModelException) as info:
        _rebuild_tensor(bytes(body) + struct.pack("<I", zlib.crc32(body)), payload)
    assert str(info.value) == CORRUPT + "format version 2 (this pb_tensor reads version 1)"
    body[:3] = b"XYZ"
    with pytest.raises(TritonModelException, match="header magic=b'XYZ"):
        _rebuild_tensor(bytes(body) + struct.pack("<I", zlib.crc32(body)), payload)


def test_payload_size_mismatch_is_detected() -> None:
    a = np.arange(6, dtype=np.float32)
    stream, buffers = _oob(Tensor("short", a))
    raw = bytes(buffers[0].raw())
    for wrong in (raw[:-1], raw[:-4], raw + b"\x00", b""):
        with pytest.raises(TritonModelException) as info:
            pickle.loads(stream, buffers=[wrong])
        assert str(info.value) == (
            f"{CORRUPT}the payload of tensor 'short' holds {len(wrong)} bytes, the header says 24"
        )
    with pytest.raises(TritonModelException, match="is not a contiguous buffer"):
        pickle.loads(stream, buffers=[42])
    with pytest.raises(TritonModelException, match="is not a contiguous buffer"):
        pickle.loads(stream, buffers=[memoryview(raw * 2)[::2]])
    with pytest.raises(pickle.UnpicklingError, match="out-of-band"):
        pickle.loads(stream)


def test_damaged_bytes_payload_is_detected() -> None:
    array = np.array([b"abc", b"de"], dtype=object)
    stream, buffers = _oob(Tensor("text", array))
    raw = bytearray(buffers[0].raw())
    raw[0] = 200  # the first length field now points past the end
    with pytest.raises(TritonModelException, match="string extends beyond buffer"):
        pickle.loads(stream, buffers=[raw])
    # Same size, another element count: 3+2 bytes as one 9-byte element.
    one = (9).to_bytes(4, "little") + b"abc" + (2).to_bytes(4, "little") + b"de"
    assert len(one) == len(raw)
    with pytest.raises(TritonModelException, match="expected 2 elements, found 1"):
        pickle.loads(stream, buffers=[one])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_truncated_stream_raises(protocol: int) -> None:
    t = Tensor("cut", np.arange(5, dtype=np.int32))
    stream = pickle.dumps(t, protocol=protocol)
    for n in range(len(stream)):
        with pytest.raises((pickle.UnpicklingError, EOFError, ValueError, TritonModelException)):
            pickle.loads(stream[:n])


FUZZ = """
import pickle, resource, sys
import numpy as np
from pb_tensor import Tensor, TritonModelException

# A damaged length field makes pickle allocate up to 2**64 bytes (or a memo that large): cap the
# address space so that fails at once with MemoryError instead of paging for minutes.
with open("/proc/self/status") as status:
    vm = next(int(line.split()[1]) for line in status if line.startswith("VmSize:")) * 1024
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), hard))

t = Tensor("INPUT0", np.arange(6, dtype=np.float32).reshape(2, 3))
expected = (t.name(), t.triton_dtype(), t.shape(), 24)
streams = {"oob": None, "p5": pickle.dumps(t, protocol=5), "p4": pickle.dumps(t, protocol=4),
           "p2": pickle.dumps(t, protocol=2), "p0": pickle.dumps(t, protocol=0)}
bufs = []
streams["oob"] = pickle.dumps(t, protocol=5, buffer_callback=bufs.append)
raw = bytes(bufs[0].raw())
kinds = {}
for key, stream in streams.items():
    for i in range(len(stream)):
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(stream)
            damaged[i] ^= flip
            try:
                got = pickle.loads(bytes(damaged), buffers=[raw] if key == "oob" else None)
            except Exception as exc:
                kinds[type(exc).__name__] = kinds.get(type(exc).__name__, 0) + 1
                continue
            if type(got) is not Tensor:
                print("NOT A TENSOR", key, i, flip, type(got)); sys.exit(1)
            # A damaged data byte is damaged data, which no pickle detects (numpy's neither):
            # the metadata must hold, and the data must have the original's size.
            seen = (got.name(), got.triton_dtype(), got.shape(), len(got.as_numpy().tobytes()))
            if seen != expected:
                print("WRONG TENSOR", key, i, flip, seen); sys.exit(1)
print(sorted(kinds))
"""


def test_fuzzed_streams_never_give_a_wrong_tensor(
    run_python: Callable[..., Any],
) -> None:
    """Every single-byte damage of whole pickle streams: an exception, or a tensor whose name,
    dtype and shape are the original's (a damaged data byte of an in-band payload cannot be
    told apart from other data). Run in a subprocess: damaged pickles may call anything."""
    # Not in -X dev: its debug allocator fills every (huge, damaged-length) allocation.
    result = run_python(FUZZ, timeout=240, dev_mode=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TritonModelException" in result.stdout


# ================================================================================================
# multiprocessing pools


POOLS = """
import multiprocessing as mp, os, sys
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # a single-threaded parent for fork
import numpy as np
from pb_tensor import Tensor, TritonDtype
from pb_tensor.shm import SharedMemoryPool
import travel_workers as w

method = sys.argv[1]
ctx = mp.get_context(method)
arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array(7, dtype=np.int64),
          np.zeros((2, 0), dtype=np.float64), np.array([b"a", b"", b"xyz"], dtype=object),
          np.arange(1 << 20, dtype=np.uint8)]
tensors = [Tensor(f"t{i}", a) for i, a in enumerate(arrays)] + [w.make_bf16([1.0, -2.0])]
with ctx.Pool(2) as pool:
    seen = pool.map(w.describe, tensors)
    assert seen == [w.describe(t) for t in tensors], (seen, [w.describe(t) for t in tensors])
    doubled = pool.map(w.double, tensors[:5])
    for t, d in zip(tensors, doubled):
        assert type(d) is Tensor and d.name() == t.name() + "_out"
        assert d.triton_dtype() is t.triton_dtype() and d.shape() == t.shape()
        assert d.as_numpy().flags.writeable
        expected = w.double(t).as_numpy()
        assert d.as_numpy().dtype == expected.dtype
        assert np.array_equal(d.as_numpy(), expected)
    made = pool.starmap(w.make, [("a", 5), ("b", 0)])
    assert [m.as_numpy().tolist() for m in made] == [[0, 1, 2, 3, 4], []]
    bf16 = pool.apply(w.make_bf16, ([0.5, 4.0],))
    assert bf16.triton_dtype() is TritonDtype.TYPE_BF16
    assert w.raw_bytes(bf16) == w.raw_bytes(w.make_bf16([0.5, 4.0]))
    # The recipe for large tensors: the pool carries the data, pickling carries a handle.
    with SharedMemoryPool.create(1 << 22) as shm_pool:
        big = Tensor("big", np.ones(1 << 18, dtype=np.float32))
        handle = big.save_to_shared_memory(shm_pool)
        assert pool.apply(w.load_from_pool, (shm_pool.name, handle)) == ("big", float(1 << 18))
        del big
print("ok", method)
"""


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_multiprocessing_pool(run_python: Callable[..., Any], method: str) -> None:
    result = run_python(POOLS, method, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == f"ok {method}"
