"""pb_tensor.dtypes: Triton types, upstream's Python helpers and the C++ mappings."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from dlpack_ctypes.abi import DLDataTypeCode
from pb_tensor import dtypes
from pb_tensor.dtypes import (
    TRITON_STRING_TO_NUMPY,
    MemoryType,
    TritonDtype,
    numpy_dtype_of,
    numpy_to_triton_type,
    triton_dtype_from_numpy,
    triton_from_dlpack,
    triton_string_to_numpy,
    triton_to_dlpack,
    triton_to_numpy_type,
)
from pb_tensor.errors import TritonBufferError, TritonModelException

T = TritonDtype
UNSUPPORTED = "NumPy dtype is not supported."

# (Triton type, NumPy type, DLPack (code, bits, lanes)) for every type with a NumPy equivalent.
NUMERIC = [
    (T.TYPE_BOOL, np.bool_, (6, 8, 1)),
    (T.TYPE_UINT8, np.uint8, (1, 8, 1)),
    (T.TYPE_UINT16, np.uint16, (1, 16, 1)),
    (T.TYPE_UINT32, np.uint32, (1, 32, 1)),
    (T.TYPE_UINT64, np.uint64, (1, 64, 1)),
    (T.TYPE_INT8, np.int8, (0, 8, 1)),
    (T.TYPE_INT16, np.int16, (0, 16, 1)),
    (T.TYPE_INT32, np.int32, (0, 32, 1)),
    (T.TYPE_INT64, np.int64, (0, 64, 1)),
    (T.TYPE_FP16, np.float16, (2, 16, 1)),
    (T.TYPE_FP32, np.float32, (2, 32, 1)),
    (T.TYPE_FP64, np.float64, (2, 64, 1)),
]


# ------------------------------------------------------------------------------------------------
# Independent re-statements of upstream's algorithms, used as oracles.


def upstream_numpy_to_triton_type(data_type: Any) -> int | None:
    """triton_python_backend_utils.numpy_to_triton_type: a chain of == tests."""
    for value, np_type in enumerate(
        [
            np.bool_,
            np.uint8,
            np.uint16,
            np.uint32,
            np.uint64,
            np.int8,
            np.int16,
            np.int32,
            np.int64,
            np.float16,
            np.float32,
            np.float64,
        ],
        start=1,
    ):
        if data_type == np_type:
            return value
    if data_type in (np.object_, np.bytes_):  # `in` tests == too
        return 13
    return None


def cpp_numpy_to_triton_type(dtype: Any) -> int:
    """pb_stub_utils.cc numpy_to_triton_type: the Python helper's chain plus ``.type``."""
    found = upstream_numpy_to_triton_type(dtype)
    if found is not None:
        return found
    if dtype.type == np.bytes_:
        return 13
    raise TritonModelException(UNSUPPORTED)


def _dtype_zoo() -> list[np.dtype[Any]]:
    """Every dtype NumPy can name, in both byte orders, plus odd ones."""
    zoo: list[np.dtype[Any]] = []
    for code in np.typecodes["All"] + "?":
        base = np.dtype(code)
        zoo += [base, base.newbyteorder("<"), base.newbyteorder(">")]
    zoo += [
        np.dtype("S1"),
        np.dtype("S5"),
        np.dtype("S300"),
        np.dtype("U7"),
        np.dtype("V16"),
        np.dtype("M8[ns]"),
        np.dtype("m8[D]"),
        np.dtype([("a", "f4")]),
        np.dtype([("a", "O")]),
        np.dtype(("f4", (2,))),
        np.dtype("f4", metadata={"unit": "m"}),
        np.dtype("O", metadata={"x": 1}),
        np.dtype("S3", metadata={"x": 1}),
    ]
    if hasattr(np, "dtypes") and hasattr(np.dtypes, "StringDType"):
        zoo.append(np.dtypes.StringDType())
    try:
        import ml_dtypes
    except ImportError:
        pass
    else:
        zoo += [np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)]
    return zoo


DTYPE_ZOO = _dtype_zoo()


# ------------------------------------------------------------------------------------------------
# TritonDtype / MemoryType


