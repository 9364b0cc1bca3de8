"""dlpack_ctypes with numpy: round trips in both directions, negotiation and edge cases.

Directions:
* produce: our capsules (``BufferExporter``, ``to_dlpack``) consumed by ``np.from_dlpack`` and by
  our own consumer;
* consume: numpy's capsules (and hand-built ones) consumed by ``from_dlpack``/``consume``.
Zero-copy is checked with data pointers and ``np.shares_memory``; the autouse fixture in
conftest.py checks that nothing is left alive after each test.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import ToDlpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import dlpack_ctypes as dl
from dlpack_ctypes import DataType, DLDeviceType, _views, abi, dtypes

# numpy dtype -> (DLPack code, bits); written out, not derived from the library.
STANDARD = {
    np.dtype(np.bool_): (6, 8),
    np.dtype(np.int8): (0, 8),
    np.dtype(np.int16): (0, 16),
    np.dtype(np.int32): (0, 32),
    np.dtype(np.int64): (0, 64),
    np.dtype(np.uint8): (1, 8),
    np.dtype(np.uint16): (1, 16),
    np.dtype(np.uint32): (1, 32),
    np.dtype(np.uint64): (1, 64),
    np.dtype(np.float16): (2, 16),
    np.dtype(np.float32): (2, 32),
    np.dtype(np.float64): (2, 64),
    np.dtype(np.complex64): (5, 64),
    np.dtype(np.complex128): (5, 128),
}
STANDARD_IDS = [str(d) for d in STANDARD]

# ml_dtypes name -> DLPack code (bits 8 except bfloat16).
ML_CODES = {
    "bfloat16": 4,
    "float8_e3m4": 7,
    "float8_e4m3": 8,
    "float8_e4m3b11fnuz": 9,
    "float8_e4m3fn": 10,
    "float8_e4m3fnuz": 11,
    "float8_e5m2": 12,
    "float8_e5m2fnuz": 13,
    "float8_e8m0fnu": 14,
}

VERSIONS = [pytest.param((1, 3), id="versioned"), pytest.param(None, id="legacy")]


def sample(dtype: np.dtype[Any], shape: tuple[int, ...] = (3, 4)) -> np.ndarray[Any, Any]:
    """Distinct, exactly representable values of ``dtype``."""
    n = int(np.prod(shape))
    if dtype.kind == "b":
        values = np.arange(n) % 3 == 1
    elif dtype.kind == "c":
        values = np.arange(n) + 1j * (np.arange(n) % 5 - 2)
    elif dtype.kind == "u":
        values = np.arange(n) * 3 + 1
    else:
        values = np.arange(n) * 3 - n
    return np.asarray(values).astype(dtype).reshape(shape)


def data_ptr(a: np.ndarray[Any, Any]) -> int:
    return int(a.__array_interface__["data"][0])


def assert_same_view(got: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
    """``got`` is a zero-copy view of exactly the elements of ``src``."""
    assert got.dtype == src.dtype
    assert got.shape == src.shape
    assert got.tobytes() == src.tobytes()  # bitwise, so NaN and -0.0 compare exactly
    if src.size:
        assert data_ptr(got) == data_ptr(src)
        assert np.shares_memory(got, src)
        for n, gs, ss in zip(src.shape, got.strides, src.strides):
            if n > 1:
                assert gs == ss


class LegacyOnly:
    """A pre-2023 producer: ``__dlpack__(stream=None)`` only, legacy capsules via dlpack_ctypes."""

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array
        self.calls: list[dict[str, Any]] = []

    def __dlpack__(self, stream: Any = None) -> Any:
        self.calls.append({"stream": stream})
        return dl.to_dlpack(self.array)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


# ------------------------------------------------------------------------------------------------
# Every standard dtype, both directions, legacy and versioned


@pytest.mark.parametrize("dtype", list(STANDARD), ids=STANDARD_IDS)
@pytest.mark.parametrize("producer", ["BufferExporter", "to_dlpack"])
def test_produce_into_numpy(dtype: np.dtype[Any], producer: str) -> None:
    a = sample(dtype)
    exporter = dl.BufferExporter.from_numpy(a) if producer == "BufferExporter" else ToDlpack(a)
    b = np.from_dlpack(exporter)
    assert_same_view(b, a)
    assert b.flags.writeable
    b[0, 0] = a[1, 1]
    assert a[0, 0] == a[1, 1]


@pytest.mark.parametrize("dtype", list(STANDARD), ids=STANDARD_IDS)
def test_produce_legacy_into_numpy(dtype: np.dtype[Any]) -> None:
    a = sample(dtype)
    producer = LegacyOnly(a)
    b = np.from_dlpack(producer)
    assert_same_view(b, a)
    # numpy first asks for a versioned capsule, gets TypeError, then retries legacy.
    assert producer.calls == [{"stream": None}]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", list(STANDARD), ids=STANDARD_IDS)
def test_produce_into_our_consumer(dtype: np.dtype[Any], version: tuple[int, int] | None) -> None:
    a = sample(dtype)
    t = dl.consume(dl.to_dlpack(a, max_version=version))
    code, bits = STANDARD[dtype]
    assert t.dtype == DataType(code, bits, 1)
    assert t.version == version
    assert t.device == (DLDeviceType.kDLCPU, 0)
    assert (t.shape, t.strides, t.byte_offset) == ((3, 4), (4, 1), 0)
    assert t.data == data_ptr(a)
    v = t.numpy()
    assert_same_view(v, a)
    # A legacy capsule cannot say whether writes are allowed: its views are read-only.
    assert v.flags.writeable == (version is not None)
    assert t.readonly == (version is None)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", list(STANDARD), ids=STANDARD_IDS)
def test_consume_numpy(dtype: np.dtype[Any], version: tuple[int, int] | None) -> None:
    a = sample(dtype)
    t = dl.from_dlpack(a) if version else dl.consume(a.__dlpack__(), legacy_writable=True)
    code, bits = STANDARD[dtype]
    assert t.dtype == DataType(code, bits, 1)
    assert (t.version is None) == (version is None)
    if version:
        assert t.version is not None
        assert t.version[0] == 1
    assert t.device == (DLDeviceType.kDLCPU, 0)
    assert t.shape == (3, 4)
    assert (t.ndim, t.size, t.nbytes) == (2, 12, 12 * a.itemsize)
    assert t.is_c_contiguous()
    assert not t.readonly
    assert not t.is_copied
    v = t.numpy()
    assert_same_view(v, a)
    v[2, 3] = a[0, 1]
    assert a[2, 3] == a[0, 1]


@pytest.mark.parametrize("char", ["l", "q", "L", "Q", "i", "I", "h", "H", "b", "B"])
def test_integer_aliases(char: str) -> None:
    dtype = np.dtype(char)
    expected = DataType(0 if dtype.kind == "i" else 1, dtype.itemsize * 8, 1)
    assert dl.from_numpy_dtype(dtype) == expected
    assert dl.to_numpy_dtype(expected) == dtype
    a = np.arange(5, dtype=dtype)
    t = dl.from_dlpack(dl.BufferExporter.from_numpy(a))
    assert t.dtype == expected
    assert_same_view(t.numpy(), a)


# ------------------------------------------------------------------------------------------------
# dtypes module


def test_dtype_tables() -> None:
    for dtype, (code, bits) in STANDARD.items():
        assert dl.from_numpy_dtype(dtype) == DataType(code, bits, 1)
        assert dl.to_numpy_dtype(DataType(code, bits, 1)) == dtype
        assert dl.to_numpy_dtype((code, bits, 1)) == dtype  # type: ignore[arg-type]
    assert DataType(2, 32) == (2, 32, 1)


@pytest.mark.parametrize(
    "dtype",
    [DataType(2, 32, 2), DataType(3, 64, 1), DataType(5, 32, 1), DataType(17, 4, 1),
     DataType(99, 8, 1), DataType(2, 8, 1)],
    ids=str,
)
def test_to_numpy_dtype_none(dtype: DataType) -> None:
    assert dl.to_numpy_dtype(dtype) is None


@pytest.mark.parametrize("spec", ["O", "U3", "S2", "M8[s]", "m8[ns]", "V4", "g", "G"])
def test_unsupported_numpy_dtypes(spec: str) -> None:
    dtype = np.dtype(spec)
    message = rf"DLPack cannot represent numpy dtype={dtype!s}: only bool"
    with pytest.raises(BufferError, match=message.replace("[", r"\[")):
        dl.from_numpy_dtype(dtype)
    a = np.zeros(3, dtype=dtype)
    with pytest.raises(BufferError, match="DLPack cannot represent numpy"):
        dl.to_dlpack(a)
    with pytest.raises(BufferError, match="DLPack cannot represent numpy"):
        dl.BufferExporter.from_numpy(a)


@pytest.mark.parametrize("spec", [">f4", ">i8", ">c16", "<f4" if sys.byteorder == "big" else ">u2"])
def test_non_native_byte_order(spec: str) -> None:
    a = np.zeros(3, dtype=spec)
    with pytest.raises(BufferError, match=r"DLPack only supports native byte order: dtype="):
        dl.to_dlpack(a, max_version=(1, 0))
    with pytest.raises(BufferError, match=r"native byte order"):
        dl.BufferExporter.from_numpy(a)


def test_datatype_itemsize_and_repr() -> None:
    assert DataType(2, 32, 1).itemsize == 4
    assert DataType(2, 32, 4).itemsize == 16
    assert DataType(17, 4, 1).itemsize == 1
    assert DataType(16, 6, 1).itemsize == 1
    assert DataType(5, 128, 1).itemsize == 16
    assert repr(DataType(4, 16, 1)) == "DataType(code=kDLBfloat, bits=16, lanes=1)"
    assert repr(DataType(99, 8, 1)) == "DataType(code=99, bits=8, lanes=1)"


# ------------------------------------------------------------------------------------------------
# bfloat16 / float8: through ml_dtypes when installed, as raw DataType otherwise


@pytest.fixture
def ml_dtypes() -> Any:
    return pytest.importorskip("ml_dtypes")


@pytest.fixture
def without_ml_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behave as if ml_dtypes were not installed (its lookups are cached, so reset the caches)."""
    monkeypatch.setattr(dtypes, "_ml_dtypes", lambda: None)
    monkeypatch.setattr(
        dtypes,
        "_TO_NUMPY",
        {k: v for k, v in dtypes._TO_NUMPY.items() if v.type.__module__ == "numpy"},
    )
    for key in list(_views.VIEW_INFO):
        monkeypatch.delitem(_views.VIEW_INFO, key)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", list(ML_CODES))
