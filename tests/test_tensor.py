"""pb_tensor.Tensor built from numpy: construction, errors, methods, BYTES, module helpers.

DLPack import/export is in test_tensor_dlpack.py, torch/JAX interop in test_tensor_interop.py,
shared memory in test_tensor_shm.py. Upstream behaviours come from
Triton python_backend's behaviour and QA tests; deliberate fixes are marked "fix:".
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pb_tensor
from pb_tensor import (
    MemoryType,
    Tensor,
    TritonBufferError,
    TritonDtype,
    TritonModelException,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
)

# numpy dtype -> Triton type, for every numeric type the constructor accepts.
NUMERIC: list[tuple[Any, TritonDtype]] = [
    (np.bool_, TritonDtype.TYPE_BOOL),
    (np.uint8, TritonDtype.TYPE_UINT8),
    (np.uint16, TritonDtype.TYPE_UINT16),
    (np.uint32, TritonDtype.TYPE_UINT32),
    (np.uint64, TritonDtype.TYPE_UINT64),
    (np.int8, TritonDtype.TYPE_INT8),
    (np.int16, TritonDtype.TYPE_INT16),
    (np.int32, TritonDtype.TYPE_INT32),
    (np.int64, TritonDtype.TYPE_INT64),
    (np.float16, TritonDtype.TYPE_FP16),
    (np.float32, TritonDtype.TYPE_FP32),
    (np.float64, TritonDtype.TYPE_FP64),
]
NUMERIC_IDS = [np.dtype(d).name for d, _ in NUMERIC]

EMPTY_NAME = "Tensor name cannot be an empty string."
NUMPY_UNSUPPORTED = "NumPy dtype is not supported."
STRING_DLPACK = "DLPack does not have support for string tensors."


def _wire(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


# ================================================================================================
# Argument validation (upstream qa argument_validation test_tensor_args)


def test_upstream_argument_validation() -> None:
    arr = np.zeros(3, dtype=np.float32)
    with pytest.raises(TypeError):
        Tensor(None, arr)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Tensor("OUTPUT0", None)  # type: ignore[arg-type]
    with pytest.raises(TritonModelException):
        Tensor.from_dlpack("OUTPUT0", None)
    with pytest.raises(TritonModelException):
        Tensor.from_dlpack("", None)
    # The type check runs before the empty-name check, as with pybind11.
    with pytest.raises(TypeError):
        Tensor("", None)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [b"x", 1, ["x"], None])
def test_name_must_be_str(name: object) -> None:
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        Tensor(name, np.zeros(1))  # type: ignore[arg-type]


@pytest.mark.parametrize("array", [[1, 2, 3], (1.0,), 3.0, memoryview(b"ab"), None])
def test_array_must_be_ndarray(array: object) -> None:
    # pybind11's py::array caster accepts real ndarrays only: lists are not converted.
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        Tensor("x", array)  # type: ignore[arg-type]


def test_str_subclass_name_and_ndarray_subclass_accepted() -> None:
    class Name(str):
        pass

    m = np.ma.masked_array([1.0, 2.0])
    t = Tensor(Name("x"), m)
    assert t.name() == "x"
    assert t.shape() == [2]


def test_empty_name_is_triton_exception() -> None:
    with pytest.raises(TritonModelException) as info:
        Tensor("", np.zeros(2))
    assert str(info.value) == EMPTY_NAME
    with pytest.raises(TritonModelException) as info:
        Tensor.from_dlpack("", np.zeros(2))
    assert str(info.value) == EMPTY_NAME


def test_keyword_arguments_rejected_like_pybind() -> None:
    arr = np.zeros(2)
    with pytest.raises(TypeError):
        Tensor(name="x", array=arr)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Tensor("x", array=arr)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Tensor.from_dlpack(name="x", tensor=arr)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Tensor.from_dlpack(123, arr)  # type: ignore[arg-type]
    t = Tensor("x", arr)
    with pytest.raises(TypeError):
        t.__dlpack__(None)  # type: ignore[call-arg]  # __dlpack__'s arguments are keyword-only


@pytest.mark.parametrize(
    "dtype",
    ["<U3", ">i4", ">f8", "complex64", "complex128", "datetime64[s]", "timedelta64[ms]", "V4",
     np.longdouble, [("a", "<i4"), ("b", "<f4")]],
    ids=["str", "big-endian-i4", "big-endian-f8", "c64", "c128", "datetime", "timedelta", "void",
         "longdouble", "structured"],
)
def test_unsupported_numpy_dtypes(dtype: Any) -> None:
    with pytest.raises(TritonModelException) as info:
        Tensor("x", np.zeros(2, dtype=dtype))
    assert str(info.value) == NUMPY_UNSUPPORTED


def test_ml_dtypes_bfloat16_numpy_array_rejected() -> None:
    # As upstream: BF16 tensors cannot be built from numpy, only via DLPack.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with pytest.raises(TritonModelException, match="NumPy dtype is not supported"):
        Tensor("x", np.zeros(2, dtype=ml_dtypes.bfloat16))


@pytest.mark.parametrize("alias", [np.intc, np.longlong, np.ulonglong, "e", np.single, np.double])
def test_numpy_aliases_accepted(alias: Any) -> None:
    t = Tensor("x", np.zeros(2, dtype=alias))
    assert t.triton_dtype() == numpy_to_triton_type(np.dtype(alias))


# ================================================================================================
# Methods and properties


@pytest.mark.parametrize(("np_type", "triton"), NUMERIC, ids=NUMERIC_IDS)
def test_methods(np_type: Any, triton: TritonDtype) -> None:
    a = np.ones((2, 3), dtype=np_type)
    t = Tensor("INPUT0", a)
    assert t.name() == "INPUT0"
    assert t.shape() == [2, 3]
    assert type(t.shape()) is list
    assert t.is_cpu() is True
    # fix: upstream's triton_dtype() raises TypeError (python_backend#382).
    assert t.triton_dtype() is triton
    assert isinstance(t.triton_dtype(), TritonDtype)
    assert t.memory_type is MemoryType.CPU
    assert t.memory_type_id == 0
    assert t.__dlpack_device__() == (1, 0)
    assert t.byte_size == a.nbytes == 6 * np.dtype(np_type).itemsize
    assert t.data_ptr == a.ctypes.data


def test_as_numpy_is_the_callers_array() -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    t = Tensor("x", a)
    assert t.as_numpy() is a
    assert t.as_numpy() is t.as_numpy()
    # Zero copy: the Tensor is a reference to the caller's buffer (as upstream).
    a[0, 0] = 42
    assert np.from_dlpack(t)[0, 0] == 42


def test_shape_is_a_fresh_list() -> None:
    t = Tensor("x", np.zeros((2, 3)))
    s = t.shape()
    s.append(7)
    assert t.shape() == [2, 3]


@pytest.mark.parametrize(
    "make",
    [
        np.asfortranarray,
        lambda a: a.T,
        lambda a: a[:, ::2],
        lambda a: a[::-1],
        lambda a: np.transpose(a.reshape(2, 2, 3), (1, 0, 2)),
    ],
    ids=["fortran", "transposed", "column-strided", "reversed", "transpose-3d"],
)
def test_non_contiguous_numpy_input_is_copied(make: Any) -> None:
    # Upstream test_non_contiguous: non-C-contiguous numpy input is accepted and copied.
    base = np.arange(12, dtype=np.float32).reshape(4, 3)
    view = make(base)
    t = Tensor("x", view)
    out = t.as_numpy()
    assert out.flags.c_contiguous
    np.testing.assert_array_equal(out, view)
    assert not np.shares_memory(out, base)
    assert t.shape() == list(view.shape)
    assert t.data_ptr == out.ctypes.data


def test_upstream_non_contiguous_model() -> None:
    # qa non_contiguous model: reshape, .T and np.transpose of a [2,10,11,6,5] input.
    rng = np.random.default_rng(0)
    x = rng.random((2, 10, 11, 6, 5), dtype=np.float32)
    for out in (x.reshape([10, 2, 6, 5, 11]), x.T, np.transpose(x, [1, 0, 4, 2, 3])):
        t = Tensor("OUTPUT", out)
        np.testing.assert_array_equal(t.as_numpy(), out)
        np.testing.assert_array_equal(np.from_dlpack(t), out)


def test_contiguous_array_with_size1_dims_is_not_copied() -> None:
    a = np.zeros((3, 1, 4), dtype=np.float32)[:, :, :]
    view = a[:, 0:1, :]
    assert view.flags.c_contiguous
    assert Tensor("x", view).as_numpy() is view


@pytest.mark.parametrize("shape", [(0,), (1, 0), (2, 0, 3), (0, 0, 0)])
def test_empty_tensors(shape: tuple[int, ...]) -> None:
    # qa BLS test_zero_length_io: Tensor("INPUT0", np.zeros([1, 0], np.float32)) works.
    a = np.zeros(shape, dtype=np.float32)
    t = Tensor("INPUT0", a)
    assert t.shape() == list(shape)
    assert t.byte_size == 0
    assert t.as_numpy() is a
    out = np.from_dlpack(t)
    assert out.shape == shape
    back = Tensor.from_dlpack("OUTPUT0", t)
    assert back.shape() == list(shape)
    assert back.as_numpy().shape == shape


def test_zero_dim_tensor() -> None:
    a = np.array(3.5, dtype=np.float64)
    t = Tensor("x", a)
    assert t.shape() == []
    assert t.byte_size == 8
    assert np.from_dlpack(t) == 3.5
    back = Tensor.from_dlpack("y", t)
    assert back.shape() == []
    assert back.as_numpy().shape == ()
    assert back.as_numpy() == 3.5
    assert np.shares_memory(back.as_numpy(), a)


def test_to_host_is_identity_for_cpu() -> None:
    t = Tensor("x", np.zeros(3))
    assert t.to_host() is t
    u = Tensor.from_dlpack("y", np.zeros(3))
    assert u.to_host() is u


def test_tensor_has_no_instance_dict() -> None:
    t = Tensor("x", np.zeros(1))
    with pytest.raises(AttributeError):
        t.extra = 1  # type: ignore[attr-defined]


# ================================================================================================
# repr


@pytest.mark.parametrize(
    ("array", "expected"),
    [
        (np.zeros((2, 3), np.float32),
         "Tensor(name='INPUT0', dtype=FP32, shape=[2, 3], device=CPU)"),
        (np.array(1, np.int8), "Tensor(name='INPUT0', dtype=INT8, shape=[], device=CPU)"),
        (np.array([True]), "Tensor(name='INPUT0', dtype=BOOL, shape=[1], device=CPU)"),
        (np.array([b"a"], dtype=object),
         "Tensor(name='INPUT0', dtype=BYTES, shape=[1], device=CPU)"),
        (np.zeros((1, 0), np.uint64),
         "Tensor(name='INPUT0', dtype=UINT64, shape=[1, 0], device=CPU)"),
    ],
)
def test_repr(array: np.ndarray[Any, Any], expected: str) -> None:
    assert repr(Tensor("INPUT0", array)) == expected


def test_repr_quotes_odd_names() -> None:
    assert repr(Tensor("it's", np.zeros(1))).startswith('Tensor(name="it\'s", ')


# ================================================================================================
# BYTES tensors


def test_bytes_object_tensor() -> None:
    arr = np.array(["abc", b"de", 7], dtype=object)
    t = Tensor("s", arr)
    assert t.triton_dtype() is TritonDtype.TYPE_BYTES
    assert t.shape() == [3]
    assert t.as_numpy() is arr  # the original array: str elements stay str
    wire = _wire(b"abc", b"de", b"7")
    assert t.byte_size == len(wire) == len(serialize_byte_tensor(arr) or b"")
    # data_ptr points at the serialized bytes, not at the object array.
    assert t.data_ptr != arr.ctypes.data
    assert t.data_ptr != 0


def test_bytes_s_tensor() -> None:
    arr = np.array([[b"ab", b"c\x00d"], [b"", b"xyz"]])  # S3
    t = Tensor("s", arr)
    assert t.triton_dtype() is TritonDtype.TYPE_BYTES
    assert t.shape() == [2, 2]
    assert t.as_numpy() is arr
    assert t.byte_size == len(_wire(b"ab", b"c\x00d", b"", b"xyz"))


@pytest.mark.parametrize("shape", [(0,), (2, 0)])
def test_bytes_empty(shape: tuple[int, ...]) -> None:
    arr = np.empty(shape, dtype=object)
    t = Tensor("s", arr)
    assert t.byte_size == 0
    assert t.shape() == list(shape)


def test_bytes_zero_dim() -> None:
    arr = np.array(b"xyz", dtype=object)
    t = Tensor("s", arr)
    assert t.shape() == []
    assert t.byte_size == len(_wire(b"xyz"))


def test_bytes_fortran_ordered_serialized_in_c_order() -> None:
    arr = np.asfortranarray(np.array([[b"a", b"b"], [b"c", b"d"]], dtype=object))
    t = Tensor("s", arr)
    assert t.byte_size == len(_wire(b"a", b"b", b"c", b"d"))
    np.testing.assert_array_equal(t.as_numpy(), arr)


def test_bytes_to_dlpack_refused() -> None:
    # Upstream test_dlpack_string_tensor.
    t = Tensor("test_tensor", np.array(["An Example String"], dtype=np.object_))
    with pytest.raises(TritonModelException) as info:
        t.to_dlpack()
    assert str(info.value) == STRING_DLPACK
    for call in (t.__dlpack__, t.to_dlpack, lambda: t.__dlpack__(max_version=(1, 0)),
                 lambda: np.from_dlpack(t)):
        with pytest.raises(BufferError) as binfo:
            call()
        assert isinstance(binfo.value, TritonBufferError)
        assert str(binfo.value) == STRING_DLPACK
    with pytest.raises(TritonModelException, match="string tensors"):
        Tensor.from_dlpack("y", t)


def test_unicode_and_nul_strings() -> None:
    # qa test_unicode / L0_nullchar_string.
    arr = np.array(["\U0001f600", "abc\0def"], dtype=object)
    t = Tensor("s", arr)
    assert t.byte_size == len(_wire("\U0001f600".encode(), b"abc\0def"))


# ================================================================================================
# Module-level helpers (triton_python_backend_utils)


def test_module_exports() -> None:
    for name in ("Tensor", "TritonModelException", "serialize_byte_tensor",
                 "deserialize_bytes_tensor", "triton_to_numpy_type", "numpy_to_triton_type",
                 "triton_string_to_numpy", "TRITON_STRING_TO_NUMPY"):
        assert hasattr(pb_tensor, name)
    assert issubclass(TritonModelException, Exception)
    assert issubclass(TritonBufferError, TritonModelException)
    assert issubclass(TritonBufferError, BufferError)


def test_serialize_byte_tensor_upstream_results() -> None:
    assert serialize_byte_tensor(np.array(["abc", "de"], dtype=object)) == _wire(b"abc", b"de")
    assert serialize_byte_tensor(np.array([b"d\x00"], dtype=object)) == _wire(b"d\x00")
    assert serialize_byte_tensor(np.array([1, 2.5, None], dtype=object)) == _wire(
        b"1", b"2.5", b"None")
    assert serialize_byte_tensor(np.array([True, np.int64(7)], dtype=object)) == _wire(
        b"True", b"7")
    assert serialize_byte_tensor(np.array(["\u00e9\U0001f600"], dtype=object)) == _wire(
        "\u00e9\U0001f600".encode())
    assert serialize_byte_tensor(np.array([b"ab\x00\x00", b"c"])) == _wire(b"ab", b"c")
    assert serialize_byte_tensor(np.array([b"abc\0def"])) == _wire(b"abc\0def")
    assert serialize_byte_tensor(np.zeros((2, 0), dtype=object)) == ()
    assert serialize_byte_tensor(np.zeros(0, dtype=np.float32)) == ()
    assert serialize_byte_tensor(np.zeros(2, dtype=np.float32)) is None


def test_np_bytes_inside_object_array_serialized_as_bytes() -> None:
    # fix: upstream's exact-type test writes np.bytes_ elements as their repr, b"b'ab'".
    arr = np.array([np.bytes_(b"ab"), b"cd"], dtype=object)
    assert serialize_byte_tensor(arr) == _wire(b"ab", b"cd")
    t = Tensor("s", arr)
    assert t.byte_size == len(_wire(b"ab", b"cd"))


def test_deserialize_bytes_tensor_upstream_results() -> None:
    out = deserialize_bytes_tensor(_wire(b"abc", b"", b"d\x00"))
    assert out.dtype == object
    assert out.shape == (3,)
    assert list(out) == [b"abc", b"", b"d\x00"]
    assert all(type(x) is bytes for x in out)
    empty = deserialize_bytes_tensor(b"")
    assert empty.shape == (0,)
    assert empty.dtype == object
    with pytest.raises(TritonModelException, match="Invalid bytes tensor data"):
        deserialize_bytes_tensor(_wire(b"abcdef")[:-2])


def test_type_helpers_upstream_results() -> None:
    for np_type, triton in NUMERIC:
        assert triton_to_numpy_type(int(triton)) is np_type
        assert numpy_to_triton_type(np_type) == triton
        assert numpy_to_triton_type(np.dtype(np_type)) == triton
    assert triton_to_numpy_type(13) is np.object_
    assert triton_to_numpy_type(0) is None
    assert triton_to_numpy_type(14) is None
    assert numpy_to_triton_type(np.object_) == 13
    assert numpy_to_triton_type(np.bytes_) == 13
    assert numpy_to_triton_type(np.dtype("S5")) is None  # only the C++ mapping checks .type
    assert numpy_to_triton_type(np.dtype(">f4")) is None
    assert numpy_to_triton_type(np.dtype("<U2")) is None
    assert triton_string_to_numpy("TYPE_BOOL") is bool
    assert triton_string_to_numpy("TYPE_FP32") is np.float32
    assert triton_string_to_numpy("TYPE_STRING") is np.object_
    with pytest.raises(KeyError):
        triton_string_to_numpy("TYPE_BF16")


def test_triton_dtype_enum() -> None:
    assert int(TritonDtype.TYPE_FP32) == 11
    assert TritonDtype.TYPE_STRING is TritonDtype.TYPE_BYTES
    assert TritonDtype.TYPE_BF16.wire_name == "BF16"
    assert int(MemoryType.CPU_PINNED) == 1


# ================================================================================================
# Property tests


_SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from([d for d, _ in NUMERIC]),
    shape=_SHAPES,
    data=st.data(),
)
def test_numpy_round_trip_property(dtype: Any, shape: tuple[int, ...], data: Any) -> None:
    a = data.draw(hnp.arrays(dtype, shape))
    t = Tensor("x", a)
    assert t.as_numpy() is a
    assert t.shape() == list(shape)
    assert t.byte_size == a.nbytes
    out = np.from_dlpack(t)
    assert out.shape == a.shape
    assert out.dtype == a.dtype
    np.testing.assert_array_equal(out, a)
    back = Tensor.from_dlpack("y", t)
    assert back.triton_dtype() == t.triton_dtype()
    np.testing.assert_array_equal(back.as_numpy(), a)
    if a.size:
        assert np.shares_memory(out, a)
        assert np.shares_memory(back.as_numpy(), a)
        assert back.data_ptr == t.data_ptr


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.int16, np.bool_, np.uint8]),
    shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5),
    data=st.data(),
)
def test_views_property(dtype: Any, shape: tuple[int, ...], data: Any) -> None:
    """Any view: the constructor copies exactly the non-C-contiguous ones; DLPack import
    accepts exactly the C-contiguous ones (numpy's flag ignores size-1 dims and empty arrays,
    as our check does) and reads the right data."""
    base = np.arange(int(np.prod(shape)), dtype=np.int64).astype(dtype).reshape(shape)
    index = data.draw(hnp.basic_indices(shape, allow_newaxis=True, allow_ellipsis=True))
    view = base[index]
    if not isinstance(view, np.ndarray):
        return
    t = Tensor("x", view)
    np.testing.assert_array_equal(t.as_numpy(), view)
    assert (t.as_numpy() is view) == view.flags.c_contiguous
    if view.flags.c_contiguous:
        u = Tensor.from_dlpack("y", view)
        np.testing.assert_array_equal(u.as_numpy(), view)
    else:
        with pytest.raises(TritonModelException, match="not contiguous"):
            Tensor.from_dlpack("y", view)


_TEXT = st.one_of(st.binary(max_size=12), st.text(max_size=6))


@settings(max_examples=60, deadline=None)
@given(
    items=st.lists(_TEXT, max_size=12),
    as_fixed=st.booleans(),
)
def test_bytes_round_trip_property(items: list[bytes | str], as_fixed: bool) -> None:
    if as_fixed:
        raw = [x if isinstance(x, bytes) else x.encode() for x in items]
        arr = np.array(raw, dtype=np.bytes_) if raw else np.empty(0, dtype="S1")
        expected = [x.rstrip(b"\x00") for x in raw]  # numpy drops trailing NULs of S items
    else:
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        expected = [x if isinstance(x, bytes) else x.encode() for x in items]
    t = Tensor("s", arr)
    assert t.as_numpy() is arr
    wire = serialize_byte_tensor(arr)
    if not items:
        assert wire == ()
        assert t.byte_size == 0
        return
    assert isinstance(wire, bytes)
    assert t.byte_size == len(wire) == sum(4 + len(x) for x in expected)
    assert list(deserialize_bytes_tensor(wire)) == expected