def test_triton_dtype_values_match_tritonserver_h() -> None:
    expected = {
        "TYPE_INVALID": 0,
        "TYPE_BOOL": 1,
        "TYPE_UINT8": 2,
        "TYPE_UINT16": 3,
        "TYPE_UINT32": 4,
        "TYPE_UINT64": 5,
        "TYPE_INT8": 6,
        "TYPE_INT16": 7,
        "TYPE_INT32": 8,
        "TYPE_INT64": 9,
        "TYPE_FP16": 10,
        "TYPE_FP32": 11,
        "TYPE_FP64": 12,
        "TYPE_BYTES": 13,
        "TYPE_BF16": 14,
    }
    assert {t.name: t.value for t in TritonDtype} == expected
    # TYPE_STRING is an alias: the same member (mypy models enum aliases as distinct literals,
    # hence the lookups through __members__ and the int() below).
    assert T.__members__["TYPE_STRING"] is T.TYPE_BYTES
    assert T(13) is T.TYPE_BYTES
    assert T(13).name == "TYPE_BYTES"
    eleven = 11
    assert eleven == T.TYPE_FP32
    assert isinstance(T.TYPE_FP32, int)


@pytest.mark.parametrize(
    ("dtype", "wire", "itemsize"),
    [
        (T.TYPE_INVALID, "<invalid>", 0),
        (T.TYPE_BOOL, "BOOL", 1),
        (T.TYPE_UINT8, "UINT8", 1),
        (T.TYPE_UINT16, "UINT16", 2),
        (T.TYPE_UINT32, "UINT32", 4),
        (T.TYPE_UINT64, "UINT64", 8),
        (T.TYPE_INT8, "INT8", 1),
        (T.TYPE_INT16, "INT16", 2),
        (T.TYPE_INT32, "INT32", 4),
        (T.TYPE_INT64, "INT64", 8),
        (T.TYPE_FP16, "FP16", 2),
        (T.TYPE_FP32, "FP32", 4),
        (T.TYPE_FP64, "FP64", 8),
        (T.TYPE_BYTES, "BYTES", 0),
        (T.TYPE_BF16, "BF16", 2),
    ],
)
def test_wire_name_and_itemsize(dtype: TritonDtype, wire: str, itemsize: int) -> None:
    assert dtype.wire_name == wire
    assert dtype.itemsize == itemsize


def test_str_is_the_number_on_every_python() -> None:
    assert str(T.TYPE_FP32) == "11"
    assert f"{T.TYPE_BYTES}" == "13"
    assert f"{T.TYPE_FP16:>3}" == " 10"
    assert repr(T.TYPE_FP32) == "<TritonDtype.TYPE_FP32: 11>"
    assert str(MemoryType.GPU) == "2"


def test_memory_type_values() -> None:
    assert {m.name: m.value for m in MemoryType} == {"CPU": 0, "CPU_PINNED": 1, "GPU": 2}


def test_all_lists_existing_public_names() -> None:
    assert sorted(dtypes.__all__) == sorted(set(dtypes.__all__))
    for name in dtypes.__all__:
        assert hasattr(dtypes, name), name
        assert not name.startswith("_")


# ------------------------------------------------------------------------------------------------
# triton_python_backend_utils helpers


@pytest.mark.parametrize(("triton", "np_type", "dl"), NUMERIC)
def test_triton_to_numpy_type_numeric(triton: TritonDtype, np_type: type, dl: object) -> None:
    assert triton_to_numpy_type(int(triton)) is np_type
    assert triton_to_numpy_type(triton) is np_type


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (13, np.object_),
        (0, None),
        (14, None),
        (15, None),
        (-1, None),
        (True, np.bool_),  # True == 1, as upstream's == chain
        (1.0, np.bool_),
        (12.0, np.float64),
        (np.int64(13), np.object_),
        (np.uint8(2), np.uint8),
        ("1", None),
        ("TYPE_FP32", None),
        (None, None),
        ([1], None),
        (np.array(11), np.float32),  # unhashable: the == chain still applies
    ],
)
def test_triton_to_numpy_type_edge_cases(value: object, expected: type | None) -> None:
    assert triton_to_numpy_type(value) is expected


def test_triton_to_numpy_type_ambiguous_array_raises_like_upstream() -> None:
    with pytest.raises(ValueError, match="ambiguous"):
        triton_to_numpy_type(np.array([1, 2]))


