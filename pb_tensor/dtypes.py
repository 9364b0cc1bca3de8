"""Triton data types and their NumPy and DLPack counterparts.

Two families of conversions live here, because upstream has two and they disagree:

* The helpers of ``triton_python_backend_utils`` (:func:`triton_to_numpy_type`,
  :func:`numpy_to_triton_type`, :func:`triton_string_to_numpy`): pure Python in upstream, they
  return ``None`` (or raise ``KeyError``) instead of raising Triton errors, and
  ``numpy_to_triton_type`` does not recognise ``S<n>`` dtypes. They are reproduced result for
  result, because model code branches on those results.
* The C++ mappings the ``Tensor`` uses (:func:`triton_dtype_from_numpy`, :func:`numpy_dtype_of`,
  :func:`triton_to_dlpack`, :func:`triton_from_dlpack`): they raise
  :class:`~pb_tensor.errors.TritonModelException` with upstream's messages (typos fixed).
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from dlpack_ctypes.abi import DLDataTypeCode
from pb_tensor.errors import TritonBufferError, TritonModelException

__all__ = [
    "TRITON_STRING_TO_NUMPY",
    "MemoryType",
    "TritonDtype",
    "numpy_dtype_of",
    "numpy_to_triton_type",
    "triton_dtype_from_numpy",
    "triton_from_dlpack",
    "triton_string_to_numpy",
    "triton_to_dlpack",
    "triton_to_numpy_type",
]


class TritonDtype(enum.IntEnum):
    """``TRITONSERVER_DataType``: the element type of a Triton tensor (values as in C).

    ``TYPE_STRING`` is an alias of ``TYPE_BYTES`` (the model-configuration spelling); mypy does
    not model enum aliases and treats it as a separate literal, so typed code should prefer
    ``TYPE_BYTES``.
    ``str()`` gives the number on every Python version (as ``IntEnum`` does from 3.11 on), so
    formatting a dtype prints what Triton's integer constants print.
    """

    TYPE_INVALID = 0
    TYPE_BOOL = 1
    TYPE_UINT8 = 2
    TYPE_UINT16 = 3
    TYPE_UINT32 = 4
    TYPE_UINT64 = 5
    TYPE_INT8 = 6
    TYPE_INT16 = 7
    TYPE_INT32 = 8
    TYPE_INT64 = 9
    TYPE_FP16 = 10
    TYPE_FP32 = 11
    TYPE_FP64 = 12
    TYPE_BYTES = 13
    TYPE_STRING = 13
    TYPE_BF16 = 14

    def __str__(self) -> str:
        # Python 3.10's IntEnum prints "TritonDtype.TYPE_FP32"; 3.11+ prints "11".
        return str(self.value)

    @property
    def wire_name(self) -> str:
        """The protocol name (``TRITONSERVER_DataTypeString``): ``"FP32"``, ``"BYTES"`` ...

        ``TYPE_INVALID`` gives ``"<invalid>"``, as the C function does.
        """
        return _WIRE_NAMES[self]

    @property
    def itemsize(self) -> int:
        """Bytes per element (``TRITONSERVER_DataTypeByteSize``): 0 for BYTES and INVALID."""
        return _ITEMSIZES[self]


class MemoryType(enum.IntEnum):
    """``TRITONSERVER_MemoryType``: where a tensor's buffer lives."""

    CPU = 0
    CPU_PINNED = 1
    GPU = 2

    def __str__(self) -> str:
        return str(self.value)


_T = TritonDtype

_WIRE_NAMES: Final[Mapping[TritonDtype, str]] = types.MappingProxyType(
    {
        t: ("<invalid>" if t is _T.TYPE_INVALID else t.name.removeprefix("TYPE_"))
        for t in TritonDtype
    }
)