def test_ml_dtypes_round_trip(ml_dtypes: Any, name: str, version: tuple[int, int] | None) -> None:
    ml_type = getattr(ml_dtypes, name, None)
    if ml_type is None:
        pytest.skip(f"ml_dtypes {ml_dtypes.__version__} has no {name}")
    expected = DataType(ML_CODES[name], 16 if name == "bfloat16" else 8, 1)
    a = np.array([0.5, -1.0, 2.0, 0.25, 1.5, 4.0], dtype=np.float32).astype(ml_type)
    if name == "float8_e8m0fnu":  # unsigned, powers of two only
        a = np.array([0.5, 1.0, 2.0, 0.25, 1.0, 4.0], dtype=np.float32).astype(ml_type)
    assert dl.from_numpy_dtype(a.dtype) == expected
    assert dl.to_numpy_dtype(expected) == a.dtype
    for capsule in (
        dl.to_dlpack(a, max_version=version),
        dl.BufferExporter.from_numpy(a).__dlpack__(max_version=version),
    ):
        t = dl.consume(capsule)
        assert t.dtype == expected
        v = t.numpy()
        assert_same_view(v, a)
        raw = t.numpy(raw=True)
        assert raw.dtype == np.dtype(f"u{a.itemsize}")
        assert np.array_equal(raw, a.view(raw.dtype))
        assert np.shares_memory(raw, a)