@pytest.mark.parametrize(("triton", "np_type", "dl"), NUMERIC)
def test_numpy_to_triton_type_numeric(triton: TritonDtype, np_type: type, dl: object) -> None:
    assert numpy_to_triton_type(np_type) == triton
    assert numpy_to_triton_type(np.dtype(np_type)) == triton
    assert numpy_to_triton_type(np.dtype(np_type)) is triton


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (np.object_, 13),
        (np.dtype(object), 13),
        (np.bytes_, 13),
        (np.dtype("S"), 13),  # unsized S equals np.bytes_
        (np.dtype("S5"), None),  # sized S does not: only the C++ helper looks at .type
        (np.dtype("<U2"), None),
        (np.str_, None),
        (np.dtype(">f4"), None),
        (np.dtype(">i8"), None),
        (np.dtype("<f4"), 11),
        (np.dtype("e"), 10),
        (np.intc, 8),
        (np.dtype(np.longlong), 9),
        (np.longlong, None),  # a distinct scalar type on Linux: type == type is identity
        (np.complex64, None),
        (np.dtype("M8[s]"), None),
        (np.void, None),
        (bool, None),
        (int, None),
        (float, None),
        (bytes, None),
        (str, None),
        ("float32", None),
        (None, None),
        (11, None),
    ],
)
def test_numpy_to_triton_type_edge_cases(value: object, expected: int | None) -> None:
    result = numpy_to_triton_type(value)
    assert result == expected
    if expected is not None:
        assert isinstance(result, TritonDtype)


@pytest.mark.parametrize("dtype", DTYPE_ZOO, ids=str)
def test_numpy_to_triton_type_matches_upstream_chain(dtype: np.dtype[Any]) -> None:
    assert numpy_to_triton_type(dtype) == upstream_numpy_to_triton_type(dtype)
    assert numpy_to_triton_type(dtype.type) == upstream_numpy_to_triton_type(dtype.type)


def test_numpy_to_triton_type_bfloat16_is_none() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert numpy_to_triton_type(ml_dtypes.bfloat16) is None
    assert numpy_to_triton_type(np.dtype(ml_dtypes.bfloat16)) is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("TYPE_BOOL", bool),
        ("TYPE_UINT8", np.uint8),
        ("TYPE_UINT16", np.uint16),
        ("TYPE_UINT32", np.uint32),
        ("TYPE_UINT64", np.uint64),
        ("TYPE_INT8", np.int8),
        ("TYPE_INT16", np.int16),
        ("TYPE_INT32", np.int32),
        ("TYPE_INT64", np.int64),
        ("TYPE_FP16", np.float16),
        ("TYPE_FP32", np.float32),
        ("TYPE_FP64", np.float64),
        ("TYPE_STRING", np.object_),
    ],
)
def test_triton_string_to_numpy(name: str, expected: type) -> None:
    assert triton_string_to_numpy(name) is expected
    assert TRITON_STRING_TO_NUMPY[name] is expected


@pytest.mark.parametrize("name", ["TYPE_BF16", "TYPE_BYTES", "TYPE_INVALID", "FP32", "type_fp32"])
def test_triton_string_to_numpy_unknown_raises_key_error(name: str) -> None:
    with pytest.raises(KeyError) as info:
        triton_string_to_numpy(name)
    assert info.value.args == (name,)


def test_triton_string_to_numpy_table_is_upstreams_and_read_only() -> None:
    assert len(TRITON_STRING_TO_NUMPY) == 13
    with pytest.raises(TypeError):
        TRITON_STRING_TO_NUMPY["TYPE_BF16"] = np.uint16  # type: ignore[index]


# ------------------------------------------------------------------------------------------------
# triton_dtype_from_numpy (C++ constructor rules)


