"""Serialising BYTES tensors: the kernels behind :mod:`pb_tensor.bytes_codec` (private).

Plain loops for a few elements (:func:`join_one`, :func:`join_few`, :func:`join_packed`) and the
vectorised paths for many (:func:`serialize_objects` for object arrays, :func:`serialize_fixed`
for ``S`` arrays). :mod:`pb_tensor.bytes_codec` picks one by dtype and element count; the names
without a leading underscore are shared with that module only.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

from pb_tensor.errors import TritonModelException

__all__ = [
    "HEADS",
    "HEAD_CAP",
    "MAX_ELEMENT",
    "U32",
    "Lengths",
    "encode",
    "join_few",
    "join_one",
    "join_packed",
    "serialize_fixed",
    "serialize_objects",
]

U32: Final = struct.Struct("<I")
MAX_ELEMENT: Final = 0xFFFFFFFF

# Above this mean element size (bytes), object arrays are joined with their length fields in one
# pass: the numpy scatter of length fields only pays off when there are many small elements.
_LARGE_OBJECT_ELEMENT: Final = 512

Lengths: TypeAlias = "npt.NDArray[np.int64]"
# The length fields of short elements, made once: indexing beats a ``pack`` call per element.
HEAD_CAP: Final = 1024
HEADS: Final = [U32.pack(length) for length in range(HEAD_CAP)]


def encode(item: object) -> bytes:
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


def join_one(item: object) -> bytes:
    """The wire bytes of a one-element tensor."""
    part = item if type(item) is bytes else encode(item)
    try:
        return U32.pack(len(part)) + part
    except struct.error:
        raise _too_long(len(part)) from None


def join_few(items: list[Any]) -> bytes:
    """Plain-loop serialisation of a few elements (object items, or ``S`` items as bytes)."""
    # The loops here call ``list.append`` as a method: CPython 3.11+ specialises that call,
    # not a call of a bound ``append`` kept in a local (measured ~15% slower per element).
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


def join_packed(pieces: list[bytes], part: bytes, items: list[Any]) -> bytes:
    """:func:`join_few` after its table of length fields ran out: an element of
    :data:`HEAD_CAP` bytes or more, ``part``, whose bytes dwarf the cost of getting here.

    ``pieces`` holds the elements before it; the rest go with a ``pack`` call per length field.
    """
    pack = U32.pack
    rest = items[len(pieces) // 2 + 1 :]
    try:
        pieces.append(pack(len(part)))
        pieces.append(part)
        for item in rest:
            part = item if type(item) is bytes else encode(item)
            pieces.append(pack(len(part)))
            pieces.append(part)
    except struct.error:
        if len(part) <= MAX_ELEMENT:
            raise  # from an element's __str__ (``part`` is still the previous element)
        raise _too_long(len(part)) from None
    return b"".join(pieces)


def _join_with_lengths(parts: list[bytes], lens: list[int]) -> bytes:
    pieces: list[bytes] = [b""] * (2 * len(parts))
    pieces[0::2] = map(U32.pack, lens)
    pieces[1::2] = parts
    return b"".join(pieces)


def serialize_objects(items: list[Any]) -> tuple[bytes | bytearray, Lengths]:
    """Many object items (more than bytes_codec's ``_FEW_OBJECTS``): the wire bytes and the
    element lengths."""
    parts = _object_parts(items)
    n = len(parts)
    lens = np.fromiter(map(len, parts), dtype=np.int64, count=n)
    longest = int(lens.max())
    if longest > MAX_ELEMENT:
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


def serialize_fixed(flat: npt.NDArray[np.bytes_]) -> tuple[npt.NDArray[np.uint8], Lengths]:
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
