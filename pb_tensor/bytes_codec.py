"""BYTES (string) tensors in Triton's wire format, vectorised wherever the format allows it.

Wire format: the elements in C order, each as a ``uint32`` little-endian length followed by that
many raw bytes; no padding, no terminator, no element count.

Public, ``triton_python_backend_utils``-compatible: :func:`serialize_byte_tensor`,
:func:`deserialize_bytes_tensor`. Fast internals for the ``Tensor``: :func:`serialize` (returns a
``uint8`` array), :func:`serialize_with_lengths` (also the element lengths) and
:func:`deserialize` (reads any buffer, e.g. a view of shared memory, and checks the element
count). :func:`length_index` packs element lengths to store beside the wire bytes; given back to
:func:`deserialize`, they are checked and spare the walk along the chained length fields
(the layout and checks are in :mod:`pb_tensor._bytes_lengths`).

Few elements take plain loops (no numpy call, no exception ending a loop): at every size the
codec is at least as fast as a per-element Python loop.

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

from pb_tensor import _bytes_lengths
from pb_tensor.errors import TritonModelException

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "INDEX_MIN_ELEMENTS",
    "deserialize",
    "deserialize_bytes_tensor",
    "length_index",
    "serialize",
    "serialize_byte_tensor",
    "serialize_with_lengths",
]

INDEX_MIN_ELEMENTS: Final = _bytes_lengths.MIN_ELEMENTS
"""A :func:`length_index` pays off above this many elements (below it, walking is cheaper)."""

_U32: Final = struct.Struct("<I")
_MAX_ELEMENT: Final = 0xFFFFFFFF
_INCOMPLETE: Final = "Invalid bytes tensor data: incomplete length field"
_BEYOND: Final = "Invalid bytes tensor data: string extends beyond buffer"

# Above this mean element size (bytes), object arrays are joined with their length fields in one
# pass: the numpy scatter of length fields only pays off when there are many small elements.
_LARGE_OBJECT_ELEMENT: Final = 512
# Up to this many elements, a plain loop serialises faster than the vectorised paths (measured:
# object arrays cost about as much per element either way, so the loop wins up to ~1000; S arrays
# are vectorised without any per-element Python, which wins from ~150 on).
_FEW_OBJECTS: Final = 1024
_FEW_FIXED: Final = 128
# Up to this many wire bytes, deserialisation is a plain loop: the fixed cost of a numpy probe or
# of an exception ending the loop is more than the whole loop there.
_SMALL_WIRE: Final = 384
# Up to this many, data whose elements are not all of one length (no numpy path) are still walked
# by the plain loop: the exception that ends the other walk costs more than its per-element gain.
_FEW_WIRE: Final = 4096
# Elements shorter than this are cut by a compiled ``struct`` format of their own length (made on
# first use and kept, so at most this many small formats ever exist); longer ones are sliced.
_PAIR_CAP: Final = 4096


class _NoFormat(Exception):
    """Raised by :data:`_PAIRS` entries not compiled yet."""


def _no_format(data: Buffer, off: int) -> tuple[bytes, int]:
    raise _NoFormat


# [length] -> Struct("<{length}sI").unpack_from: one call returns an element and the length field
# that follows it (a list: indexing it is measurably faster than a dict in the walk). Concurrent
# first uses may both store a format; the values are equivalent.
_PAIRS: Final[list[Callable[[Buffer, int], tuple[bytes, int]]]] = [_no_format] * _PAIR_CAP

_Lengths = npt.NDArray[np.int64]
# The length fields of short elements, made once: indexing beats a ``pack`` call per element.
_HEAD_CAP: Final = 1024
_HEADS: Final = [_U32.pack(length) for length in range(_HEAD_CAP)]
# Positional dtype objects and module-level names: on the few-element paths, keyword arguments and
# attribute lookups are a measurable share of the whole call.
_U8: Final = np.dtype(np.uint8)
_OBJECT: Final = np.dtype(object)
_OBJECT_TYPE: Final = np.object_
_BYTES_TYPE: Final = np.bytes_
_ndarray: Final = np.ndarray
_frombuffer: Final = np.frombuffer
_fromiter: Final = np.fromiter


# ------------------------------------------------------------------------------------------------
# serialisation


def _encode(item: object) -> bytes:
    """Upstream's ``str(item).encode("utf-8")`` for an element that is not exactly ``bytes``."""
    return item.encode() if type(item) is str else _coerce(item)


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