_ITEMSIZES: Final[Mapping[TritonDtype, int]] = types.MappingProxyType(
    {
        _T.TYPE_INVALID: 0,
        _T.TYPE_BOOL: 1,
        _T.TYPE_UINT8: 1,
        _T.TYPE_UINT16: 2,
        _T.TYPE_UINT32: 4,
        _T.TYPE_UINT64: 8,
        _T.TYPE_INT8: 1,
        _T.TYPE_INT16: 2,
        _T.TYPE_INT32: 4,
        _T.TYPE_INT64: 8,
        _T.TYPE_FP16: 2,
        _T.TYPE_FP32: 4,
        _T.TYPE_FP64: 8,
        _T.TYPE_BYTES: 0,
        _T.TYPE_BF16: 2,
    }
)

# The NumPy scalar type of each Triton type, in upstream's comparison order. BF16 has none.
_NUMPY_TYPES: Final[tuple[tuple[TritonDtype, type[np.generic]], ...]] = (
    (_T.TYPE_BOOL, np.bool_),
    (_T.TYPE_UINT8, np.uint8),
    (_T.TYPE_UINT16, np.uint16),
    (_T.TYPE_UINT32, np.uint32),
    (_T.TYPE_UINT64, np.uint64),
    (_T.TYPE_INT8, np.int8),
    (_T.TYPE_INT16, np.int16),
    (_T.TYPE_INT32, np.int32),
    (_T.TYPE_INT64, np.int64),
    (_T.TYPE_FP16, np.float16),
    (_T.TYPE_FP32, np.float32),
    (_T.TYPE_FP64, np.float64),
    (_T.TYPE_BYTES, np.object_),
)

# ------------------------------------------------------------------------------------------------
# triton_python_backend_utils helpers

# Keyed by ``object`` because lookups take whatever the caller passed (upstream compares with ==).
_TO_NUMPY_TYPE: Final[Mapping[object, type[np.generic]]] = types.MappingProxyType(
    {int(t): np_type for t, np_type in _NUMPY_TYPES}
)

#: ``triton_python_backend_utils.TRITON_STRING_TO_NUMPY`` (read-only here): model-config type
#: names to NumPy types. ``TYPE_BOOL`` maps to the builtin ``bool`` and there is no
#: ``TYPE_BF16``, as upstream.
TRITON_STRING_TO_NUMPY: Final[Mapping[str, type[np.generic] | type[bool]]] = types.MappingProxyType(
    {
        "TYPE_BOOL": bool,
        "TYPE_UINT8": np.uint8,
        "TYPE_UINT16": np.uint16,
        "TYPE_UINT32": np.uint32,
        "TYPE_UINT64": np.uint64,
        "TYPE_INT8": np.int8,
        "TYPE_INT16": np.int16,
        "TYPE_INT32": np.int32,
        "TYPE_INT64": np.int64,
        "TYPE_FP16": np.float16,
        "TYPE_FP32": np.float32,
        "TYPE_FP64": np.float64,
        "TYPE_STRING": np.object_,
    }
)


def triton_to_numpy_type(data_type: object) -> type[np.generic] | None:
    """The NumPy scalar type of a Triton type number, as ``pb_utils.triton_to_numpy_type``.

    ``1`` gives ``np.bool_`` ... ``12`` gives ``np.float64`` and ``13`` gives ``np.object_``;
    anything else (``0``, ``14`` = BF16, unknown numbers, non-numbers) gives ``None``.
    Comparison is Python ``==``, so ``True``, ``1.0`` and NumPy integers work as upstream.

    Raises:
        ValueError: only where upstream raises too (a multi-element array's truth value).
    """
    try:
        return _TO_NUMPY_TYPE.get(data_type)
    except TypeError:
        # Unhashable (e.g. a 0-d array): fall back to upstream's chain of == tests.
        for value, np_type in _TO_NUMPY_TYPE.items():
            if data_type == value:
                return np_type
        return None


