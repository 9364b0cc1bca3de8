"""The tensor record layout of :mod:`pb_tensor.shm` (private; import from ``pb_tensor.shm``).

The layout itself is drawn in :mod:`pb_tensor.shm`'s docstring. Here: its constants, the
``struct`` formats that write and read a record header in one call, :class:`TensorRecord`, the
checks of the fields a save is given, and :func:`parse_record`, which checks and decodes a
stored record before any payload byte is exposed. The names without a leading underscore are
shared with :mod:`pb_tensor.shm._records` (saving and loading).
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, NamedTuple, SupportsIndex

import numpy as np
import numpy.typing as npt

from pb_tensor.errors import TritonModelException
from pb_tensor.shm._heap import PREFIX

if TYPE_CHECKING:
    from pb_tensor.shm._segment import Mapping

__all__ = [
    "DTYPE_MAX",
    "FIXED",
    "I64_MAX",
    "IPC_HANDLE_SIZE",
    "MAX_DIMS",
    "MEMORY_CPU",
    "MEMORY_CPU_PINNED",
    "MEMORY_GPU",
    "PAYLOAD_ALIGNMENT",
    "TENSOR_SHM",
    "U64_MAX",
    "RecordFields",
    "TensorRecord",
    "check_byte_size",
    "checked_int",
    "dims_fit",
    "header_struct",
    "parse_record",
    "record_payload_offset",
]

MEMORY_CPU: Final = 0
"""``TRITONSERVER_MEMORY_CPU``."""
MEMORY_CPU_PINNED: Final = 1
"""``TRITONSERVER_MEMORY_CPU_PINNED``."""
MEMORY_GPU: Final = 2
"""``TRITONSERVER_MEMORY_GPU``: the payload is a CUDA IPC handle, not the data."""

IPC_HANDLE_SIZE: Final = 64
"""Size of ``cudaIpcMemHandle_t``, the payload of a GPU record."""
PAYLOAD_ALIGNMENT: Final = 64
"""Every record payload starts at a multiple of this many bytes (upstream does not pad)."""

TENSOR_SHM = struct.Struct("=qi4xQ")  # memory handle, dtype, dims_count
_STRING_SHM = struct.Struct("=qQ")  # data handle, length
_MEMORY_SHM = struct.Struct("=Q?7xQi4xqQQ")
FIXED: Final = TENSOR_SHM.size + _STRING_SHM.size + _MEMORY_SHM.size  # 96
I64_MAX: Final = (1 << 63) - 1
U64_MAX: Final = (1 << 64) - 1

# Bytes per element of each TRITONSERVER_DataType; 0 where byte_size is free-form
# (INVALID: unknown element size, BYTES: serialized strings).
_ITEMSIZE: Final = (0, 1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 4, 8, 0, 2)
DTYPE_MAX: Final = len(_ITEMSIZE) - 1  # BF16 = 14
_BYTES: Final = 13
# Upstream has no limit; numpy stops at 64 dimensions. The cap keeps a corrupted dims_count in
# a large record from turning a load into a multi-megabyte unpack.
MAX_DIMS: Final = 255

_U64 = struct.Struct("=Q")
_tail_structs: dict[tuple[int, int], struct.Struct] = {}
_header_structs: dict[tuple[int, int], struct.Struct] = {}
_STRUCT_CACHE_MAX: Final = 1024
# Layouts up to these sizes are remembered for the one-read path of parse_record.
_FAST_DIMS: Final = 8
_FAST_NAME: Final = 256


def _tail_struct(ndim: int, name_len: int) -> struct.Struct:
    """dims + StringShm + name + MemoryShm: what follows TensorShm, read in one call."""
    key = (ndim, name_len)
    s = _tail_structs.get(key)
    if s is None:
        s = struct.Struct(f"={ndim}qqQ{name_len}sQ?7xQi4xqQQ")
        if len(_tail_structs) >= _STRUCT_CACHE_MAX:
            _tail_structs.clear()
        _tail_structs[key] = s
    return s


def header_struct(ndim: int, name_len: int, pad: int) -> struct.Struct:
    """TensorShm + dims + StringShm + name + MemoryShm + padding, packed in one call."""
    key = (ndim, name_len)
    s = _header_structs.get(key)
    if s is None:
        s = struct.Struct(f"=qi4xQ{ndim}qqQ{name_len}sQ?7xQi4xqQQ{pad}x")
        if len(_header_structs) >= _STRUCT_CACHE_MAX:
            _header_structs.clear()
        _header_structs[key] = s
    return s


def record_payload_offset(ndim: int, name_len: int) -> int:
    """Offset of the payload from the start of the record (``handle + 16``).

    ``name_len`` is the length of the UTF-8 encoded name. The record starts 64-byte aligned,
    so this is also what aligns the payload.
    """
    return (FIXED + 8 * ndim + name_len + PAYLOAD_ALIGNMENT - 1) & -PAYLOAD_ALIGNMENT


class TensorRecord(NamedTuple):
    """A tensor record loaded from a pool by :func:`load_record` (immutable, no ``__dict__``).

    ``payload`` is a zero-copy ``uint8`` view of the record's payload (for a GPU record, of
    its 64-byte CUDA IPC handle slot). The record holds one reference to the allocation; it is
    given back when this object and every array derived from ``payload`` are gone. (A
    ``NamedTuple`` because it is built on every load: four times cheaper than a frozen
    dataclass. Compare records field by field: ``==`` would compare the payload arrays.)
    """

    handle: int
    name: str
    dtype: int
    dims: tuple[int, ...]
    memory_type: int
    memory_type_id: int
    byte_size: int
    gpu_pointer_offset: int
    memory_release_id: int
    ipc_handle: bytes | None
    payload: npt.NDArray[np.uint8]

    def __repr__(self) -> str:
        return (
            f"TensorRecord(handle={self.handle}, name={self.name!r}, dtype={self.dtype}, "
            f"dims={self.dims}, memory_type={self.memory_type}, "
            f"memory_type_id={self.memory_type_id}, byte_size={self.byte_size})"
        )


TensorRecord.__module__ = "pb_tensor.shm"  # its public home (pickle, help(), repr of the type)


def checked_int(value: SupportsIndex, field: str, low: int, high: int) -> int:
    """``value`` as an ``int`` in ``[low, high]`` (not a bool); TritonModelException naming
    ``field`` otherwise."""
    if type(value) is int and low <= value <= high:
        return value  # the common case, without the generic path below
    try:
        result = operator.index(value)
    except TypeError:
        raise TritonModelException(f"{field} must be an int, not {type(value).__name__}") from None
    if isinstance(value, bool) or not low <= result <= high:
        raise TritonModelException(f"{field} {value!r} is out of range [{low}, {high}]")
    return result


def dims_fit(dims: Sequence[int]) -> bool:
    """Whether numpy can shape an array (of up to 8-byte items) with ``dims``.

    numpy multiplies the non-zero dimensions even when one is zero, so ``(0, 2**62, 4)``
    has no elements yet is refused: check the same product.
    """
    size = 8
    for d in dims:
        if d:
            size *= d
    return size <= I64_MAX


def check_byte_size(dtype: int, dims: Sequence[int], byte_size: int) -> bool:
    """Whether ``byte_size`` is what ``dims`` of ``dtype`` take (any size where it is free)."""
    itemsize = _ITEMSIZE[dtype]
    return not itemsize or byte_size == math.prod(dims) * itemsize


def _corrupt(handle: int, field: str, detail: str) -> TritonModelException:
    return TritonModelException(
        f"Corrupted tensor record at shared memory handle {handle}: {field} {detail}"
    )


# name, dtype, dims, memory_type, memory_type_id, byte_size, gpu_pointer_offset, release id
RecordFields = tuple[str, int, tuple[int, ...], int, int, int, int, int]


# The layout of the last record parsed here: (dims count, name length, the struct that reads
# its whole header, payload offset). A record of the same layout is read in one struct call.
_last_layout: list[tuple[int, int, struct.Struct, int]] = [
    (0, 0, struct.Struct("=qi4xQqQ0sQ?7xQi4xqQQ"), record_payload_offset(0, 0))
]


_layouts: dict[tuple[int, int], tuple[int, int, struct.Struct, int]] = {}


def _remember_layout(ndim: int, name_len: int) -> None:
    # Kept per layout, so that records of two layouts in turn (an input and an output) do not
    # build a struct on every parse.
    key = (ndim, name_len)
    layout = _layouts.get(key)
    if layout is None:
        full = struct.Struct(f"=qi4xQ{ndim}qqQ{name_len}sQ?7xQi4xqQQ")
        layout = (ndim, name_len, full, record_payload_offset(ndim, name_len))
        if len(_layouts) >= _STRUCT_CACHE_MAX:
            _layouts.clear()
        _layouts[key] = layout
    _last_layout[0] = layout


def parse_record(m: Mapping, handle: int, nbytes: int) -> tuple[RecordFields, int, int]:
    """Check and decode the record at ``handle``: the fields, and the payload's offset from
    the record start and length.

    A CPU record with the layout (dims count, name length) of the last record parsed, and
    every field valid, is read in one struct call; anything else (other layouts, GPU records,
    and every record that breaks a rule) takes the checked path below, which reads it in
    three (TensorShm, the name length, then dims, name and MemoryShm at once) and raises the
    error naming the field."""
    mm = m.mm
    g_ndim, g_name_len, full, poff = _last_layout[0]
    if nbytes >= full.size:  # the read stays inside the allocation
        f = full.unpack_from(mm, handle + PREFIX)
        dtype = f[1]
        if (
            f[0] == 0
            and f[2] == g_ndim
            and f[g_ndim + 4] == g_name_len
            and 0 < dtype <= DTYPE_MAX
        ):
            dims = f[3 : 3 + g_ndim]
            count = math.prod(dims)
            gpu_offset, _, _, memory_type, memory_type_id, byte_size, release_id = f[
                g_ndim + 6 :
            ]
            try:
                name = f[g_ndim + 5].decode("utf-8")
            except UnicodeDecodeError:
                name = None
            # Elements of a fixed-size type fill byte_size exactly, so a non-zero product of
            # non-negative dims that matches byte_size is what dims_fit and check_byte_size
            # accept; BYTES (item size 0) needs a 4-byte length per element (a zero
            # dimension, rare, goes the checked way).
            itemsize = _ITEMSIZE[dtype]
            if (
                name is not None
                and count > 0
                and (not g_ndim or min(dims) >= 0)
                and 8 * count <= I64_MAX
                and (byte_size == count * itemsize if itemsize else byte_size >= 4 * count)
                and MEMORY_CPU <= memory_type < MEMORY_GPU
                and memory_type_id >= 0
                and poff + byte_size <= nbytes
            ):
                fields = (name, dtype, dims, memory_type, memory_type_id, byte_size,
                          gpu_offset, release_id)  # fmt: skip
                return fields, poff, byte_size
    return _parse_checked(m, handle, nbytes)


def _parse_checked(m: Mapping, handle: int, nbytes: int) -> tuple[RecordFields, int, int]:
    mm = m.mm
    start = handle + PREFIX
    # The block header was checked: [start, start + nbytes) lies inside the mapping.
    if nbytes < FIXED:
        raise _corrupt(handle, "allocation size", f"{nbytes} is too small for a record")
    memory, dtype, ndim = TENSOR_SHM.unpack_from(mm, start)
    if memory:
        raise _corrupt(handle, "memory handle", f"{memory} (only inline memory is supported)")
    if not 0 <= dtype <= DTYPE_MAX:
        raise _corrupt(handle, "dtype", f"{dtype} is not a TRITONSERVER_DataType")
    if ndim > MAX_DIMS or ndim > (nbytes - FIXED) // 8:
        raise _corrupt(
            handle, "dims_count", f"{ndim} is over {MAX_DIMS} or does not fit in {nbytes} bytes"
        )
    name_len = _U64.unpack_from(mm, start + TENSOR_SHM.size + 8 * ndim + 8)[0]
    if name_len > nbytes - FIXED - 8 * ndim:
        raise _corrupt(handle, "name length", f"{name_len} does not fit in {nbytes} bytes")
    fields = _tail_struct(ndim, name_len).unpack_from(mm, start + TENSOR_SHM.size)
    dims: tuple[int, ...] = fields[:ndim]
    if ndim and min(dims) < 0:
        raise _corrupt(handle, "dims", f"{list(dims)} has a negative dimension")
    if not dims_fit(dims):
        raise _corrupt(handle, "dims", f"{list(dims)} describe more elements than an array holds")
    try:
        name = fields[ndim + 2].decode("utf-8")
    except UnicodeDecodeError:
        raise _corrupt(handle, "name", "is not valid UTF-8") from None
    gpu_offset, _, _, memory_type, memory_type_id, byte_size, release_id = fields[ndim + 3 :]
    if not MEMORY_CPU <= memory_type <= MEMORY_GPU:
        raise _corrupt(handle, "memory_type", f"{memory_type} is not 0, 1 or 2")
    if memory_type_id < 0:
        raise _corrupt(handle, "memory_type_id", f"{memory_type_id} is negative")
    poff = record_payload_offset(ndim, name_len)
    payload_len = IPC_HANDLE_SIZE if memory_type == MEMORY_GPU else byte_size
    if poff + payload_len > nbytes:
        raise _corrupt(
            handle, "byte_size", f"{byte_size} runs past the end of the {nbytes}-byte allocation"
        )
    if not check_byte_size(dtype, dims, byte_size):
        raise _corrupt(
            handle, "byte_size", f"{byte_size} does not match dims {list(dims)} of dtype {dtype}"
        )
    if dtype == _BYTES and memory_type != MEMORY_GPU and byte_size < 4 * math.prod(dims):
        raise _corrupt(
            handle, "byte_size", f"{byte_size} cannot hold {math.prod(dims)} BYTES elements "
            "(4-byte length each)",
        )  # fmt: skip
    fields = (name, dtype, dims, memory_type, memory_type_id, byte_size, gpu_offset, release_id)
    if (ndim, name_len) != _last_layout[0][:2] and ndim <= _FAST_DIMS and name_len <= _FAST_NAME:
        _remember_layout(ndim, name_len)
    return fields, poff, payload_len