def _join_one(item: object) -> bytes:
    """The wire bytes of a one-element tensor."""
    part = item if type(item) is bytes else _encode(item)
    try:
        return _U32.pack(len(part)) + part
    except struct.error:
        raise _too_long(len(part)) from None


def _join_few(items: list[Any]) -> bytes:
    """Plain-loop serialisation of a few elements (object items, or ``S`` items as bytes)."""
    # The loops here call ``list.append`` as a method: CPython 3.11+ specialises that call,
    # not a call of a bound ``append`` kept in a local (measured ~15% slower per element).
    pieces: list[bytes] = []
    heads = _HEADS
    part = b""
    try:
        for item in items:
            part = item if type(item) is bytes else _encode(item)
            pieces.append(heads[len(part)])
            pieces.append(part)
    except IndexError:
        if len(part) < _HEAD_CAP:
            raise  # from an element's __str__ (``part`` is still the previous element)
        return _join_packed(pieces, part, items)
    return b"".join(pieces)


def _join_packed(pieces: list[bytes], part: bytes, items: list[Any]) -> bytes:
    """:func:`_join_few` after its table of length fields ran out: an element of
    :data:`_HEAD_CAP` bytes or more, ``part``, whose bytes dwarf the cost of getting here.

    ``pieces`` holds the elements before it; the rest go with a ``pack`` call per length field.
    """
    pack = _U32.pack
    rest = items[len(pieces) // 2 + 1 :]
    try:
        pieces.append(pack(len(part)))
        pieces.append(part)
        for item in rest:
            part = item if type(item) is bytes else _encode(item)
            pieces.append(pack(len(part)))
            pieces.append(part)
    except struct.error:
        if len(part) <= _MAX_ELEMENT:
            raise  # from an element's __str__ (``part`` is still the previous element)
        raise _too_long(len(part)) from None
    return b"".join(pieces)


def _join_with_lengths(parts: list[bytes], lens: list[int]) -> bytes:
    pieces: list[bytes] = [b""] * (2 * len(parts))
    pieces[0::2] = map(_U32.pack, lens)
    pieces[1::2] = parts
    return b"".join(pieces)


def _serialize_objects(items: list[Any]) -> tuple[bytes | bytearray, _Lengths]:
    """More than :data:`_FEW_OBJECTS` object items: the wire bytes and the element lengths."""
    parts = _object_parts(items)
    n = len(parts)
    lens = np.fromiter(map(len, parts), dtype=np.int64, count=n)
    longest = int(lens.max())
    if longest > _MAX_ELEMENT:
        raise _too_long(longest)
    if int(lens.sum()) >= n * _LARGE_OBJECT_ELEMENT:
        return _join_with_lengths(parts, lens.tolist()), lens
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
    return out, lens


def _str_lengths(flat: npt.NDArray[np.bytes_]) -> npt.NDArray[np.int64]:
    """What ``len(x.item())`` gives for each ``S`` element: trailing NULs dropped, inner kept."""
    return np.char.str_len(flat).astype(np.int64, copy=False)


def _serialize_fixed(flat: npt.NDArray[np.bytes_]) -> tuple[npt.NDArray[np.uint8], _Lengths]:
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
        return out, lens
    row = 4 + width
    # The narrowest index type keeps the (n, row) comparison cheap; row fits it by construction.
    index_type = np.uint8 if row < 1 << 8 else np.uint16 if row < 1 << 16 else np.int64
    keep = np.arange(row, dtype=index_type) < (lens + 4).astype(index_type)[:, None]
    return np.compress(keep.reshape(-1), out), lens  # measured faster than boolean indexing


def _serialize(
    array: npt.NDArray[Any],
) -> tuple[bytes | bytearray | npt.NDArray[np.uint8], _Lengths | None]:
    """The wire bytes of ``array``, and the element lengths when there are more than a few."""
    kind = array.dtype.type
    if kind is _OBJECT_TYPE:
        few = _FEW_OBJECTS
    elif kind is _BYTES_TYPE:
        few = _FEW_FIXED
    else:
        raise TritonModelException(
            f"BYTES tensors are built from object or bytes (S) arrays, not dtype {array.dtype}"
        )
    n = array.size
    if n <= few:
        # item() / ravel().tolist() read any layout in C order and give S items as numpy's
        # bytes (trailing NULs dropped), exactly what the vectorised paths write.
        if n == 1:
            return _join_one(array.item()), None
        return (_join_few(array.ravel().tolist()) if n else _empty()), None
    if kind is _OBJECT_TYPE:
        return _serialize_objects(array.ravel().tolist())
    return _serialize_fixed(np.ascontiguousarray(array).reshape(-1))


def _empty() -> npt.NDArray[np.uint8]:
    return np.empty(0, dtype=np.uint8)


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
    return serialize_with_lengths(array)[0]


def serialize_with_lengths(
    array: npt.NDArray[Any],
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint32] | None]:
    """:func:`serialize`, and the element lengths it found on the way (no extra pass).

    The lengths (``uint32``, one per element in C order: a tensor keeps them, so they take the
    narrowest type the wire format allows) are returned for arrays of more than
    :data:`INDEX_MIN_ELEMENTS` elements, where a stored :func:`length_index` makes loads cheaper;
    ``None`` for fewer. Same errors as :func:`serialize`.
    """
    lens: _Lengths | None
    if type(array) is _ndarray and array.dtype.type is _OBJECT_TYPE:
        # The common input (a Tensor's object array), with the fewest steps.
        items = array.ravel().tolist()
        if len(items) <= _FEW_OBJECTS:
            if len(items) == 1:
                return _frombuffer(_join_one(items[0]), _U8), None
            return (_frombuffer(_join_few(items), _U8) if items else _empty()), None
        joined, found = _serialize_objects(items)
        out, lens = _frombuffer(joined, _U8), found
    else:
        wire, lens = _serialize(np.asarray(array))
        out = wire if type(wire) is _ndarray else _frombuffer(wire, _U8)
    if lens is None or lens.size <= INDEX_MIN_ELEMENTS:
        return out, None
    return out, lens.astype(np.uint32)