def numpy_to_triton_type(data_type: object) -> TritonDtype | None:
    """The Triton type of a NumPy type or dtype, as ``pb_utils.numpy_to_triton_type``.

    Upstream's semantics are kept on purpose, quirks included: the argument is compared with
    ``==`` against NumPy scalar types, so ``np.float32`` and ``np.dtype("float32")`` give
    ``TYPE_FP32``; ``np.object_`` and ``np.bytes_`` (or the unsized ``np.dtype("S")``) give
    ``TYPE_BYTES``; a sized ``np.dtype("S5")``, ``"<U2"``, big-endian ``">f4"`` and anything
    unknown give ``None``. The result is a :class:`TritonDtype`, equal to upstream's ``int``.

    Raises:
        ValueError: only where upstream raises too (comparing an array gives an ambiguous truth
            value).
    """
    for triton, np_type in _NUMPY_TYPES:
        if data_type == np_type:
            return triton
    if data_type == np.bytes_:
        return _T.TYPE_BYTES
    return None


def triton_string_to_numpy(triton_type_string: str) -> type[np.generic] | type[bool]:
    """The NumPy type of a model-config type name, as ``pb_utils.triton_string_to_numpy``.

    ``"TYPE_BOOL"`` gives the builtin ``bool``, ``"TYPE_STRING"`` gives ``np.object_``.

    Raises:
        KeyError: for any other name, including ``"TYPE_BF16"`` and ``"TYPE_BYTES"`` (upstream
            has no entry for them).
    """
    return TRITON_STRING_TO_NUMPY[triton_type_string]


# ------------------------------------------------------------------------------------------------
# C++ mappings used by the Tensor

_NUMPY_UNSUPPORTED: Final = "NumPy dtype is not supported."

# dtype -> Triton type for every dtype the C++ constructor accepts, except S<n> (one per length).
# A dict hit is exact: it needs ``dtype == key``, which is the C++ test. A miss (big-endian,
# S<n>, metadata with a different hash ...) takes the slow path, which is the C++ test itself.
_FROM_NUMPY: Final[dict[np.dtype[Any], TritonDtype]] = {
    np.dtype(np_type): triton for triton, np_type in _NUMPY_TYPES
}


def _triton_dtype_from_numpy_slow(dtype: object) -> TritonDtype:
    for triton, np_type in _NUMPY_TYPES:
        if dtype == np_type:
            return triton
    if dtype == np.bytes_ or getattr(dtype, "type", None) is np.bytes_:
        return _T.TYPE_BYTES
    raise TritonModelException(_NUMPY_UNSUPPORTED)


def triton_dtype_from_numpy(dtype: np.dtype[Any]) -> TritonDtype:
    """The Triton type of an array's dtype, with the C++ ``Tensor`` constructor's rules.

    Accepted: ``bool``, ``u/int8..64`` and ``float16/32/64`` in native byte order (and their
    aliases such as ``np.intc`` or ``np.longlong``); ``object``, ``np.bytes_`` and every
    ``S<n>`` give ``TYPE_BYTES``.

    Raises:
        TritonModelException: ``"NumPy dtype is not supported."`` for everything else: ``U``
            (str) arrays, non-native byte order, complex, datetime/timedelta, void/structured,
            ``float128``, ``ml_dtypes.bfloat16``, NumPy's ``StringDType`` ...
    """
    try:
        found = _FROM_NUMPY.get(dtype)
    except TypeError:  # unhashable: not a dtype at all
        found = None
    if found is not None:
        return found
    # S<n> arrays are the usual BYTES input and equal none of the numeric types, so answering
    # them before the C++ chain of == tests changes no result.
    if getattr(dtype, "type", None) is np.bytes_:
        return _T.TYPE_BYTES
    return _triton_dtype_from_numpy_slow(dtype)


_BF16_TO_NUMPY: Final = (
    "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and from_dlpack() "
    "instead."
)

_TO_NUMPY_DTYPE: Final[Mapping[int, np.dtype[Any]]] = types.MappingProxyType(
    {int(t): np.dtype(np_type) for t, np_type in _NUMPY_TYPES}
)


def numpy_dtype_of(dtype: TritonDtype | int) -> np.dtype[Any]:
    """The NumPy dtype that holds elements of a Triton type (BYTES gives ``object``).

    Raises:
        TritonModelException: for BF16, upstream's ``"Tensor dtype is BF16 and cannot be
            converted to NumPy. Use to_dlpack() and from_dlpack() instead."`` (callers that can
            handle BF16 another way test for it first); for INVALID or an unknown number,
            ``"Unsupported triton dtype <n>"``.
    """
    try:
        return _TO_NUMPY_DTYPE[dtype]
    except KeyError:
        if dtype == _T.TYPE_BF16:
            raise TritonModelException(_BF16_TO_NUMPY) from None
        raise TritonModelException(f"Unsupported triton dtype {int(dtype)}") from None