@pytest.mark.usefixtures("without_ml_dtypes")
@pytest.mark.parametrize("name", list(ML_CODES))
def test_bfloat16_float8_without_ml_dtypes(name: str) -> None:
    bits = 16 if name == "bfloat16" else 8
    dtype = DataType(ML_CODES[name], bits, 1)
    storage = np.arange(1, 7, dtype=f"u{bits // 8}")
    assert dl.to_numpy_dtype(dtype) is None
    exporter = dl.BufferExporter(storage, data_ptr(storage), (2, 3), None, dtype)
    for version in ((1, 3), None):
        t = dl.consume(exporter.__dlpack__(max_version=version))
        assert t.dtype == dtype
        with pytest.raises(
            BufferError, match=rf"numpy has no dtype for {dtype!r}; install ml_dtypes".replace(
                "(", r"\(").replace(")", r"\)")
        ):
            t.numpy()
        raw = t.numpy(raw=True)
        assert_same_view(raw, storage.reshape(2, 3))
        t.close()


@pytest.mark.usefixtures("without_ml_dtypes")
def test_ml_dtype_arrays_not_exportable_without_ml_dtypes(ml_dtypes: Any) -> None:
    a = np.zeros(3, dtype=ml_dtypes.bfloat16)
    with pytest.raises(BufferError, match="DLPack cannot represent numpy dtype=bfloat16"):
        dl.to_dlpack(a)


# ------------------------------------------------------------------------------------------------
# Layouts: 0-d, size 0, C/F order, strided, negative strides, offsets


