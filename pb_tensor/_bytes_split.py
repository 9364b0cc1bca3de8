"""Deserialising BYTES wire data: the kernels behind :mod:`pb_tensor.bytes_codec` (private).

Walks along the chained length fields (:func:`split_few`, a plain loop for little data;
:func:`split`, the loop made as short as measured possible), the one-test path for elements all
of one length (:func:`split_uniform`), and :func:`deserialize_view`, which picks among them by
size. Data with a stored length index skip all of these (:mod:`pb_tensor._bytes_lengths`). The
names without a leading underscore are shared with :mod:`pb_tensor.bytes_codec` only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from pb_tensor.errors import TritonModelException

if TYPE_CHECKING:
    import numpy.typing as npt
    from typing_extensions import Buffer

__all__ = [
    "SMALL_WIRE",
    "byte_view",
    "deserialize_view",
    "split",
    "split_few",
    "split_uniform",
]

_U32: Final = struct.Struct("<I")
_INCOMPLETE: Final = "Invalid bytes tensor data: incomplete length field"
_BEYOND: Final = "Invalid bytes tensor data: string extends beyond buffer"

# Up to this many wire bytes, deserialisation is a plain loop: the fixed cost of a numpy probe or
# of an exception ending the loop is more than the whole loop there.
SMALL_WIRE: Final = 384
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

# Module-level names: on the few-element paths, attribute lookups are a measurable share of the
# whole call.
_OBJECT: Final = np.dtype(object)
_fromiter: Final = np.fromiter


def _pair(length: int) -> Callable[[Buffer, int], tuple[bytes, int]]:
    """The compiled reader of an element of ``length`` (< :data:`_PAIR_CAP`) and the next field."""
    unpack = _PAIRS[length] = struct.Struct(f"<{length}sI").unpack_from
    return unpack


def split_few(data: bytes, end: int) -> list[bytes]:
    """Walk ``data`` (``end`` bytes, at most :data:`_FEW_WIRE`) with a plain loop.

    Same reads as :func:`split`, but the loop ends on a bounds test, not on an exception (which
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


def split(data: Buffer, end: int) -> list[bytes]:
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


def split_uniform(view: memoryview, length: int, n: int) -> npt.NDArray[np.object_] | None:
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


def byte_view(buf: Buffer | npt.NDArray[Any]) -> memoryview:
    """``buf`` as a 1-D byte memoryview in C order (copied only when it is not contiguous)."""
    # ndarray.data, not memoryview(ndarray): NumPy's stubs declare __buffer__ on Python 3.12+
    # only, and ascontiguousarray makes a strided view readable in C order in the same step.
    view = np.ascontiguousarray(buf).data if isinstance(buf, np.ndarray) else memoryview(buf)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def deserialize_view(view: memoryview, data: bytes | None) -> npt.NDArray[np.object_]:
    """:func:`pb_tensor.bytes_codec.deserialize` of ``view`` (``data``: the same bytes when the
    input was bytes)."""
    end = view.nbytes
    if end <= SMALL_WIRE:
        items = split_few(view.tobytes(), end)
        return _fromiter(items, _OBJECT, len(items))
    first = _U32.unpack_from(view, 0)[0]
    stride = 4 + first
    if end % stride == 0 and first < 1 << 31:
        result = split_uniform(view, first, end // stride)
        if result is not None:
            return result
    if end <= _FEW_WIRE:
        # Varying lengths, not many: the walk without an exception ending it.
        items = split_few(view.tobytes() if data is None else data, end)
    else:
        # struct reads a bytes object a little faster than a memoryview.
        items = split(view if data is None else data, end)
    return _fromiter(items, _OBJECT, len(items))
