"""``DLDataType`` <-> numpy dtype.

Standard numpy dtypes map directly. bfloat16 and the float8 family have no numpy dtype: they are
carried as a raw :class:`DataType` and, when the optional ``ml_dtypes`` package is installed,
mapped to its dtypes (``ml_dtypes.bfloat16``, ``ml_dtypes.float8_e4m3fn`` ...).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from dlpack_ctypes.abi import DLDataTypeCode

__all__ = ["DataType", "from_numpy_dtype", "to_numpy_dtype"]



class DataType(NamedTuple):
    """A ``DLDataType`` as a hashable tuple ``(code, bits, lanes)``."""

    code: int
    bits: int
    lanes: int = 1

    @property
    def itemsize(self) -> int:
        """Bytes per element, ``(bits * lanes + 7) // 8`` as in ``dlpack.h``."""
        return (self.bits * self.lanes + 7) // 8

    def __repr__(self) -> str:
        try:
            code: object = DLDataTypeCode(self.code).name
        except ValueError:
            code = self.code
        return f"DataType(code={code}, bits={self.bits}, lanes={self.lanes})"


# Valid bit widths per type code; anything else is rejected by consumers (dlpack.md 3.2).
VALID_BITS: dict[int, frozenset[int]] = {
    DLDataTypeCode.kDLInt: frozenset({8, 16, 32, 64}),
    DLDataTypeCode.kDLUInt: frozenset({8, 16, 32, 64}),
    DLDataTypeCode.kDLFloat: frozenset({16, 32, 64}),
    DLDataTypeCode.kDLOpaqueHandle: frozenset({8, 16, 32, 64}),
    DLDataTypeCode.kDLBfloat: frozenset({16}),
    DLDataTypeCode.kDLComplex: frozenset({32, 64, 128}),
    DLDataTypeCode.kDLBool: frozenset({8}),
    **{code: frozenset({8}) for code in range(7, 15)},
    DLDataTypeCode.kDLFloat6_e2m3fn: frozenset({6}),
    DLDataTypeCode.kDLFloat6_e3m2fn: frozenset({6}),
    DLDataTypeCode.kDLFloat4_e2m1fn: frozenset({4}),
    DLDataTypeCode.kDLBcomplex: frozenset({32}),
}

_KIND_CODE = {
    "b": DLDataTypeCode.kDLBool,
    "i": DLDataTypeCode.kDLInt,
    "u": DLDataTypeCode.kDLUInt,
    "f": DLDataTypeCode.kDLFloat,
    "c": DLDataTypeCode.kDLComplex,
}

# dtype.num -> DataType for every standard native numpy type we can export. Keyed by ``num``
# because it is an int attribute (cheap) and distinct per C type ('l' and 'q' both map).
_BY_NUM: dict[int, DataType] = {}
for _char in "?bBhHiIlLqQefdFD":
    _dt = np.dtype(_char)
    _BY_NUM[_dt.num] = DataType(_KIND_CODE[_dt.kind], _dt.itemsize * 8, 1)

# (code, bits) -> ml_dtypes attribute name.
_ML_NAMES: dict[tuple[int, int], str] = {
    (DLDataTypeCode.kDLBfloat, 16): "bfloat16",
    (DLDataTypeCode.kDLFloat8_e3m4, 8): "float8_e3m4",
    (DLDataTypeCode.kDLFloat8_e4m3, 8): "float8_e4m3",
    (DLDataTypeCode.kDLFloat8_e4m3b11fnuz, 8): "float8_e4m3b11fnuz",
    (DLDataTypeCode.kDLFloat8_e4m3fn, 8): "float8_e4m3fn",
    (DLDataTypeCode.kDLFloat8_e4m3fnuz, 8): "float8_e4m3fnuz",
    (DLDataTypeCode.kDLFloat8_e5m2, 8): "float8_e5m2",
    (DLDataTypeCode.kDLFloat8_e5m2fnuz, 8): "float8_e5m2fnuz",
    (DLDataTypeCode.kDLFloat8_e8m0fnu, 8): "float8_e8m0fnu",
}


@functools.lru_cache(maxsize=1)
def _ml_dtypes() -> Any:
    """The ``ml_dtypes`` module, or None; imported on first need only (it is optional)."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes


@functools.cache
def _ml_by_name() -> dict[str, DataType]:
    return {name: DataType(code, bits, 1) for (code, bits), name in _ML_NAMES.items()}


def from_numpy_dtype(dtype: np.dtype[Any]) -> DataType:
    """The DLPack data type of a numpy dtype.

    Raises:
        BufferError: the dtype has no DLPack equivalent (object, string, datetime, void,
            longdouble ...) or is not in native byte order.
    """
    found = _BY_NUM.get(dtype.num)
    if found is not None:
        if dtype.isnative:
            return found
        raise BufferError(f"DLPack only supports native byte order: {dtype=!s}")
    mod = _ml_dtypes()
    if mod is not None:
        name = getattr(dtype.type, "__name__", "")
        found = _ml_by_name().get(name)
        if found is not None and getattr(mod, name, None) is dtype.type:
            return found
    raise BufferError(
        f"DLPack cannot represent numpy {dtype=!s}: only bool, signed/unsigned integers, "
        "float16/32/64, complex64/128 and ml_dtypes' bfloat16/float8 types are supported"
    )


# DataType -> numpy dtype cache; misses go through _resolve.
_TO_NUMPY: dict[DataType, np.dtype[Any]] = {}
for _num_dtype in (np.dtype(c) for c in "?bBhHiIlLqQefdFD"):
    _TO_NUMPY.setdefault(_BY_NUM[_num_dtype.num], _num_dtype)


def to_numpy_dtype(dtype: DataType) -> np.dtype[Any] | None:
    """The numpy dtype for a DLPack data type, or None when numpy has none.

    bfloat16 and float8 map to ``ml_dtypes`` dtypes when that package is installed, and to None
    otherwise. ``lanes != 1`` and sub-byte types always give None.
    """
    found = _TO_NUMPY.get(dtype)
    if found is not None:
        return found
    if dtype.lanes != 1:
        return None
    name = _ML_NAMES.get((dtype.code, dtype.bits))
    if name is None:
        return None
    mod = _ml_dtypes()
    if mod is None or not hasattr(mod, name):
        return None
    resolved: np.dtype[Any] = np.dtype(getattr(mod, name))
    _TO_NUMPY[dtype] = resolved
    return resolved