BASE = np.arange(60, dtype=np.float64).reshape(3, 4, 5)
LAYOUTS: dict[str, Callable[[], np.ndarray[Any, Any]]] = {
    "c-order": BASE.copy,
    "f-order": lambda: np.asfortranarray(BASE),
    "transposed": lambda: BASE.copy().transpose(2, 0, 1),
    "0-d": lambda: np.array(2.5),
    "0-d-view": lambda: BASE.copy()[1, 2, 3, ...],
    "size-0-leading": lambda: np.zeros((0, 3)),
    "size-0-trailing": lambda: np.zeros((3, 0)),
    "size-0-slice": lambda: BASE.copy()[:, 2:2, :],
    "size-1-dims": lambda: BASE.copy()[1:2, :, 3:4],
    "step-2": lambda: BASE.copy()[::2, 1::2],
    "reversed": lambda: BASE.copy()[::-1],
    "negative-inner": lambda: BASE.copy()[:, ::-2, ::-1],
    "offset-slice": lambda: BASE.copy()[1:, 2:, 3:],
    "mixed": lambda: BASE.copy()[::-1, 1:, ::3].transpose(1, 2, 0),
    "broadcast": lambda: np.broadcast_to(np.arange(5.0), (4, 5)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_produce_into_numpy(layout: str) -> None:
    v = LAYOUTS[layout]()
    assert_same_view(np.from_dlpack(dl.BufferExporter.from_numpy(v)), v)
    assert_same_view(np.from_dlpack(ToDlpack(v)), v)
    if v.flags.writeable:
        assert_same_view(np.from_dlpack(LegacyOnly(v)), v)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_consume(layout: str, version: tuple[int, int] | None) -> None:
    v = LAYOUTS[layout]()
    if version is None and not v.flags.writeable:
        pytest.skip("numpy refuses legacy export of read-only arrays")
    t = dl.consume(v.__dlpack__(max_version=version))
    assert t.shape == v.shape
    for n, s, bs in zip(v.shape, t.strides, v.strides):
        if n > 1 and v.size:  # strides of empty arrays are arbitrary
            assert s * v.itemsize == bs
    assert t.is_c_contiguous() == (v.flags.c_contiguous or v.size == 0)
    assert_same_view(t.numpy(), v)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_produce_into_our_consumer(layout: str) -> None:
    v = LAYOUTS[layout]()
    for capsule in (
        dl.to_dlpack(v, max_version=(1, 3)),
        dl.BufferExporter.from_numpy(v).__dlpack__(max_version=(1, 0)),
    ):
        t = dl.consume(capsule)
        assert t.data == data_ptr(v)
        assert t.byte_offset == 0  # offsets are folded into data
        assert t.readonly == (not v.flags.writeable)
        assert_same_view(t.numpy(), v)


def test_strides_not_multiple_of_itemsize() -> None:
    field = np.zeros(4, dtype=[("a", "<i4"), ("b", "u1")])["a"]
    message = r"byte strides are not multiples of its itemsize: strides=\(5,\), itemsize=4"
    with pytest.raises(BufferError, match=message):
        dl.to_dlpack(field, max_version=(1, 0))
    with pytest.raises(BufferError, match=message):
        dl.BufferExporter.from_numpy(field)
    # A size-1 dimension may have any stride: it is divided as numpy's own exporter does.
    base = np.arange(8, dtype=np.int32)
    odd = np.lib.stride_tricks.as_strided(base, shape=(3, 1), strides=(8, 5))
    assert dl.consume(odd.__dlpack__(max_version=(1, 3))).strides == (2, 1)
    for capsule in (dl.to_dlpack(odd, max_version=(1, 3)),
                    dl.BufferExporter.from_numpy(odd).__dlpack__(max_version=(1, 3))):
        t = dl.consume(capsule)
        assert t.strides == (2, 1)
        assert_same_view(t.numpy(), odd)


def test_byte_offset_hand_built(make_capsule: Any) -> None:
    base = np.arange(10.0)
    for version in ((1, 3), None):
        capsule, info = make_capsule(base, shape=(4,), byte_offset=16, version=version)
        t = dl.consume(capsule, legacy_writable=True)
        assert t.byte_offset == 16
        assert t.data == data_ptr(base) + 16
        v = t.numpy()
        assert_same_view(v, base[2:6])
        v[0] = -1.0
        assert base[2] == -1.0
        del t, v
        assert info.calls == 1


def test_byte_offset_unaligned_with_strides(make_capsule: Any) -> None:
    raw = np.arange(64, dtype=np.uint8)
    capsule, _ = make_capsule(
        raw, shape=(3, 2), strides=(4, 1), dtype=(2, 32, 1), byte_offset=2, version=(1, 3)
    )
    t = dl.consume(capsule)
    v = t.numpy()
    expected = np.frombuffer(raw.tobytes()[2:], dtype=np.float32, count=12).reshape(3, 4)[:, :2]
    assert v.tobytes() == expected.tobytes()
    assert data_ptr(v) == data_ptr(raw) + 2
    assert v.strides == (16, 4)
    assert not v.flags.aligned


def test_export_buffer_folds_offsets() -> None:
    base = np.arange(20, dtype=np.int32)
    capsule = dl.export_buffer(base, data_ptr(base) + 12, (2, 3), (6, 2), DataType(0, 32))
    t = dl.consume(capsule)
    assert (t.byte_offset, t.data, t.version, t.strides) == (0, data_ptr(base) + 12, (1, 3), (6, 2))
    assert_same_view(t.numpy(), base[3:].reshape(-1)[: 2 * 6].reshape(2, 6)[:, ::2])


def test_null_strides_mean_c_order(make_capsule: Any) -> None:
    a = sample(np.dtype(np.int16), (2, 3, 4))
    for version in ((1, 3), None, (1, 1)):
        capsule, _ = make_capsule(a, strides=None, version=version)
        t = dl.consume(capsule)
        assert t.strides == (12, 4, 1)
        assert_same_view(t.numpy(), a)


def test_0d_null_shape_and_size0_null_data(make_capsule: Any) -> None:
    scalar = np.array(3 + 4j, dtype=np.complex64)
    capsule, _ = make_capsule(scalar, shape=(), strides=None)
    t = dl.consume(capsule)
    assert (t.shape, t.strides, t.ndim, t.size) == ((), (), 0, 1)
    assert_same_view(t.numpy(), scalar)

    capsule, _ = make_capsule(shape=(0, 3), dtype=(2, 32, 1), data=0)
    t = dl.consume(capsule)
    assert (t.data, t.shape, t.size, t.nbytes) == (0, (0, 3), 0, 0)
    v = t.numpy()
    assert v.shape == (0, 3)
    assert v.dtype == np.float32


def test_size0_null_data_exports() -> None:
    exporter = dl.BufferExporter(None, 0, (0, 3), None, DataType(5, 128))
    for b in (np.from_dlpack(exporter), dl.from_dlpack(exporter).numpy(),
              dl.from_dlpack(exporter, copy=True).numpy()):
        assert b.shape == (0, 3)
        assert b.dtype == np.complex128
    t = dl.from_dlpack(exporter)
    assert t.data == 0  # the producer's value is reported as is
    assert t.numpy().__array_interface__["data"][0] != 0


def test_unknown_minor_and_flags_accepted(make_capsule: Any) -> None:
    a = sample(np.dtype(np.float32))
    capsule, _ = make_capsule(
        a, version=(1, 99), flags=abi.DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED | (1 << 40)
    )
    t = dl.consume(capsule)
    assert t.version == (1, 99)
    assert t.flags == 4 | (1 << 40)
    assert not t.readonly
    assert_same_view(t.numpy(), a)


@pytest.mark.parametrize(
    ("dtype", "raw_dtype"),
    [((5, 32, 1), "u4"), ((3, 64, 1), "u8"), ((2, 32, 2), None), ((17, 4, 1), None)],
    ids=["complex32", "opaque", "lanes2", "float4"],
)
def test_dtypes_numpy_cannot_view(
    make_capsule: Any, dtype: tuple[int, int, int], raw_dtype: str | None
) -> None:
    storage = np.arange(8, dtype=np.uint64)
    capsule, _ = make_capsule(storage, shape=(4,), dtype=dtype)
    t = dl.consume(capsule)
    assert t.dtype == DataType(*dtype)
    if raw_dtype is None:
        with pytest.raises(BufferError, match=r"DLPackTensor.numpy: numpy cannot view"):
            t.numpy(raw=True)
    else:
        with pytest.raises(BufferError, match=r"numpy has no dtype for"):
            t.numpy()
        raw = t.numpy(raw=True)
        assert raw.dtype == np.dtype(raw_dtype)
        assert data_ptr(raw) == data_ptr(storage)


# ------------------------------------------------------------------------------------------------
# Read-only


def readonly(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    a.flags.writeable = False
    return a


def test_readonly_produce_versioned() -> None:
    a = readonly(sample(np.dtype(np.float32)))
    b = np.from_dlpack(dl.BufferExporter.from_numpy(a))
    assert_same_view(b, a)
    assert not b.flags.writeable
    b2 = np.from_dlpack(ToDlpack(a))
    assert not b2.flags.writeable
    t = dl.consume(dl.to_dlpack(a, max_version=(1, 0)))
    assert t.readonly
    assert t.flags & abi.DLPACK_FLAG_BITMASK_READ_ONLY
    v = t.numpy()
    assert not v.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        v[0, 0] = 1


def test_readonly_produce_legacy_raises() -> None:
    a = readonly(sample(np.dtype(np.int32)))
    message = r"cannot export read-only data as a legacy 'dltensor' capsule"
    with pytest.raises(BufferError, match=message):
        dl.to_dlpack(a)
    with pytest.raises(BufferError, match=message):
        dl.to_dlpack(a, max_version=(0, 8))
    with pytest.raises(BufferError, match=message):
        dl.BufferExporter.from_numpy(a).__dlpack__()
    with pytest.raises(BufferError, match=message):
        np.from_dlpack(LegacyOnly(a))
    with pytest.raises(BufferError, match=message):
        dl.export_buffer(a, data_ptr(a), a.shape, None, DataType(0, 32), versioned=False,
                         readonly=True)
    # A copy is writable, so a legacy copy is fine (and trusted, it imports writable).
    t = dl.consume(dl.to_dlpack(a, copy=True), legacy_writable=True)
    assert not t.readonly
    v = t.numpy()
    assert np.array_equal(v, a)
    assert not np.shares_memory(v, a)


def test_readonly_consume() -> None:
    a = readonly(sample(np.dtype(np.uint16)))
    t = dl.from_dlpack(a)
    assert t.readonly
    v = t.numpy()
    assert_same_view(v, a)
    assert not v.flags.writeable


def test_readonly_flag_hand_built_and_legacy_writable(make_capsule: Any) -> None:
    a = sample(np.dtype(np.float64))
    capsule, _ = make_capsule(a, flags=abi.DLPACK_FLAG_BITMASK_READ_ONLY)
    v = dl.consume(capsule).numpy()
    assert not v.flags.writeable
    capsule, _ = make_capsule(a, version=None)
    v = dl.consume(capsule).numpy()
    assert not v.flags.writeable  # legacy capsules cannot say read-only: imported read-only
    capsule, _ = make_capsule(a, version=None)
    v = dl.consume(capsule, legacy_writable=True).numpy()
    assert v.flags.writeable  # unless the caller trusts the producer


# ------------------------------------------------------------------------------------------------
# copy=True


def test_copy_true_produce() -> None:
    a = sample(np.dtype(np.complex64))
    for exporter in (dl.BufferExporter.from_numpy(a), ToDlpack(a)):
        b = np.from_dlpack(exporter, copy=True)
        assert np.array_equal(b, a)
        assert not np.shares_memory(b, a)
        b[0, 0] = 99
        assert a[0, 0] != 99
        t = dl.from_dlpack(exporter, copy=True)
        assert t.is_copied
        assert t.flags == abi.DLPACK_FLAG_BITMASK_IS_COPIED
        assert t.is_c_contiguous()
        v = t.numpy()
        assert np.array_equal(v, a)
        assert not np.shares_memory(v, a)
        assert v.flags.writeable


def test_copy_true_strided_and_readonly() -> None:
    a = readonly(BASE.copy()[::-1, 1:, ::2])
    t = dl.from_dlpack(dl.BufferExporter.from_numpy(a), copy=True)
    assert t.is_copied
    assert not t.readonly
    assert t.is_c_contiguous()
    v = t.numpy()
    assert np.array_equal(v, a)
    assert not np.shares_memory(v, a)


def test_copy_true_consume_numpy() -> None:
    a = sample(np.dtype(np.int64))
    t = dl.from_dlpack(a, copy=True)
    assert t.is_copied
    v = t.numpy()
    assert np.array_equal(v, a)
    assert not np.shares_memory(v, a)


def test_copy_false_shares() -> None:
    a = sample(np.dtype(np.int8))
    assert_same_view(np.from_dlpack(dl.BufferExporter.from_numpy(a), copy=False), a)
    t = dl.from_dlpack(dl.BufferExporter.from_numpy(a), copy=False)
    assert not t.is_copied
    assert_same_view(t.numpy(), a)


def test_copy_must_be_bool() -> None:
    a = sample(np.dtype(np.int8))
    with pytest.raises(TypeError, match=r"copy must be True, False or None: copy=1"):
        dl.to_dlpack(a, copy=1)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# dl_device


def test_dl_device_cpu() -> None:
    a = sample(np.dtype(np.float32))
    t = dl.consume(dl.to_dlpack(a, dl_device=(1, 0), max_version=(1, 3)))
    assert t.device == (DLDeviceType.kDLCPU, 0)
    t.close()
    t = dl.from_dlpack(dl.BufferExporter.from_numpy(a), device=(1, 0))
    assert t.device == (DLDeviceType.kDLCPU, 0)
    assert_same_view(t.numpy(), a)
    assert_same_view(np.from_dlpack(dl.BufferExporter.from_numpy(a), device="cpu"), a)


def test_dl_device_other_raises() -> None:
    a = sample(np.dtype(np.float32))
    message = r"unsupported device requested: dl_device=\(2, 0\), the data is on device=\(1, 0\)"
    with pytest.raises(BufferError, match=message):
        dl.to_dlpack(a, dl_device=(2, 0))
    with pytest.raises(BufferError, match=message):
        dl.from_dlpack(dl.BufferExporter.from_numpy(a), device=(2, 0))
    with pytest.raises(BufferError, match=r"dl_device=\(1, 1\)"):
        dl.to_dlpack(a, dl_device=(1, 1))
    with pytest.raises(TypeError, match=r"dl_device must be a pair of integers or None"):
        dl.to_dlpack(a, dl_device="cpu")  # type: ignore[arg-type]


def test_dl_device_host_memory_relabelled() -> None:
    a = sample(np.dtype(np.float32))
    pinned = dl.BufferExporter(a, data_ptr(a), a.shape, None, DataType(2, 32), (3, 0))
    assert pinned.__dlpack_device__() == (DLDeviceType.kDLCUDAHost, 0)
    t = dl.from_dlpack(pinned)
    assert t.device == (DLDeviceType.kDLCUDAHost, 0)
    assert_same_view(t.numpy(), a)  # host-accessible
    t.close()
    t = dl.from_dlpack(pinned, device=(1, 0))
    assert t.device == (DLDeviceType.kDLCPU, 0)
    assert_same_view(t.numpy(), a)


def test_device_memory() -> None:
    # Host memory labelled as CUDA: exporting only describes it, nothing reads it.
    a = sample(np.dtype(np.float32))
    cuda = dl.BufferExporter(a, data_ptr(a), a.shape, None, DataType(2, 32), (2, 1))
    assert cuda.__dlpack_device__() == (DLDeviceType.kDLCUDA, 1)
    t = dl.from_dlpack(cuda)
    assert t.device == (DLDeviceType.kDLCUDA, 1)
    assert t.data == data_ptr(a)
    with pytest.raises(BufferError, match=r"is not host-accessible"):
        t.numpy()
    t.close()
    with pytest.raises(BufferError, match=r"unsupported device requested: dl_device=\(1, 0\)"):
        dl.from_dlpack(cuda, device=(1, 0))
    with pytest.raises(BufferError, match=r"copy=True is not supported for device memory"):
        dl.from_dlpack(cuda, copy=True)
    # numpy's own error (RuntimeError before numpy 2.5, BufferError since).
    with pytest.raises((RuntimeError, BufferError), match=r"Unsupported device in DLTensor"):
        np.from_dlpack(cuda)


# ------------------------------------------------------------------------------------------------
# stream


@pytest.mark.parametrize("stream", [None, -1])
def test_stream_cpu_ok(stream: int | None) -> None:
    a = sample(np.dtype(np.float32))
    t = dl.consume(dl.to_dlpack(a, stream=stream, max_version=(1, 3)))
    assert_same_view(t.numpy(), a)
    t.close()
    t = dl.from_dlpack(dl.BufferExporter.from_numpy(a), stream=stream)
    assert_same_view(t.numpy(), a)


@pytest.mark.parametrize("stream", [0, 1, 2, -2, 0x7F00_0000])
def test_stream_cpu_rejected(stream: int) -> None:
    a = sample(np.dtype(np.float32))
    message = rf"device type 1 has no streams: stream must be None or -1: stream={stream}"
    with pytest.raises(ValueError, match=message):
        dl.to_dlpack(a, stream=stream)
    with pytest.raises(ValueError, match=message):
        dl.from_dlpack(dl.BufferExporter.from_numpy(a), stream=stream)


@pytest.mark.parametrize("stream", [True, 1.0, "1"])
def test_stream_type(stream: object) -> None:
    a = sample(np.dtype(np.float32))
    with pytest.raises(TypeError, match=r"stream must be an int or None: stream="):
        dl.to_dlpack(a, stream=stream)


def test_stream_cuda_rules() -> None:
    a = sample(np.dtype(np.float32))
    cuda = dl.BufferExporter(a, data_ptr(a), a.shape, None, DataType(2, 32), (2, 0))
    for stream in (None, -1, 1, 2, 0x5555_0000):
        dl.consume(cuda.__dlpack__(stream=stream, max_version=(1, 3))).close()
    with pytest.raises(ValueError, match=r"stream=0 is ambiguous for CUDA"):
        cuda.__dlpack__(stream=0)
    with pytest.raises(ValueError, match=r"stream must be -1, None or a stream handle: stream=-2"):
        cuda.__dlpack__(stream=-2)
    rocm = dl.BufferExporter(a, data_ptr(a), a.shape, None, DataType(2, 32), (10, 0))
    dl.consume(rocm.__dlpack__(stream=0, max_version=(1, 3))).close()  # 0 is valid on ROCm
    with pytest.raises(ValueError, match=r"stream=-5"):
        rocm.__dlpack__(stream=-5)


def test_raw_capsule_cannot_negotiate() -> None:
    a = sample(np.dtype(np.float32))
    capsule = a.__dlpack__(max_version=(1, 0))
    message = r"device, copy and stream cannot be negotiated with a raw capsule"
    for kwargs in ({"device": (1, 0)}, {"copy": True}, {"stream": -1}):
        with pytest.raises(ValueError, match=message):
            dl.from_dlpack(capsule, **kwargs)
    # Still consumable afterwards.
    assert_same_view(dl.from_dlpack(capsule).numpy(), a)


# ------------------------------------------------------------------------------------------------
# max_version and negotiation


@pytest.mark.parametrize(
    ("max_version", "expected"),
    [(None, None), ((0, 8), None), ((1, 0), (1, 3)), ((1, 3), (1, 3)), ((1, 99), (1, 3)),
     ((2, 0), (1, 3)), ([1, 0], (1, 3))],
    ids=str,
)
def test_max_version(max_version: Any, expected: tuple[int, int] | None) -> None:
    a = sample(np.dtype(np.float32))
    for capsule in (
        dl.to_dlpack(a, max_version=max_version),
        dl.BufferExporter.from_numpy(a).__dlpack__(max_version=max_version),
    ):
        t = dl.consume(capsule)
        assert t.version == expected
        assert_same_view(t.numpy(), a)


@pytest.mark.parametrize("max_version", ["ab", (1,), 1, (1, 2, 3), ("x", 0)], ids=str)
def test_max_version_type_errors(max_version: Any) -> None:
    a = sample(np.dtype(np.float32))
    with pytest.raises(TypeError, match=r"max_version must be a pair of integers or None"):
        dl.to_dlpack(a, max_version=max_version)
    with pytest.raises(TypeError, match=r"max_version must be a pair of integers or None"):
        dl.BufferExporter.from_numpy(a).__dlpack__(max_version=max_version)


def test_negotiate() -> None:
    assert dl.negotiate((1, 0)) == (False, False, (1, 0))
    assert dl.negotiate((1, 0), max_version=(1, 0)) == (True, False, (1, 0))
    assert dl.negotiate((1, 0), copy=True) == (False, True, (1, 0))
    assert dl.negotiate((13, 0), dl_device=(1, 0), max_version=(1, 0)) == (True, False, (1, 0))
    assert dl.negotiate((2, 3), stream=7, dl_device=(2, 3)) == (False, False, (2, 3))
    assert dl.negotiate((1, 0), readonly=True, max_version=(1, 0)) == (True, False, (1, 0))
    assert dl.negotiate((1, 0), readonly=True, copy=True) == (False, True, (1, 0))
    with pytest.raises(BufferError, match="read-only"):
        dl.negotiate((1, 0), readonly=True)


def test_from_dlpack_asks_for_1_3_and_falls_back() -> None:
    a = sample(np.dtype(np.float32))
    modern = ToDlpack(a)
    t = dl.from_dlpack(modern)
    assert modern.calls == [{"max_version": (1, 3)}]
    assert t.version == (1, 3)
    t.close()
    t = dl.from_dlpack(modern, device=(1, 0), copy=False, stream=-1)
    assert modern.calls[-1] == {"max_version": (1, 3), "dl_device": (1, 0), "copy": False,
                                "stream": -1}
    t.close()

    legacy = LegacyOnly(a)
    t = dl.from_dlpack(legacy)
    assert legacy.calls == [{"stream": None}]
    assert t.version is None
    assert_same_view(t.numpy(), a)
    t.close()
    t = dl.from_dlpack(legacy, stream=-1)
    assert legacy.calls[-1] == {"stream": -1}
    t.close()
    # No fallback when the caller asked for copy or device: the TypeError propagates.
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        dl.from_dlpack(legacy, copy=True)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        dl.from_dlpack(legacy, device=(1, 0))
    assert len(legacy.calls) == 2


def test_from_dlpack_rejects_non_producers() -> None:
    with pytest.raises(TypeError, match=r"expects a DLPack capsule or an object with __dlpack__"):
        dl.from_dlpack([1, 2, 3])
    with pytest.raises(TypeError, match=r"consume expects a PyCapsule: got list"):
        dl.consume([1, 2, 3])

    class Bad:
        def __dlpack__(self, **kwargs: Any) -> object:
            return "not a capsule"

    with pytest.raises(TypeError, match=r"consume expects a PyCapsule: got str"):
        dl.from_dlpack(Bad())


def test_to_dlpack_requires_ndarray() -> None:
    with pytest.raises(TypeError, match=r"to_dlpack expects a numpy.ndarray: got list"):
        dl.to_dlpack([1.0, 2.0])  # type: ignore[arg-type]


def test_export_argument_validation() -> None:
    a = np.zeros(4)
    with pytest.raises(ValueError, match=r"shape entries must be >= 0"):
        dl.BufferExporter(a, data_ptr(a), (2, -1), None, DataType(2, 64))
    with pytest.raises(ValueError, match=r"strides must have one entry per dimension"):
        dl.BufferExporter(a, data_ptr(a), (2, 2), (1,), DataType(2, 64))
    with pytest.raises(ValueError, match=r"shape entries must be >= 0"):
        dl.export_buffer(a, data_ptr(a), (-1,), None, DataType(2, 64))
    with pytest.raises(BufferError, match=r"cannot export ndim=65: at most 64 dimensions"):
        dl.export_buffer(a, data_ptr(a), (1,) * 65, None, DataType(2, 64))
    with pytest.raises(BufferError, match=r"cannot export ndim=65"):
        dl.BufferExporter(a, data_ptr(a), (1,) * 65, None, DataType(2, 64))


def test_64_dimensions() -> None:
    a = np.arange(2.0).reshape((1,) * 63 + (2,))
    t = dl.from_dlpack(dl.BufferExporter.from_numpy(a))
    assert t.ndim == 64
    assert_same_view(t.numpy(), a)
    assert_same_view(np.from_dlpack(ToDlpack(a)), a)


# ------------------------------------------------------------------------------------------------
# Consumption is single-use; __dlpack__ is idempotent


@pytest.mark.parametrize("version", VERSIONS)
def test_consumed_capsule_cannot_be_consumed_again(version: tuple[int, int] | None) -> None:
    a = sample(np.dtype(np.float32))
    used = "used_dltensor_versioned" if version else "used_dltensor"
    for capsule in (dl.to_dlpack(a, max_version=version), a.__dlpack__(max_version=version)):
        t = dl.consume(capsule)
        message = rf"DLPack capsule was already consumed: name='{used}'"
        with pytest.raises(ValueError, match=message):
            dl.consume(capsule)
        with pytest.raises(ValueError, match=message):
            dl.from_dlpack(capsule)
        assert_same_view(t.numpy(), a)  # the first consumer is unaffected


def test_numpy_consumed_capsule_cannot_be_consumed_by_us(make_capsule: Any) -> None:
    a = sample(np.dtype(np.float32))
    capsule, info = make_capsule(a)

    class Holder:
        def __dlpack__(self, **kwargs: Any) -> Any:
            return capsule

        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

    b = np.from_dlpack(Holder())
    assert make_capsule.name(capsule) == b"used_dltensor_versioned"
    with pytest.raises(ValueError, match=r"already consumed: name='used_dltensor_versioned'"):
        dl.consume(capsule)
    assert_same_view(b, a)
    del b
    assert info.calls == 1


def test_not_a_dlpack_capsule(make_capsule: Any) -> None:
    a = sample(np.dtype(np.float32))
    capsule, info = make_capsule(a, name=b"not_a_dltensor")
    with pytest.raises(ValueError, match=r"not a DLPack capsule: name=b'not_a_dltensor'"):
        dl.consume(capsule)
    assert info.calls == 0
    # Give it back its DLPack name so that its destructor (the producer) releases it.
    make_capsule.rename(capsule, b"dltensor_versioned")
    del capsule
    assert info.calls == 1


def test_dlpack_is_idempotent() -> None:
    a = sample(np.dtype(np.uint8))
    exporter = dl.BufferExporter.from_numpy(a)
    c1 = exporter.__dlpack__(max_version=(1, 0))
    c2 = exporter.__dlpack__(max_version=(1, 0))
    c3 = exporter.__dlpack__()
    assert c1 is not c2
    t1, t2, t3 = dl.consume(c1), dl.consume(c2), dl.consume(c3)
    for t in (t1, t2, t3):
        assert_same_view(t.numpy(), a)
    b = np.from_dlpack(exporter)
    assert_same_view(b, a)
    assert exporter.__dlpack_device__() == (DLDeviceType.kDLCPU, 0)
    assert isinstance(exporter.__dlpack_device__()[0], DLDeviceType)


# ------------------------------------------------------------------------------------------------
# numpy rejecting our capsule: numpy's own error must surface, and nothing leaks


@pytest.mark.parametrize(
    ("dtype", "shape", "device", "error"),
    [
        (DataType(4, 16, 1), (8,), (1, 0), "Unsupported dtype in DLTensor."),
        (DataType(10, 8, 1), (16,), (1, 0), "Unsupported dtype in DLTensor."),
        (DataType(2, 32, 2), (4,), (1, 0), "Unsupported lanes in DLTensor dtype."),
        (DataType(2, 32, 1), (8,), (2, 0), "Unsupported device in DLTensor."),
    ],
    ids=["bfloat16", "float8", "lanes", "device"],
)
def test_numpy_error_preserved(
    dtype: DataType, shape: tuple[int, ...], device: tuple[int, int], error: str
) -> None:
    storage = np.zeros(8, dtype=np.float32)
    base = sys.getrefcount(storage)
    exporter = dl.BufferExporter(storage, data_ptr(storage), shape, None, dtype, device)
    with pytest.raises((RuntimeError, BufferError)) as info:
        np.from_dlpack(exporter)
    # Exactly numpy's error: not SystemError, not chained onto anything of ours.
    assert type(info.value) in (RuntimeError, BufferError)
    assert not isinstance(info.value, SystemError)
    assert str(info.value) == error
    assert info.value.__context__ is None
    assert info.value.__cause__ is None
    del info
    assert dl.flush() == 0  # the dropped, unconsumed capsule was released
    del exporter
    assert sys.getrefcount(storage) == base


# ------------------------------------------------------------------------------------------------
# Reference counts of exported owners


def test_owner_refcount_back_to_baseline() -> None:
    a = sample(np.dtype(np.float64))
    base = sys.getrefcount(a)

    b = np.from_dlpack(dl.BufferExporter.from_numpy(a))
    assert sys.getrefcount(a) > base
    del b
    assert sys.getrefcount(a) == base

    b = np.from_dlpack(ToDlpack(a))
    del b
    assert sys.getrefcount(a) == base

    t = dl.consume(dl.to_dlpack(a, max_version=(1, 3)))
    v = t.numpy()
    del t
    assert sys.getrefcount(a) > base  # the view keeps the export alive
    del v
    assert sys.getrefcount(a) == base

    capsule = dl.to_dlpack(a)
    del capsule
    dl.flush()
    assert sys.getrefcount(a) == base

    t = dl.from_dlpack(a)  # numpy producer, our consumer
    v = t.numpy()
    t.close()
    del t, v
    assert sys.getrefcount(a) == base

    with pytest.raises(BufferError):
        dl.to_dlpack(a, dl_device=(2, 0))
    assert sys.getrefcount(a) == base


def test_dlpack_tensor_repr_and_properties() -> None:
    a = sample(np.dtype(np.float32))[:, ::2]
    with dl.from_dlpack(dl.BufferExporter.from_numpy(a)) as t:
        assert repr(t) == (
            "DLPackTensor(shape=(3, 2), dtype=DataType(code=kDLFloat, bits=32, lanes=1), "
            "device=(kDLCPU, 0), readonly=False)"
        )
        assert not t.closed
        assert not t.is_c_contiguous()
        assert (t.ndim, t.size, t.nbytes, t.strides) == (2, 6, 24, (4, 2))
    assert t.closed
    assert repr(t).endswith("readonly=False, closed)")
    with pytest.raises(BufferError, match=r"DLPackTensor.numpy: the tensor was closed"):
        t.numpy()


# ------------------------------------------------------------------------------------------------
# Property-based round trips

ALL_DTYPES = list(STANDARD)


@st.composite
def arrays_and_views(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
    base = draw(hnp.arrays(dtype, shape))
    if base.ndim == 0 or not draw(st.booleans()):
        return base
    index = tuple(
        slice(
            draw(st.none() | st.integers(-n - 1, n + 1)),
            draw(st.none() | st.integers(-n - 1, n + 1)),
            draw(st.sampled_from([1, 2, 3, -1, -2, -3])),
        )
        for n in base.shape
    )
    view = base[index]
    order = draw(st.permutations(range(view.ndim)))
    return view.transpose(order)


HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@HYPOTHESIS
@given(arrays_and_views())
def test_hypothesis_produce_into_numpy(v: np.ndarray[Any, Any]) -> None:
    assert_same_view(np.from_dlpack(dl.BufferExporter.from_numpy(v)), v)
    assert_same_view(np.from_dlpack(ToDlpack(v)), v)
    assert_same_view(np.from_dlpack(LegacyOnly(v)), v)
    assert dl.live_exports() == 0


@HYPOTHESIS
@given(arrays_and_views(), st.sampled_from([(1, 3), None]))
def test_hypothesis_consume(v: np.ndarray[Any, Any], version: tuple[int, int] | None) -> None:
    t = dl.consume(v.__dlpack__(max_version=version))
    assert t.shape == v.shape
    assert_same_view(t.numpy(), v)
    t = dl.consume(dl.to_dlpack(v, max_version=version))
    assert t.data == data_ptr(v)
    assert_same_view(t.numpy(), v)
    del t
    assert dl.live_exports() == 0


@HYPOTHESIS
@given(arrays_and_views())
def test_hypothesis_copy(v: np.ndarray[Any, Any]) -> None:
    t = dl.from_dlpack(dl.BufferExporter.from_numpy(v), copy=True)
    c = t.numpy()
    assert c.tobytes() == v.tobytes()
    assert c.flags.c_contiguous
    if v.size:
        assert not np.shares_memory(c, v)
    del t, c
    assert dl.live_exports() == 0


@HYPOTHESIS
@given(
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    offset_elems=st.integers(0, 3),
    dtype=st.sampled_from(ALL_DTYPES),
    version=st.sampled_from([(1, 3), (1, 0), None]),
)
def test_hypothesis_hand_built(
    make_capsule: Any,
    shape: tuple[int, ...],
    offset_elems: int,
    dtype: np.dtype[Any],
    version: tuple[int, int] | None,
) -> None:
    size = int(np.prod(shape))
    storage = sample(dtype, (size + offset_elems,))
    capsule, info = make_capsule(
        storage, shape=shape, byte_offset=offset_elems * dtype.itemsize, version=version,
        strides="c" if shape else None,
    )
    t = dl.consume(capsule)
    expected = storage[offset_elems:].reshape(shape)
    assert t.byte_offset == offset_elems * dtype.itemsize
    assert_same_view(t.numpy(), expected)
    del t
    assert info.calls == 1


def test_ctypes_memory_export() -> None:
    class Owner:
        def __init__(self) -> None:
            self.buf = (ctypes.c_int32 * 6)(*range(6))

    owner = Owner()
    exporter = dl.BufferExporter(owner, ctypes.addressof(owner.buf), (2, 3), None,
                                 DataType(0, 32))
    b = np.from_dlpack(exporter)
    del owner, exporter  # the export keeps the owner (and its buffer) alive
    assert b.tolist() == [[0, 1, 2], [3, 4, 5]]
    b[1, 1] = 40
    assert b[1, 1] == 40