def length_index(lengths: npt.NDArray[np.integer[Any]]) -> bytes:
    """The stored form of a BYTES tensor's element lengths, to keep beside its wire bytes.

    ``lengths`` are the element lengths in order (from :func:`serialize_with_lengths`). Passed
    back as ``deserialize(..., index=...)``, the index lets a reader check the data and cut all
    elements at once instead of walking the chained length fields in Python. Layout
    (little-endian): ``b"pbtLENS1"``, ``uint64`` element count, ``uint64`` wire size, then one
    ``uint32`` length per element. pb-tensor's shared-memory records store it after the payload,
    outside ``byte_size``, where Triton's readers never look.
    """
    return _bytes_lengths.length_index(lengths)


def serialize_byte_tensor(input_tensor: npt.NDArray[Any]) -> bytes | tuple[()] | None:
    """``pb_utils.serialize_byte_tensor``: the wire bytes of an object or ``S`` array.

    Same results as upstream's Python helper: ``bytes`` for a non-empty object or ``S`` array,
    ``()`` for an empty array of any dtype, ``None`` for other dtypes; except that ``np.bytes_``
    elements of object arrays serialise as their bytes (see :func:`serialize` for the rules).

    Raises:
        TritonModelException: for an element longer than 4 GiB - 1 (upstream: ``struct.error``).
        UnicodeEncodeError: for a ``str`` element that is not encodable, as upstream.
    """
    if input_tensor.dtype is _OBJECT and type(input_tensor) is _ndarray:
        # The common input, in the fewest steps (the loops of _join_one and _join_few inlined:
        # with a few elements, a call is a measurable share). Object arrays are read as a list on
        # every path, and the count comes with it.
        items = input_tensor.ravel().tolist()
        if len(items) > _FEW_OBJECTS:
            out: bytes | bytearray | npt.NDArray[np.uint8] = _serialize_objects(items)[0]
            return out if type(out) is bytes else bytes(out)
        if len(items) == 1:
            part = items[0] if type(items[0]) is bytes else _encode(items[0])
            return _HEADS[len(part)] + part if len(part) < _HEAD_CAP else _join_one(part)
        if not items:
            return ()
        pieces: list[bytes] = []
        heads = _HEADS
        part = b""
        try:
            for item in items:
                part = item if type(item) is bytes else _encode(item)
                pieces.append(heads[len(part)])
                pieces.append(part)
        except IndexError:
            if len(part) < _HEAD_CAP:
                raise  # from an element's __str__ (``part`` is still the previous element)
            return _join_packed(pieces, part, items)
        return b"".join(pieces)
    kind = input_tensor.dtype.type
    n = input_tensor.size
    if n == 0:
        return ()
    if kind is not _OBJECT_TYPE and kind is not _BYTES_TYPE:
        return None
    if n <= _FEW_FIXED and type(input_tensor) is _ndarray:
        return _join_few(input_tensor.ravel().tolist())
    out = _serialize(np.asarray(input_tensor))[0]
    if type(out) is bytes:
        return out
    if isinstance(out, np.ndarray):
        return out.tobytes()
    return bytes(out)