_KDL_INT: Final = int(DLDataTypeCode.kDLInt)
_KDL_UINT: Final = int(DLDataTypeCode.kDLUInt)
_KDL_FLOAT: Final = int(DLDataTypeCode.kDLFloat)
_KDL_BFLOAT: Final = int(DLDataTypeCode.kDLBfloat)
_KDL_BOOL: Final = int(DLDataTypeCode.kDLBool)

_TO_DLPACK: Final[Mapping[int, tuple[int, int, int]]] = types.MappingProxyType(
    {
        int(_T.TYPE_BOOL): (_KDL_BOOL, 8, 1),
        int(_T.TYPE_UINT8): (_KDL_UINT, 8, 1),
        int(_T.TYPE_UINT16): (_KDL_UINT, 16, 1),
        int(_T.TYPE_UINT32): (_KDL_UINT, 32, 1),
        int(_T.TYPE_UINT64): (_KDL_UINT, 64, 1),
        int(_T.TYPE_INT8): (_KDL_INT, 8, 1),
        int(_T.TYPE_INT16): (_KDL_INT, 16, 1),
        int(_T.TYPE_INT32): (_KDL_INT, 32, 1),
        int(_T.TYPE_INT64): (_KDL_INT, 64, 1),
        int(_T.TYPE_FP16): (_KDL_FLOAT, 16, 1),
        int(_T.TYPE_FP32): (_KDL_FLOAT, 32, 1),
        int(_T.TYPE_FP64): (_KDL_FLOAT, 64, 1),
        int(_T.TYPE_BF16): (_KDL_BFLOAT, 16, 1),
    }
)

# (code, bits) -> Triton type for lanes == 1; every other pair is TYPE_INVALID, except kDLBfloat.
_FROM_DLPACK: Final[Mapping[tuple[int, int], TritonDtype]] = types.MappingProxyType(
    {(code, bits): TritonDtype(t) for t, (code, bits, _lanes) in _TO_DLPACK.items()}
)


def triton_to_dlpack(dtype: TritonDtype | int) -> tuple[int, int, int]:
    """The DLPack ``(code, bits, lanes)`` of a Triton type; bool is ``(kDLBool, 8, 1)``.

    Raises:
        TritonBufferError: (a ``TritonModelException`` and a ``BufferError``)
            ``"TYPE_BYTES tensors cannot be converted to DLPack."`` for BYTES;
            ``'DType code "<n>" is not supported.'`` for INVALID and unknown numbers.
    """
    try:
        return _TO_DLPACK[dtype]
    except KeyError:
        if dtype == _T.TYPE_BYTES:
            raise TritonBufferError("TYPE_BYTES tensors cannot be converted to DLPack.") from None
        raise TritonBufferError(f'DType code "{int(dtype)}" is not supported.') from None


def triton_from_dlpack(code: int, bits: int, lanes: int) -> TritonDtype:
    """The Triton type of a DLPack ``(code, bits, lanes)``, as the C++ importer maps it.

    Returns ``TYPE_INVALID`` (the caller turns it into its own error) for ``lanes != 1``,
    complex, opaque handles, the float8/6/4 codes, bool with ``bits != 8``, unusual widths
    and unknown codes.

    Raises:
        TritonModelException: ``"Expected BF16 tensor to have 16 bits, but had: <bits>"`` for
            ``kDLBfloat`` with ``bits != 16`` (and ``lanes == 1``), as upstream.
    """
    if lanes != 1:
        return _T.TYPE_INVALID
    found = _FROM_DLPACK.get((code, bits))
    if found is not None:
        return found
    if code == _KDL_BFLOAT:
        raise TritonModelException(f"Expected BF16 tensor to have 16 bits, but had: {bits}")
    return _T.TYPE_INVALID