@pytest.mark.parametrize(("triton", "np_type", "dl"), NUMERIC)
def test_from_numpy_accepts_native_numeric(triton: TritonDtype, np_type: type, dl: object) -> None:
    assert triton_dtype_from_numpy(np.dtype(np_type)) is triton
    assert triton_dtype_from_numpy(np.zeros(2, np_type).dtype) is triton


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (np.dtype(object), T.TYPE_BYTES),
        (np.dtype("S"), T.TYPE_BYTES),
        (np.dtype("S1"), T.TYPE_BYTES),
        (np.dtype("S5"), T.TYPE_BYTES),
        (np.dtype("S300"), T.TYPE_BYTES),
        (np.array([b"ab", b"c"]).dtype, T.TYPE_BYTES),
        (np.dtype("S3", metadata={"x": 1}), T.TYPE_BYTES),
        (np.dtype("O", metadata={"x": 1}), T.TYPE_BYTES),
        (np.dtype("f4", metadata={"unit": "m"}), T.TYPE_FP32),
        (np.dtype(np.intc), T.TYPE_INT32),
        (np.dtype(np.longlong), T.TYPE_INT64),
        (np.dtype(np.ulonglong), T.TYPE_UINT64),
        (np.dtype("e"), T.TYPE_FP16),
        (np.dtype("=i4"), T.TYPE_INT32),
        (np.dtype("<i4"), T.TYPE_INT32),  # native on the little-endian hosts this targets
        (np.dtype(">i1"), T.TYPE_INT8),  # one byte: byte order is irrelevant ('|')
        (np.dtype(">b1"), T.TYPE_BOOL),
    ],
    ids=str,
)
def test_from_numpy_accepted_edge_cases(dtype: np.dtype[Any], expected: TritonDtype) -> None:
    assert triton_dtype_from_numpy(dtype) is expected


def _rejected() -> list[Any]:
    rejected: list[Any] = [
        np.dtype("<U3"),
        np.dtype(">i4"),
        np.dtype(">u2"),
        np.dtype(">f2"),
        np.dtype(">f4"),
        np.dtype(">f8"),
        np.dtype("complex64"),
        np.dtype("complex128"),
        np.dtype("M8[s]"),
        np.dtype("m8[ms]"),
        np.dtype("V4"),
        np.dtype([("a", "f4")]),
        np.dtype([("a", "O")]),
        np.dtype(("f4", (2,))),
        np.dtype(np.longdouble),
    ]
    if hasattr(np, "dtypes") and hasattr(np.dtypes, "StringDType"):
        rejected.append(np.dtypes.StringDType())
    try:
        import ml_dtypes
    except ImportError:
        pass
    else:
        rejected += [np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)]
    return rejected


@pytest.mark.parametrize("dtype", _rejected(), ids=str)
def test_from_numpy_rejects_with_upstream_message(dtype: np.dtype[Any]) -> None:
    with pytest.raises(TritonModelException) as info:
        triton_dtype_from_numpy(dtype)
    assert str(info.value) == UNSUPPORTED
    assert type(info.value) is TritonModelException


@pytest.mark.parametrize("dtype", DTYPE_ZOO, ids=str)
def test_from_numpy_fast_path_matches_cpp_chain(dtype: np.dtype[Any]) -> None:
    try:
        expected: int | str = cpp_numpy_to_triton_type(dtype)
    except TritonModelException as exc:
        expected = str(exc)
    for convert in (triton_dtype_from_numpy, dtypes._triton_dtype_from_numpy_slow):
        try:
            got: int | str = convert(dtype)
        except TritonModelException as exc:
            got = str(exc)
        assert got == expected


def test_from_numpy_non_dtype_argument_is_rejected() -> None:
    with pytest.raises(TritonModelException, match=rf"^{re.escape(UNSUPPORTED)}$"):
        triton_dtype_from_numpy([1, 2])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# numpy_dtype_of


@pytest.mark.parametrize(("triton", "np_type", "dl"), NUMERIC)
def test_numpy_dtype_of_numeric(triton: TritonDtype, np_type: type, dl: object) -> None:
    assert numpy_dtype_of(triton) == np.dtype(np_type)
    assert numpy_dtype_of(int(triton)) == np.dtype(np_type)
    assert triton_dtype_from_numpy(numpy_dtype_of(triton)) is triton


def test_numpy_dtype_of_bytes_is_object() -> None:
    assert numpy_dtype_of(T.TYPE_BYTES) == np.dtype(object)
    assert numpy_dtype_of(T.TYPE_STRING) == np.dtype(object)


def test_numpy_dtype_of_bf16_raises_upstream_message() -> None:
    with pytest.raises(TritonModelException) as info:
        numpy_dtype_of(T.TYPE_BF16)
    assert str(info.value) == (
        "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and "
        "from_dlpack() instead."
    )