# ------------------------------------------------------------------------------------------------
# deserialisation


def _pair(length: int) -> Callable[[Buffer, int], tuple[bytes, int]]:
    """The compiled reader of an element of ``length`` (< :data:`_PAIR_CAP`) and the next field."""
    unpack = _PAIRS[length] = struct.Struct(f"<{length}sI").unpack_from
    return unpack


def _split_few(data: bytes, end: int) -> list[bytes]:
    """Walk ``data`` (``end`` bytes, at most :data:`_FEW_WIRE`) with a plain loop.

    Same reads as :func:`_split`, but the loop ends on a bounds test, not on an exception (which
    costs more than a few elements).
    """
    if not end:
        return []
    try:
        length: int = _U32.unpack_from(data, 0)[0]
    except struct.error:
        raise TritonModelException(_INCOMPLETE) from None
    off = 4  # where the current element's bytes start
    stop = 4 + length  # and end
    if stop == end:  # one element: a tensor of one string is common
        return [data[4:]]
    out: list[bytes] = []
    pairs = _PAIRS
    while stop + 4 <= end:  # another length field follows this element
        try:
            item, length = pairs[length](data, off)
        except _NoFormat:  # the first element of this length (< _FEW_WIRE < _PAIR_CAP here)
            item, length = _pair(length)(data, off)
        out.append(item)
        off = stop + 4
        stop = off + length
    if stop > end:
        raise TritonModelException(_BEYOND)
    out.append(data[off:stop])
    if stop < end:
        raise TritonModelException(_INCOMPLETE)
    return out


