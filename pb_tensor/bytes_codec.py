"""BYTES (string) tensors in Triton's wire format, vectorised wherever the format allows it.

Wire format: the elements in C order, each as a ``uint32`` little-endian length followed by that
many raw bytes; no padding, no terminator, no element count.

Public, ``triton_python_backend_utils``-compatible: :func:`serialize_byte_tensor`,
:func:`deserialize_bytes_tensor`. Fast internals for the ``Tensor``: :func:`serialize` (returns a
``uint8`` array) and :func:`deserialize` (reads any buffer, e.g. a view of shared memory, and
checks the element count).

Deliberate differences from upstream (the README's "Differences from Triton" table):

* ``np.bytes_`` elements of an object array serialise as their bytes; upstream's exact-type test
  turns them into their ``repr`` (``b"b'ab'"``).
* Deserialisation checks every length field and raises
  :class:`~pb_tensor.errors.TritonModelException` with the messages of upstream's C++
  deserialiser instead of ``struct.error`` (upstream's Python helper).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from pb_tensor.errors import TritonModelException

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["deserialize", "deserialize_bytes_tensor", "serialize", "serialize_byte_tensor"]

_U32: Final = struct.Struct("<I")
_MAX_ELEMENT: Final = 0xFFFFFFFF
_INCOMPLETE: Final = "Invalid bytes tensor data: incomplete length field"
_BEYOND: Final = "Invalid bytes tensor data: string extends beyond buffer"

# Above this mean element size (bytes), object arrays are joined with their length fields in one
# pass: the numpy scatter of length fields only pays off when there are many small elements.
_LARGE_OBJECT_ELEMENT: Final = 512
# Up to this many elements, plain Python beats the fixed cost of any numpy call.
_FEW_ELEMENTS: Final = 64
# Elements shorter than this are cut by a compiled ``struct`` format of their own length (made on
# first use and kept, so at most this many small formats ever exist); longer ones are sliced.
_PAIR_CAP: Final = 4096
# length -> Struct("<{length}sI").unpack_from: one call returns an element and the length field
# that follows it. Concurrent first uses may both store a format; the values are equivalent.
_PAIRS: Final[dict[int, Callable[[Buffer, int], tuple[bytes, int]]]] = {}


# ------------------------------------------------------------------------------------------------
# serialisation


def _coerce(item: object) -> bytes:
    """Upstream's rule for an object element that is not exactly ``bytes`` (np.bytes_ fixed)."""
    if isinstance(item, np.bytes_):
        return bytes(item)
    return str(item).encode("utf-8")


def _object_parts(items: list[Any]) -> list[bytes]:
    kinds = set(map(type, items))
    if kinds == {bytes}:
        return items
    if kinds == {str}:
        # str(x) is x for an exact str, so encoding directly gives upstream's bytes.
        return list(map(str.encode, items))
    return [x if type(x) is bytes else _coerce(x) for x in items]


def _too_long(longest: int) -> TritonModelException:
    return TritonModelException(
        f"BYTES element of {longest} bytes does not fit the 32-bit length field"
    )


def _join_with_lengths(parts: list[bytes], lens: list[int]) -> bytes:
    pieces: list[bytes] = [b""] * (2 * len(parts))
    pieces[0::2] = map(_U32.pack, lens)
    pieces[1::2] = parts
    return b"".join(pieces)


def _serialize_objects(items: list[Any]) -> bytes | bytearray:
    parts = _object_parts(items)
    n = len(parts)
    if n <= _FEW_ELEMENTS:
        few = list(map(len, parts))
        if max(few) > _MAX_ELEMENT:
            raise _too_long(max(few))
        return _join_with_lengths(parts, few)
    lens = np.fromiter(map(len, parts), dtype=np.int64, count=n)
    longest = int(lens.max())
    if longest > _MAX_ELEMENT:
        raise _too_long(longest)
    if int(lens.sum()) >= n * _LARGE_OBJECT_ELEMENT:
        return _join_with_lengths(parts, lens.tolist())
    # Joining with a 4-byte NUL separator lays out every element at its final place, with
    # zeroed length fields in between; only their non-zero bytes are then written, vectorised.
    # ``parts`` is always a list of our own (tolist() or a conversion), so mutating it is safe.
    parts.insert(0, b"")  # the leading separator is element 0's length field
    out = bytearray(b"\0\0\0\0").join(parts)
    view = np.frombuffer(out, dtype=np.uint8)
    starts = np.cumsum(lens)
    starts -= lens
    starts += np.arange(0, 4 * n, 4, dtype=np.int64)
    shift = 0
    while longest >> shift:
        view[starts] = (lens >> shift).astype(np.uint8)
        starts += 1
        shift += 8
    return out


