"""Stored element lengths of BYTES wire data: the *length index* (private to ``pb_tensor``).

The wire format chains its length fields: element ``i + 1``'s field is found only after reading
element ``i``'s, so a reader walks the data in Python, one element per step. When the writer
already knows every length (serialisation computes them), it can store them beside the data:

``[magic 8 B "pbtLENS1"][uint64 element count][uint64 wire size][uint32 length] * count``

all little-endian. A reader given an index checks it against the data with a few vectorised
steps (count, total size, and every stored length equal to the length field at the place the
stored lengths put it, which is exactly the chain a walk would follow), then cuts all elements
at once. The wire bytes themselves are unchanged: readers that know nothing of the index (Triton,
``tritonclient``) read the same data as before.

Public API through :mod:`pb_tensor.bytes_codec` (:func:`length_index`, ``deserialize(...,
index=...)``); the names here are shared with that module only.
"""

from __future__ import annotations

import struct
from functools import cache
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from pb_tensor.errors import TritonModelException

if TYPE_CHECKING:
    import numpy.typing as npt
    from typing_extensions import Buffer

__all__ = [
    "INDEX_MAGIC",
    "MIN_ELEMENTS",
    "is_index",
    "length_index",
    "read_index",
    "split_known",
]

INDEX_MAGIC: Final = b"pbtLENS1"
_HEAD: Final = struct.Struct("<8sQQ")  # magic, element count, wire size
MIN_ELEMENTS: Final = 1024
"""Tensors of more elements than this get an index: below it, walking costs about as much as
reading and checking one (and serialisation finds the lengths for free only above it)."""

# Elements shorter than this are cut by one compiled ``struct`` format per chunk of elements,
# made from a table of per-length tokens; longer ones are sliced (their copy dominates anyway).
_TOKEN_CAP: Final = 4096
_TOKEN_WIDTH: Final = 8  # "4x4095s" padded with spaces, which struct formats ignore
# Elements per compiled format: bounds the format's memory (about 40 bytes per element).
_CHUNK: Final = 8192
_OBJECT: Final = np.dtype(object)


def _corrupt(detail: str) -> TritonModelException:
    return TritonModelException(f"Invalid bytes tensor data: stored element lengths {detail}")


def length_index(lengths: npt.NDArray[np.integer[Any]]) -> bytes:
    """The length index of wire data whose elements have ``lengths`` (in order)."""
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    n = int(lens.size)
    wire = int(lens.sum()) + 4 * n
    return _HEAD.pack(INDEX_MAGIC, n, wire) + lens.astype("<u4").tobytes()


def is_index(index: Buffer) -> bool:
    """Whether ``index`` starts like a length index (it may still not match its data)."""
    view = memoryview(index).cast("B")
    return view.nbytes >= _HEAD.size and view[:8].tobytes() == INDEX_MAGIC


def read_index(
    index: Buffer, data: bytes, count: int | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]] | None:
    """The element lengths and length-field offsets that ``index`` gives for ``data``.

    None when ``index`` is not a length index (too short for its head, or another magic): the
    caller walks the data instead. ``count`` is the element count the caller expects, if known.

    Raises:
        TritonModelException: an index that does not match ``data`` exactly (another element
            count or size, truncated, or any stored length not equal to the data's length field
            where it must be): ``"Invalid bytes tensor data: stored element lengths ..."``.
    """
    view = memoryview(index).cast("B")
    if view.nbytes < _HEAD.size:
        return None
    magic, n, wire = _HEAD.unpack_from(view, 0)
    if magic != INDEX_MAGIC:
        return None
    end = len(data)
    if count is not None and n != count:
        raise _corrupt(f"are for {n} elements, the tensor has {count}")
    if wire != end:
        raise _corrupt(f"are for {wire} bytes of data, found {end}")
    need = _HEAD.size + 4 * n
    if view.nbytes < need:
        raise _corrupt(f"are truncated: {view.nbytes} bytes, {need} needed")
    # A copy: the checks and the cutting below must see the same lengths.
    lens = np.frombuffer(view, dtype="<u4", count=n, offset=_HEAD.size).astype(np.int64)
    if not n:
        if end:
            raise _corrupt(f"are for 0 elements, the data has {end} bytes")
        return lens, lens
    # No overflow: n * 2**32 < 2**63 for any n up to a wire size of 8 GiB (n <= wire / 4).
    fields = np.cumsum(lens + 4)
    if int(fields[-1]) != end:
        raise _corrupt(f"add up to {int(fields[-1])} bytes, the data has {end}")
    fields -= lens
    fields -= 4
    # The 4 bytes at every offset of the data as a little-endian uint32 (a strided view), read
    # where the stored lengths put each length field.
    at_every_byte = np.ndarray((end - 3,), dtype="<u4", buffer=data, strides=(1,))
    mismatch = np.flatnonzero(at_every_byte[fields] != lens)
    if mismatch.size:
        i = int(mismatch[0])
        raise _corrupt(
            f"do not match the data: element {i} is stored as {int(lens[i])} bytes, its length "
            f"field says {int(at_every_byte[fields[i]])}"
        )
    return lens, fields


@cache
def _tokens() -> npt.NDArray[np.bytes_]:
    """``b"4x<L>s"`` for every L below the cap, space-padded to one width (made on first use)."""
    return np.array(
        [f"4x{length}s".ljust(_TOKEN_WIDTH).encode() for length in range(_TOKEN_CAP)],
        dtype=f"S{_TOKEN_WIDTH}",
    )


def split_known(
    data: bytes, lens: npt.NDArray[np.int64], fields: npt.NDArray[np.int64]
) -> npt.NDArray[np.object_]:
    """The elements of ``data`` as a 1-D object array of ``bytes``, cut at checked offsets.

    ``lens`` and ``fields`` come from :func:`read_index` (every element lies inside ``data``).
    """
    n = int(lens.size)
    out: npt.NDArray[np.object_] = np.empty(n, dtype=_OBJECT)
    if not n:
        return out
    longest = int(lens.max())
    if int(lens.min()) == longest:
        if not longest:
            out.fill(b"")
            return out
        # 'V' rows keep trailing NULs (unlike 'S') and convert to exact ``bytes`` objects.
        rows = np.ndarray((n,), dtype=f"V{longest}", buffer=data, offset=4, strides=(4 + longest,))
        out[:] = rows.astype(_OBJECT)
        return out
    if longest < _TOKEN_CAP:
        # One struct call per chunk makes all its elements, skipping their length fields.
        tokens = _tokens()
        for start in range(0, n, _CHUNK):
            stop = min(start + _CHUNK, n)
            layout = struct.Struct(b"<" + tokens[lens[start:stop]].tobytes())
            out[start:stop] = layout.unpack_from(data, int(fields[start]))
        return out
    starts = fields + 4
    out[:] = list(map(data.__getitem__, map(slice, starts.tolist(), (starts + lens).tolist())))
    return out
