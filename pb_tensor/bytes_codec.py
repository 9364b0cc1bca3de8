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
codec is at least as fast as a per-element Python loop. This module picks the path; the loops and
vectorised kernels are in :mod:`pb_tensor._bytes_join` (serialisation) and
:mod:`pb_tensor._bytes_split` (deserialisation).

Deliberate differences from upstream (the README's "Differences from Triton" table):

* ``np.bytes_`` elements of an object array serialise as their bytes; upstream's exact-type test
  turns them into their ``repr`` (``b"b'ab'"``).
* Deserialisation checks every length field and raises
  :class:`~pb_tensor.errors.TritonModelException` with the messages of upstream's C++
  deserialiser instead of ``struct.error`` (upstream's Python helper).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import numpy as np

from pb_tensor import _bytes_lengths
from pb_tensor._bytes_join import (
    HEAD_CAP,
    HEADS,
    Lengths,
    encode,
    join_few,
    join_one,
    join_packed,
    serialize_fixed,
    serialize_objects,
)
from pb_tensor._bytes_split import SMALL_WIRE, byte_view, deserialize_view, split_few
from pb_tensor.errors import TritonModelException

if TYPE_CHECKING:
    import numpy.typing as npt
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

# Up to this many elements, a plain loop serialises faster than the vectorised paths (measured:
# object arrays cost about as much per element either way, so the loop wins up to ~1000; S arrays
# are vectorised without any per-element Python, which wins from ~150 on).
_FEW_OBJECTS: Final = 1024
_FEW_FIXED: Final = 128

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


def _serialize(
    array: npt.NDArray[Any],
) -> tuple[bytes | bytearray | npt.NDArray[np.uint8], Lengths | None]:
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
            return join_one(array.item()), None
        return (join_few(array.ravel().tolist()) if n else _empty()), None
    if kind is _OBJECT_TYPE:
        return serialize_objects(array.ravel().tolist())
    return serialize_fixed(np.ascontiguousarray(array).reshape(-1))


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
    lens: Lengths | None
    if type(array) is _ndarray and array.dtype.type is _OBJECT_TYPE:
        # The common input (a Tensor's object array), with the fewest steps.
        items = array.ravel().tolist()
        if len(items) <= _FEW_OBJECTS:
            if len(items) == 1:
                return _frombuffer(join_one(items[0]), _U8), None
            return (_frombuffer(join_few(items), _U8) if items else _empty()), None
        joined, found = serialize_objects(items)
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
        # The common input, in the fewest steps (the loops of join_one and join_few inlined:
        # with a few elements, a call is a measurable share). Object arrays are read as a list on
        # every path, and the count comes with it.
        items = input_tensor.ravel().tolist()
        if len(items) > _FEW_OBJECTS:
            out: bytes | bytearray | npt.NDArray[np.uint8] = serialize_objects(items)[0]
            return out if type(out) is bytes else bytes(out)
        if len(items) == 1:
            part = items[0] if type(items[0]) is bytes else encode(items[0])
            return HEADS[len(part)] + part if len(part) < HEAD_CAP else join_one(part)
        if not items:
            return ()
        pieces: list[bytes] = []
        heads = HEADS
        part = b""
        try:
            for item in items:
                part = item if type(item) is bytes else encode(item)
                pieces.append(heads[len(part)])
                pieces.append(part)
        except IndexError:
            if len(part) < HEAD_CAP:
                raise  # from an element's __str__ (``part`` is still the previous element)
            return join_packed(pieces, part, items)
        return b"".join(pieces)
    kind = input_tensor.dtype.type
    n = input_tensor.size
    if n == 0:
        return ()
    if kind is not _OBJECT_TYPE and kind is not _BYTES_TYPE:
        return None
    if n <= _FEW_FIXED and type(input_tensor) is _ndarray:
        return join_few(input_tensor.ravel().tolist())
    out = _serialize(np.asarray(input_tensor))[0]
    if type(out) is bytes:
        return out
    if isinstance(out, np.ndarray):
        return out.tobytes()
    return bytes(out)


# ------------------------------------------------------------------------------------------------
# deserialisation


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
    elif type(buf) is _ndarray and buf.nbytes <= SMALL_WIRE:
        data = buf.tobytes()  # C order, whatever the dtype and strides
    else:
        data = None
    if data is not None and len(data) <= SMALL_WIRE:
        items = split_few(data, len(data))
        result = _fromiter(items, _OBJECT, len(items))
    else:
        result = deserialize_view(byte_view(buf), data)
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
    data = buf if type(buf) is bytes else byte_view(buf).tobytes()
    known = _bytes_lengths.read_index(index, data, count)
    if known is None:
        return None
    return _bytes_lengths.split_known(data, *known)


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
    if type(encoded_tensor) is bytes and len(encoded_tensor) <= SMALL_WIRE:
        items = split_few(encoded_tensor, len(encoded_tensor))  # deserialize()'s first path
        return _fromiter(items, _OBJECT, len(items))
    return deserialize(encoded_tensor)