def _str_lengths(flat: npt.NDArray[np.bytes_]) -> npt.NDArray[np.int64]:
    """What ``len(x.item())`` gives for each ``S`` element: trailing NULs dropped, inner kept."""
    return np.char.str_len(flat).astype(np.int64, copy=False)


def _serialize_fixed(flat: npt.NDArray[np.bytes_]) -> npt.NDArray[np.uint8]:
    n = flat.size
    width = flat.dtype.itemsize  # at least 1: NumPy turns S0 into S1
    lens = _str_lengths(flat)
    # One record per element, length field then the padded bytes: exactly the wire layout when
    # no element has trailing NULs; otherwise a boolean mask drops the padding.
    records = np.empty(n, dtype=np.dtype([("len", "<u4"), ("data", f"V{width}")]))
    records["len"] = lens
    records["data"] = flat.view(f"V{width}")
    out = records.view(np.uint8)
    if int(lens.min()) == width:
        return out
    row = 4 + width
    # The narrowest index type keeps the (n, row) comparison cheap; row fits it by construction.
    index_type = np.uint8 if row < 1 << 8 else np.uint16 if row < 1 << 16 else np.int64
    keep = np.arange(row, dtype=index_type) < (lens + 4).astype(index_type)[:, None]
    return np.compress(keep.reshape(-1), out)  # measured faster than boolean indexing


def _serialize(array: npt.NDArray[Any]) -> bytes | bytearray | npt.NDArray[np.uint8]:
    kind = array.dtype.type
    if kind is np.object_:
        if array.size == 0:
            return np.empty(0, dtype=np.uint8)
        return _serialize_objects(array.ravel().tolist())
    if kind is np.bytes_:
        if array.size == 0:
            return np.empty(0, dtype=np.uint8)
        return _serialize_fixed(np.ascontiguousarray(array).reshape(-1))
    raise TritonModelException(
        f"BYTES tensors are built from object or bytes (S) arrays, not dtype {array.dtype}"
    )