@pytest.mark.parametrize("value", [T.TYPE_INVALID, 0, 15, 99])
def test_numpy_dtype_of_invalid(value: int) -> None:
    with pytest.raises(TritonModelException) as info:
        numpy_dtype_of(value)
    assert str(info.value) == f"Unsupported triton dtype {int(value)}"


# ------------------------------------------------------------------------------------------------
# DLPack <-> Triton


@pytest.mark.parametrize(("triton", "np_type", "dl"), NUMERIC)
def test_dlpack_numeric_round_trip(
    triton: TritonDtype, np_type: type, dl: tuple[int, int, int]
) -> None:
    assert triton_to_dlpack(triton) == dl
    assert all(type(x) is int for x in triton_to_dlpack(triton))
    assert triton_from_dlpack(*dl) is triton


def test_dlpack_bf16_round_trip() -> None:
    assert triton_to_dlpack(T.TYPE_BF16) == (4, 16, 1)
    assert triton_from_dlpack(4, 16, 1) is T.TYPE_BF16
    assert triton_from_dlpack(DLDataTypeCode.kDLBfloat, 16, 1) is T.TYPE_BF16


def test_dlpack_code_and_bits_follow_numpy_kind_and_itemsize() -> None:
    for triton, np_type, _dl in NUMERIC:
        code, bits, lanes = triton_to_dlpack(triton)
        assert (code, bits, lanes) == (
            {"b": 6, "i": 0, "u": 1, "f": 2}[np.dtype(np_type).kind],
            8 * np.dtype(np_type).itemsize,
            1,
        )


def test_to_dlpack_bytes_refused() -> None:
    with pytest.raises(TritonBufferError) as info:
        triton_to_dlpack(T.TYPE_BYTES)
    assert str(info.value) == "TYPE_BYTES tensors cannot be converted to DLPack."
    assert isinstance(info.value, BufferError)
    assert isinstance(info.value, TritonModelException)


@pytest.mark.parametrize("value", [T.TYPE_INVALID, 0, 15, 99])
def test_to_dlpack_invalid_refused(value: int) -> None:
    with pytest.raises(TritonBufferError) as info:
        triton_to_dlpack(value)
    assert str(info.value) == f'DType code "{int(value)}" is not supported.'


@pytest.mark.parametrize("bits", [0, 8, 32, 64])
def test_from_dlpack_bfloat_wrong_bits_raises(bits: int) -> None:
    with pytest.raises(TritonModelException) as info:
        triton_from_dlpack(4, bits, 1)
    assert str(info.value) == f"Expected BF16 tensor to have 16 bits, but had: {bits}"


@pytest.mark.parametrize(
    ("code", "bits", "lanes"),
    [
        (2, 32, 2),  # vector lanes
        (2, 32, 4),
        (0, 8, 0),
        (4, 16, 2),  # lanes are checked before the BF16 width
        (4, 8, 2),
        (6, 1, 1),  # bool must be 8 bits
        (6, 16, 1),
        (2, 8, 1),  # float8 through kDLFloat
        (2, 128, 1),
        (0, 1, 1),
        (0, 4, 1),
        (0, 128, 1),
        (1, 1, 1),
        (1, 128, 1),
        (3, 64, 1),  # opaque handle
        (5, 64, 1),  # complex64
        (5, 128, 1),
        *[(code, 8, 1) for code in range(7, 15)],  # float8 codes
        (15, 6, 1),  # float6
        (16, 6, 1),
        (17, 4, 1),  # float4
        (18, 32, 1),  # bcomplex
        (200, 32, 1),
    ],
)
def test_from_dlpack_unsupported_is_invalid(code: int, bits: int, lanes: int) -> None:
    assert triton_from_dlpack(code, bits, lanes) is T.TYPE_INVALID


def test_from_dlpack_accepts_enum_codes() -> None:
    assert triton_from_dlpack(DLDataTypeCode.kDLFloat, 32, 1) is T.TYPE_FP32
    assert triton_from_dlpack(DLDataTypeCode.kDLBool, 8, 1) is T.TYPE_BOOL
    assert triton_from_dlpack(DLDataTypeCode.kDLComplex, 64, 1) is T.TYPE_INVALID