def _split(data: Buffer, end: int) -> list[bytes]:
    """Walk the length fields of ``data`` (``end`` bytes, more than 0) into a list of elements.

    The chain of length fields is sequential, so this is a Python loop, made as short as
    measured possible: one ``struct`` call per element both copies the element out and reads the
    next length field (faster than unpack + slice, and than numpy pointer-jumping here).
    """
    out: list[bytes] = []
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
                out.append(item)
                off += length + 4
                length = following
        except _NoFormat:
            _pair(length)
            continue
        except IndexError:
            # Long elements: slice them until a short one hands back to the loop above, so a
            # run of long elements costs one exception, not one each.
            while length >= _PAIR_CAP:
                stop = off + length
                if stop + 4 > end:
                    break
                out.append(bytes(memoryview(data)[off:stop]))
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
    out.append(bytes(memoryview(data)[off:stop]))
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
    buf: Buffer | npt.NDArray[Any],
    count: int | None = None,
    *,
    index: Buffer | None = None,
) -> npt.NDArray[np.object_]:
    """The elements of a BYTES tensor's wire bytes, as a 1-D object array of ``bytes``.

    ``buf`` is any buffer (``bytes``, ``bytearray``, ``memoryview``, a ``uint8`` array that views
    shared memory ...); it is read, never kept. ``count``, when given, is the element count the
    caller expects (the product of the tensor's dims). ``index``, when given, is what
    :func:`length_index` made for this data (stored beside it); it is checked against the data
    and then spares the walk along the length fields. An ``index`` that is not a length index at
    all (no ``pbtLENS1`` head) is ignored and the data are walked.

    Raises:
        TritonModelException: ``"Invalid bytes tensor data: incomplete length field"`` or
            ``"Invalid bytes tensor data: string extends beyond buffer"`` for malformed data;
            ``"Invalid bytes tensor data: expected <count> elements, found <n>"`` when ``count``
            is given and differs; ``"Invalid bytes tensor data: stored element lengths ..."``
            when ``index`` is a length index that does not match the data exactly.
        TypeError: if ``buf`` or ``index`` does not support the buffer protocol.
    """
    if index is not None:
        indexed = _deserialize_indexed(buf, count, index)
        if indexed is not None:
            return indexed
    if type(buf) is bytes:
        data: bytes | None = buf
    elif type(buf) is _ndarray and buf.nbytes <= _SMALL_WIRE:
        data = buf.tobytes()  # C order, whatever the dtype and strides
    else:
        data = None
    if data is not None and len(data) <= _SMALL_WIRE:
        items = _split_few(data, len(data))
        result = _fromiter(items, _OBJECT, len(items))
    else:
        result = _deserialize_view(_byte_view(buf), data)
    if count is not None and count != len(result):
        raise TritonModelException(
            f"Invalid bytes tensor data: expected {count} elements, found {len(result)}"
        )
    return result


def _deserialize_indexed(
    buf: Buffer | npt.NDArray[Any], count: int | None, index: Buffer
) -> npt.NDArray[np.object_] | None:
    if not _bytes_lengths.is_index(index):
        return None
    # One copy into a bytes object: struct reads it fastest, and the checks and the cutting see
    # the same bytes even if shared memory changes meanwhile.
    data = buf if type(buf) is bytes else _byte_view(buf).tobytes()
    known = _bytes_lengths.read_index(index, data, count)
    if known is None:
        return None
    return _bytes_lengths.split_known(data, *known)


def _deserialize_view(view: memoryview, data: bytes | None) -> npt.NDArray[np.object_]:
    """:func:`deserialize` of ``view`` (``data``: the same bytes when the input was bytes)."""
    end = view.nbytes
    if end <= _SMALL_WIRE:
        items = _split_few(view.tobytes(), end)
        return _fromiter(items, _OBJECT, len(items))
    first = _U32.unpack_from(view, 0)[0]
    stride = 4 + first
    if end % stride == 0 and first < 1 << 31:
        result = _split_uniform(view, first, end // stride)
        if result is not None:
            return result
    if end <= _FEW_WIRE:
        # Varying lengths, not many: the walk without an exception ending it.
        items = _split_few(view.tobytes() if data is None else data, end)
    else:
        # struct reads a bytes object a little faster than a memoryview.
        items = _split(view if data is None else data, end)
    return _fromiter(items, _OBJECT, len(items))


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
    if type(encoded_tensor) is bytes and len(encoded_tensor) <= _SMALL_WIRE:
        items = _split_few(encoded_tensor, len(encoded_tensor))  # deserialize()'s first path
        return _fromiter(items, _OBJECT, len(items))
    return deserialize(encoded_tensor)