def serialize(array: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
    """The wire bytes of a BYTES tensor as a 1-D ``uint8`` array (empty for an empty array).

    ``array`` is an object array (``bytes`` kept verbatim, ``np.bytes_`` as its bytes, anything
    else as ``str(x).encode("utf-8")``) or an ``S<n>`` array (trailing NULs dropped as NumPy does,
    inner NULs kept), of any shape and memory order; elements are taken in C order and a 0-d
    array is one element. The result may be read-only (it can share memory with a ``bytes``).

    Raises:
        TritonModelException: for any other dtype, or an element longer than 4 GiB - 1.
        UnicodeEncodeError: for a ``str`` element that is not encodable (lone surrogates), as
            upstream.
    """
    out = _serialize(np.asarray(array))
    if isinstance(out, np.ndarray):
        return out
    return np.frombuffer(out, dtype=np.uint8)


def serialize_byte_tensor(input_tensor: npt.NDArray[Any]) -> bytes | tuple[()] | None:
    """``pb_utils.serialize_byte_tensor``: the wire bytes of an object or ``S`` array.

    Same results as upstream's Python helper: ``bytes`` for a non-empty object or ``S`` array,
    ``()`` for an empty array of any dtype, ``None`` for other dtypes; except that ``np.bytes_``
    elements of object arrays serialise as their bytes (see :func:`serialize` for the rules).

    Raises:
        TritonModelException: for an element longer than 4 GiB - 1 (upstream: ``struct.error``).
        UnicodeEncodeError: for a ``str`` element that is not encodable, as upstream.
    """
    if input_tensor.size == 0:
        return ()
    kind = input_tensor.dtype.type
    if kind is not np.object_ and kind is not np.bytes_:
        return None
    out = _serialize(np.asarray(input_tensor))
    if type(out) is bytes:
        return out
    if isinstance(out, np.ndarray):
        return out.tobytes()
    return bytes(out)


# ------------------------------------------------------------------------------------------------
# deserialisation


def _split(data: Buffer, end: int) -> list[bytes]:
    """Walk the length fields of ``data`` (``end`` bytes, more than 0) into a list of elements.

    The chain of length fields is sequential, so this is a Python loop, made as short as
    measured possible: one ``struct`` call per element both copies the element out and reads the
    next length field (faster than unpack + slice, and than numpy pointer-jumping here).
    """
    out: list[bytes] = []
    append = out.append
    pairs = _PAIRS
    unpack = _U32.unpack_from
    try:
        length: int = unpack(data, 0)[0]
    except struct.error:
        raise TritonModelException(_INCOMPLETE) from None
    off = 4  # where the current element's bytes start; ``length`` is its length
    while True:
        try:
            while True:
                item, following = pairs[length](data, off)
                append(item)
                off += length + 4
                length = following
        except KeyError:
            if length < _PAIR_CAP:
                pairs[length] = struct.Struct(f"<{length}sI").unpack_from
                continue
            # Long elements: slice them until a short one hands back to the loop above, so a
            # run of long elements costs one exception, not one each.
            while length >= _PAIR_CAP:
                stop = off + length
                if stop + 4 > end:
                    break
                append(bytes(memoryview(data)[off:stop]))
                length = unpack(data, stop)[0]
                off = stop + 4
            else:
                continue
        except struct.error:
            # Fewer than length + 4 bytes left: this is the last element, or the data are bad.
            stop = off + length
        break
    if stop > end:
        raise TritonModelException(_BEYOND)
    append(bytes(memoryview(data)[off:stop]))
    if stop < end:
        raise TritonModelException(_INCOMPLETE)
    return out


def _split_uniform(view: memoryview, length: int, n: int) -> npt.NDArray[np.object_] | None:
    """All elements ``length`` bytes long (one numpy test), or None if they are not."""
    stride = 4 + length
    raw = np.frombuffer(view, dtype=np.uint8)
    if n > 1:
        fields = np.ndarray((n,), dtype="<u4", buffer=raw, offset=0, strides=(stride,))
        if not bool((fields == length).all()):
            return None
    if length == 0:
        empty = np.empty(n, dtype=object)
        empty.fill(b"")
        return empty
    # 'V' rows keep trailing NULs (unlike 'S') and convert to exact ``bytes`` objects.
    rows = np.ndarray((n,), dtype=f"V{length}", buffer=raw, offset=4, strides=(stride,))
    objects: npt.NDArray[np.object_] = rows.astype(object)
    return objects


def _byte_view(buf: Buffer | npt.NDArray[Any]) -> memoryview:
    # ndarray.data, not memoryview(ndarray): NumPy's stubs declare __buffer__ on Python 3.12+
    # only, and ascontiguousarray makes a strided view readable in C order in the same step.
    view = np.ascontiguousarray(buf).data if isinstance(buf, np.ndarray) else memoryview(buf)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def deserialize(
    buf: Buffer | npt.NDArray[Any], count: int | None = None
) -> npt.NDArray[np.object_]:
    """The elements of a BYTES tensor's wire bytes, as a 1-D object array of ``bytes``.

    ``buf`` is any buffer (``bytes``, ``bytearray``, ``memoryview``, a ``uint8`` array that views
    shared memory ...); it is read, never kept. ``count``, when given, is the element count the
    caller expects (the product of the tensor's dims).

    Raises:
        TritonModelException: ``"Invalid bytes tensor data: incomplete length field"`` or
            ``"Invalid bytes tensor data: string extends beyond buffer"`` for malformed data;
            ``"Invalid bytes tensor data: expected <count> elements, found <n>"`` when ``count``
            is given and differs.
        TypeError: if ``buf`` does not support the buffer protocol.
    """
    view = _byte_view(buf)
    end = view.nbytes
    result: npt.NDArray[np.object_] | None = None
    if end >= 4:
        first = _U32.unpack_from(view, 0)[0]
        stride = 4 + first
        if end % stride == 0 and first < 1 << 31:
            result = _split_uniform(view, first, end // stride)
    if result is None:
        # struct reads a bytes object a little faster than a memoryview; an ndarray would cost a
        # buffer export per call, so that one is read through its memoryview.
        items = _split(buf if type(buf) is bytes else view, end) if end else []
        result = np.fromiter(items, dtype=object, count=len(items))
    if count is not None and count != result.size:
        raise TritonModelException(
            f"Invalid bytes tensor data: expected {count} elements, found {result.size}"
        )
    return result


def deserialize_bytes_tensor(encoded_tensor: Buffer | npt.NDArray[Any]) -> npt.NDArray[np.object_]:
    """``pb_utils.deserialize_bytes_tensor``: wire bytes to a 1-D object array of ``bytes``.

    ``b""`` gives an empty array; multi-dimensional tensors come back flat (reshape them).

    Raises:
        TritonModelException: ``"Invalid bytes tensor data: incomplete length field"`` or
            ``"Invalid bytes tensor data: string extends beyond buffer"`` for truncated or
            corrupt data (upstream's Python helper raises ``struct.error`` or returns short
            elements instead).
        TypeError: if ``encoded_tensor`` does not support the buffer protocol.
    """
    return deserialize(encoded_tensor)
