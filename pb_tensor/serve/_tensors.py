"""Tensors on the wire: Triton's datatype names, raw (binary) and JSON data, checked against
the request before anything is allocated."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from pb_tensor import TritonModelException, deserialize_bytes_tensor
from pb_tensor.serve._errors import INVALID_ARG, ServeError

__all__ = [
    "bytes_text",
    "json_bytes",
    "DTYPES",
    "bytes_wire",
    "check_shape",
    "datatype_of",
    "from_json",
    "from_raw",
    "raw_bytes",
    "to_json",
]

DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
_NAMES: Final = {dt: name for name, dt in DTYPES.items() if name != "BYTES"}
_INT64_MAX: Final = 2**63 - 1
_LEN: Final = struct.Struct("<I")


def datatype_of(array: npt.NDArray[Any]) -> str:
    """Triton's datatype name of an output array (object and bytes arrays are BYTES).

    Raises:
        ServeError: a dtype Triton has no name for.
    """
    name = _NAMES.get(array.dtype)
    if name is not None:
        return name
    if array.dtype == object or array.dtype.kind in "SU":
        return "BYTES"
    raise ServeError(f"output has data type {array.dtype} that Triton cannot send", INVALID_ARG)


def check_shape(name: str, shape: Any) -> list[int]:
    """The shape of input ``name`` as a list of non-negative ints, its element count within
    int64 (Triton's checks and messages).

    Raises:
        ServeError: not a list of unsigned integers, or too many elements.
    """
    if not isinstance(shape, list) or not all(
        type(d) is int and 0 <= d <= 2**64 - 1 for d in shape
    ):
        kind = "array" if not isinstance(shape, list) else "unsigned-integer"
        raise ServeError(
            f"Unable to parse 'shape': attempt to access JSON non-{kind} as {kind}"
        )
    if any(d > _INT64_MAX for d in shape):
        raise ServeError(
            f"invalid shape for input '{name}': shape {_shape_text(shape)} contains one or "
            "more invalid dimensions"
        )
    if math.prod(shape) > _INT64_MAX:
        raise ServeError(
            f"invalid shape for input '{name}': shape {_shape_text(shape)} causes total "
            f"element count to exceed maximum size of {_INT64_MAX}"
        )
    return shape


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _prefix(request_id: str) -> str:
    return f"[request id: {request_id or '<id_unknown>'}] "


def from_raw(
    name: str, datatype: str, shape: list[int], data: bytes | bytearray | memoryview, model: str,
    request_id: str,
) -> npt.NDArray[Any]:
    """The array of input ``name`` from its raw bytes (little-endian; BYTES elements each
    prefixed by a 4-byte length), without copying fixed-size data.

    Raises:
        ServeError: an unknown datatype, or a byte size (element count for BYTES) that does
            not match the shape (Triton core's messages).
    """
    dtype = DTYPES.get(datatype)
    if dtype is None:
        raise ServeError(f"invalid datatype for input {name}")
    count = math.prod(shape)
    if datatype != "BYTES":
        expected = count * dtype.itemsize
        if len(data) != expected:
            raise ServeError(
                f"{_prefix(request_id)}input byte size mismatch for input '{name}' for model "
                f"'{model}'. Expected {expected}, got {len(data)}"
            )
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    try:
        array = deserialize_bytes_tensor(bytes(data)) if len(data) else np.empty(0, object)
    except TritonModelException:
        array = None
    if array is None or len(array) != count:
        raise ServeError(_bytes_problem(name, data, count, model, request_id))
    return array.reshape(shape)


def _bytes_problem(name: str, data: bytes | bytearray | memoryview, count: int, model: str,
                   request_id: str) -> str:
    """Triton core's message for BYTES data that does not hold ``count`` elements."""
    where = f"for inference input '{name}' for model '{model}'"
    offset, seen, size = 0, 0, len(data)
    while offset < size:
        if size - offset < _LEN.size:
            return (f"{_prefix(request_id)}incomplete string length indicator {where}, "
                    f"expecting 4 bytes but only {size - offset} bytes available. Please make "
                    "sure the string length indicator is in one buffer.")
        (length,) = _LEN.unpack_from(data, offset)
        offset += _LEN.size
        seen += 1
        if seen > count:
            return (f"{_prefix(request_id)}unexpected number of string elements {seen} "
                    f"{where}, expecting {count}")
        if length > size - offset:
            return (f"{_prefix(request_id)}incomplete string data {where}, expecting "
                    f"{length} bytes but only {size - offset} bytes available")
        offset += length
    return f"{_prefix(request_id)}expected {count} string elements {where}, got {seen}"


_JSON_KINDS: Final[dict[str, tuple[Any, str]]] = {
    "b": (bool, "boolean"),
    "u": (int, "unsigned-integer"),
    "i": (int, "signed-integer"),
    "f": ((int, float), "double"),
}


def from_json(name: str, datatype: str, shape: list[int], data: Any) -> npt.NDArray[Any]:
    """The array of input ``name`` from JSON ``data`` (nested or flat lists).

    Raises:
        ServeError: FP16 / BF16 / unknown datatypes, elements of the wrong JSON kind, or an
            element count that does not match the shape (Triton's HTTP messages).
    """
    if datatype in ("FP16", "BF16"):
        raise ServeError(
            f"receiving {datatype} data via JSON is not supported. Please use the binary "
            f"data format for input {name}"
        )
    dtype = DTYPES.get(datatype)
    if dtype is None:
        raise ServeError(f"invalid datatype for input {name}")
    count = math.prod(shape)
    flat = _flatten(data)
    if len(flat) > count:
        raise ServeError(
            "Unable to parse 'data': Shape does not match true shape of 'data' field"
        )
    if datatype == "BYTES":
        bad = next((v for v in flat if not isinstance(v, str)), None)
        if bad is not None:
            raise ServeError(
                "Unable to parse 'data': attempt to access JSON non-string as string"
            )
        values: list[Any] = [_utf8(v) for v in flat]
    else:
        kinds, text = _JSON_KINDS[dtype.kind]
        for v in flat:
            if not isinstance(v, kinds) or (dtype.kind != "b" and isinstance(v, bool)) or (
                dtype.kind == "u" and v < 0
            ):
                raise ServeError(
                    f"Unable to parse 'data': attempt to access JSON non-{text} as {text}"
                )
        values = flat
    if len(flat) < count:
        raise ServeError("Failed to parse 'data' field: shape does not match true shape")
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = values
        return array.reshape(shape)
    try:
        return np.array(values, dtype=dtype).reshape(shape)
    except OverflowError:
        raise ServeError(
            f"Unable to parse 'data': a value of input '{name}' does not fit {datatype}"
        ) from None


def _utf8(text: str) -> bytes:
    """The bytes of a JSON string: UTF-8, with bytes that were not UTF-8 restored."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate written as a JSON escape
        return text.encode("utf-8", "surrogatepass")


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        raise ServeError("Unable to parse 'data': attempt to access JSON non-array as array")
    if not any(isinstance(v, list) for v in data):
        return data
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                if len(stack) >= 100:
                    raise ServeError(
                        "JSON nesting depth exceeds maximum allowed limit (100)"
                    )
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


def bytes_wire(array: npt.NDArray[Any]) -> bytes:
    """BYTES elements as Triton sends them: each prefixed by its 4-byte little-endian
    length (``str`` elements as UTF-8)."""
    parts: list[bytes] = []
    for v in array.reshape(-1).tolist():
        b = v if isinstance(v, bytes) else str(v).encode("utf-8")
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def raw_bytes(array: npt.NDArray[Any]) -> bytes | memoryview:
    """The raw (binary-data) form of an output array (no copy when it is C-contiguous)."""
    if array.dtype == object or array.dtype.kind in "SU":
        return bytes_wire(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    contiguous = np.ascontiguousarray(array)
    return contiguous.data.cast("B") if contiguous.size else b""


_WRITER = json.JSONEncoder(separators=(",", ":"), allow_nan=True, ensure_ascii=False)


def bytes_text(value: bytes) -> str:
    """A BYTES element as a JSON string value: its bytes as they are once :func:`json_bytes`
    writes it (invalid UTF-8 included, as ``surrogateescape`` keeps it)."""
    return value.decode("utf-8", "surrogateescape")


def json_bytes(document: Any) -> bytes:
    """``document`` as Triton's JSON writer (rapidjson, unvalidated UTF-8) writes it: text as
    UTF-8, not ``\\u`` escapes, and a BYTES element's bytes unchanged (:func:`bytes_text`),
    so a client reading a non-UTF-8 element as JSON fails as a Triton client does."""
    text = _WRITER.encode(document)
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate of another origin: escaped, as JSON can
        return json.dumps(document, separators=(",", ":"), allow_nan=True).encode()


def to_json(array: npt.NDArray[Any], name: str) -> list[Any]:
    """The JSON ``data`` of an output array, flat (row-major).

    Raises:
        ServeError: FP16 data (Triton sends it only as binary data).
    """
    if array.dtype == np.float16:
        raise ServeError(
            "sending FP16 data via JSON is not supported. Please use the binary data format "
            "for output"
        )
    if array.dtype == object or array.dtype.kind in "SU":
        return [
            bytes_text(v) if isinstance(v, bytes) else str(v)
            for v in array.reshape(-1).tolist()
        ]
    flat: list[Any] = array.reshape(-1).tolist()
    return flat
