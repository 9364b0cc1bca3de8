"""Shared-memory tensor pool: move tensors between processes with one copy in, none out.

A :class:`SharedMemoryPool` is one POSIX shared-memory segment holding a heap addressed by
integer *handles* (byte offsets, the same in every process), each allocation carrying a
reference count in shared memory, guarded by a lock that a crashed process cannot leave held.
Tensors are stored as *records* in Triton python_backend's layout::

    [ref-count prefix 16 B: uint32 count,         <- handle
     uint32 pending messages (in upstream's padding), 8 pad]
    [TensorShm 24 B: int64 memory (0 = inline), int32 dtype, 4 pad, uint64 dims_count]
    [int64 dims[dims_count]]
    [StringShm 16 B: int64 data handle, uint64 length][name bytes, no NUL]
    [MemoryShm 56 B: uint64 gpu_pointer_offset, bool use_cuda_shared_pool, 7 pad,
                     uint64 cuda_pool_offset, int32 memory_type, 4 pad, int64 memory_type_id,
                     uint64 byte_size, uint64 memory_release_id]
    [zero padding up to a 64-byte boundary]
    [payload: byte_size bytes (CPU, CPU_PINNED) or a 64-byte CUDA IPC handle slot (GPU)]

Unlike upstream, the payload starts on a 64-byte boundary so numpy views of it are aligned for
every dtype. :func:`save_record` copies the payload once and returns a handle carrying a
*message* reference: the record stays valid until a load takes the message over
(``take=True``, as ``Tensor.load_from_shared_memory`` does) or :func:`release` gives it back.
:func:`load_record` returns a zero-copy view that keeps the record alive until it and every
array derived from it are gone. See docs/shared-memory.md.

This module takes and returns primitives only (``int`` dtype and memory-type codes, as
``TRITONSERVER_DataType`` / ``TRITONSERVER_MemoryType``); :mod:`pb_tensor.tensor` builds
``Tensor`` objects on top of it.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple, SupportsIndex

import numpy as np
import numpy.typing as npt

from pb_tensor.errors import TritonModelException
from pb_tensor.shm._heap import PREFIX, RECORD, PoolStats
from pb_tensor.shm._pool import DEFAULT_GROWTH, DEFAULT_SIZE, SharedMemoryPool
from pb_tensor.shm._segment import SHM_DIR, Mapping

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "DEFAULT_GROWTH",
    "DEFAULT_SIZE",
    "IPC_HANDLE_SIZE",
    "MAX_DIMS",
    "MEMORY_CPU",
    "MEMORY_CPU_PINNED",
    "MEMORY_GPU",
    "PAYLOAD_ALIGNMENT",
    "SHM_DIR",
    "PoolStats",
    "SharedMemoryPool",
    "TensorRecord",
    "load_appendix",
    "load_record",
    "record_payload_offset",
    "release",
    "save_and_load_record",
    "save_record",
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

_TENSOR_SHM = struct.Struct("=qi4xQ")  # memory handle, dtype, dims_count
_STRING_SHM = struct.Struct("=qQ")  # data handle, length
_MEMORY_SHM = struct.Struct("=Q?7xQi4xqQQ")
_FIXED: Final = _TENSOR_SHM.size + _STRING_SHM.size + _MEMORY_SHM.size  # 96
_I64_MAX: Final = (1 << 63) - 1
_U64_MAX: Final = (1 << 64) - 1

# Bytes per element of each TRITONSERVER_DataType; 0 where byte_size is free-form
# (INVALID: unknown element size, BYTES: serialized strings).
_ITEMSIZE: Final = (0, 1, 1, 2, 4, 8, 1, 2, 4, 8, 2, 4, 8, 0, 2)
_DTYPE_MAX: Final = len(_ITEMSIZE) - 1  # BF16 = 14
_BYTES: Final = 13
# Upstream has no limit; numpy stops at 64 dimensions. The cap keeps a corrupted dims_count in
# a large record from turning a load into a multi-megabyte unpack.
MAX_DIMS: Final = 255

# Payloads up to this size are copied with one mmap slice assignment (no numpy destination).
_SMALL: Final = 1 << 16
_ndview: Final = np.ndarray.view

_U64 = struct.Struct("=Q")
_tail_structs: dict[tuple[int, int], struct.Struct] = {}
_dims_structs: dict[int, struct.Struct] = {}
_header_structs: dict[tuple[int, int], struct.Struct] = {}
_STRUCT_CACHE_MAX: Final = 1024


def _dims_struct(ndim: int) -> struct.Struct:
    s = _dims_structs.get(ndim)
    if s is None:
        s = struct.Struct(f"={ndim}q")
        if len(_dims_structs) < _STRUCT_CACHE_MAX:
            _dims_structs[ndim] = s
    return s


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


def _header_struct(ndim: int, name_len: int, pad: int) -> struct.Struct:
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
    return (_FIXED + 8 * ndim + name_len + PAYLOAD_ALIGNMENT - 1) & -PAYLOAD_ALIGNMENT


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


def _int(value: SupportsIndex, field: str, low: int, high: int) -> int:
    if type(value) is int and low <= value <= high:
        return value  # the common case, without the generic path below
    try:
        result = operator.index(value)
    except TypeError:
        raise TritonModelException(f"{field} must be an int, not {type(value).__name__}") from None
    if isinstance(value, bool) or not low <= result <= high:
        raise TritonModelException(f"{field} {value!r} is out of range [{low}, {high}]")
    return result


def _dims_fit(dims: Sequence[int]) -> bool:
    """Whether numpy can shape an array (of up to 8-byte items) with ``dims``.

    numpy multiplies the non-zero dimensions even when one is zero, so ``(0, 2**62, 4)``
    has no elements yet is refused: check the same product.
    """
    size = 8
    for d in dims:
        if d:
            size *= d
    return size <= _I64_MAX


def _check_byte_size(dtype: int, dims: Sequence[int], byte_size: int) -> bool:
    itemsize = _ITEMSIZE[dtype]
    return not itemsize or byte_size == math.prod(dims) * itemsize


def _source(payload: npt.NDArray[Any] | Buffer, byte_size: int) -> npt.NDArray[np.generic]:
    """The payload as an array to copy from (any layout for numpy, contiguous buffers)."""
    if isinstance(payload, np.ndarray):
        if payload.dtype.hasobject:
            raise TritonModelException("payload of object dtype cannot be stored in shared memory")
        src: npt.NDArray[np.generic] = payload
    else:
        try:
            view = memoryview(payload)
        except TypeError:
            raise TritonModelException(
                f"payload must be a numpy array or a buffer, not {type(payload).__name__}"
            ) from None
        if not view.c_contiguous:
            raise TritonModelException("payload buffer must be C-contiguous")
        src = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    if src.nbytes != byte_size:
        raise TritonModelException(f"payload holds {src.nbytes} bytes but byte_size is {byte_size}")
    return src


def save_record(
    pool: SharedMemoryPool,
    *,
    name: str,
    dtype: int,
    dims: Sequence[int],
    memory_type: int,
    memory_type_id: int,
    payload: npt.NDArray[Any] | Buffer | None,
    byte_size: int,
    gpu_pointer_offset: int = 0,
    ipc_handle: bytes | None = None,
    memory_release_id: int = 0,
    appendix: Buffer | None = None,
) -> int:
    """Store a tensor record in ``pool``; its handle, carrying one *message* reference.

    The record stays valid until that message is taken over by a load
    (``Tensor.load_from_shared_memory``, or :func:`load_record` with ``take=True``) or given
    back with :func:`release` / :meth:`SharedMemoryPool.release`, whatever happens to the
    saving process in between. Records saved and neither loaded nor released show in
    :meth:`SharedMemoryPool.stats`.

    ``payload`` (CPU and CPU_PINNED) is a numpy array of any layout or a C-contiguous buffer
    of exactly ``byte_size`` bytes, copied once into the pool; ``None`` leaves the payload
    unwritten for the caller to fill through :func:`load_record`'s view. For GPU records
    ``payload`` must be ``None``: ``byte_size`` describes the device memory and the 64-byte
    slot holds ``ipc_handle`` (zeros when ``None``).

    ``appendix`` (CPU records only) is stored in the allocation after the payload, outside
    ``byte_size``, where Triton's readers never look; :func:`load_appendix` reads it back.
    pb-tensor keeps a BYTES tensor's length index there
    (:func:`pb_tensor.bytes_codec.length_index`).

    Raises:
        TritonModelException: an argument is out of range (dtype not a
            ``TRITONSERVER_DataType``, memory type not 0-2, negative dims or more than
            :data:`MAX_DIMS` of them, ``byte_size`` not
            matching dims and dtype, a payload of the wrong size or layout, a name that is
            not valid UTF-8 text), the pool is closed, or it cannot grow enough (the message
            gives the requested and available sizes).
    """
    return _save(
        pool, name, dtype, dims, memory_type, memory_type_id, payload, byte_size,
        gpu_pointer_offset, ipc_handle, memory_release_id, appendix, hold=False,
    )[0]  # fmt: skip


def save_and_load_record(
    pool: SharedMemoryPool,
    *,
    name: str,
    dtype: int,
    dims: Sequence[int],
    memory_type: int,
    memory_type_id: int,
    payload: npt.NDArray[Any] | Buffer | None,
    byte_size: int,
    gpu_pointer_offset: int = 0,
    ipc_handle: bytes | None = None,
    memory_release_id: int = 0,
    appendix: Buffer | None = None,
) -> TensorRecord:
    """:func:`save_record` then :func:`load_record` of the new record, in one lock cycle.

    The record's ``handle`` carries one message reference (as from :func:`save_record`);
    the returned record's payload view holds a second one, for the saver.

    Raises:
        TritonModelException: as :func:`save_record`.
    """
    record = _save(
        pool, name, dtype, dims, memory_type, memory_type_id, payload, byte_size,
        gpu_pointer_offset, ipc_handle, memory_release_id, appendix, hold=True,
    )[1]  # fmt: skip
    if record is None:  # pragma: no cover - hold=True always builds one
        raise TritonModelException("internal error: no record from a held save")
    return record


def _save(
    pool: SharedMemoryPool,
    name: str,
    dtype: int,
    dims: Sequence[int],
    memory_type: int,
    memory_type_id: int,
    payload: npt.NDArray[Any] | Buffer | None,
    byte_size: int,
    gpu_pointer_offset: int,
    ipc_handle: bytes | None,
    memory_release_id: int,
    appendix: Buffer | None,
    *,
    hold: bool,
) -> tuple[int, TensorRecord | None]:
    if not isinstance(name, str):
        raise TritonModelException(f"name must be a str, not {type(name).__name__}")
    try:
        name_b = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TritonModelException(f"name {name!r} is not valid UTF-8 text: {exc}") from None
    dtype = _int(dtype, "dtype", 0, _DTYPE_MAX)
    dims_t = tuple(_int(d, "dimension", 0, _I64_MAX) for d in dims)
    if len(dims_t) > MAX_DIMS:
        raise TritonModelException(f"{len(dims_t)} dimensions: at most {MAX_DIMS} are supported")
    memory_type = _int(memory_type, "memory_type", MEMORY_CPU, MEMORY_GPU)
    memory_type_id = _int(memory_type_id, "memory_type_id", 0, _I64_MAX)
    byte_size = _int(byte_size, "byte_size", 0, _I64_MAX)
    gpu_pointer_offset = _int(gpu_pointer_offset, "gpu_pointer_offset", 0, _U64_MAX)
    memory_release_id = _int(memory_release_id, "memory_release_id", 0, _U64_MAX)
    if not _check_byte_size(dtype, dims_t, byte_size):
        raise TritonModelException(
            f"byte_size {byte_size} does not match dims {list(dims_t)} of dtype {dtype}"
        )
    if not _dims_fit(dims_t):
        raise TritonModelException(
            f"dims {list(dims_t)} describe more elements than an array can hold"
        )
    src: npt.NDArray[np.generic] | None = None
    slot = b""
    if memory_type == MEMORY_GPU:
        if payload is not None:
            raise TritonModelException(
                "a GPU record stores a CUDA IPC handle, not the data: pass payload=None"
            )
        slot = bytes(IPC_HANDLE_SIZE) if ipc_handle is None else bytes(ipc_handle)
        if len(slot) != IPC_HANDLE_SIZE:
            raise TritonModelException(
                f"ipc_handle must be {IPC_HANDLE_SIZE} bytes, got {len(slot)}"
            )
        payload_len = IPC_HANDLE_SIZE
    else:
        if ipc_handle is not None:
            raise TritonModelException("ipc_handle is only stored for GPU records")
        if payload is not None:
            src = _source(payload, byte_size)
        payload_len = byte_size
    extra = _appendix_bytes(appendix, memory_type)

    ndim, name_len = len(dims_t), len(name_b)
    poff = record_payload_offset(ndim, name_len)
    tail = _appendix_at(payload_len)
    # The message reference is ours until `cell` is emptied on the way out; an exception at
    # any point before gives it back (the holder of a held save gives its own back by dying).
    cell = [0]
    try:
        m, holder = pool._allocate(
            poff + (tail + len(extra) if extra else payload_len), RECORD, 2 if hold else 1, 1,
            cell,
            (poff, payload_len) if hold else None,
        )  # fmt: skip
        handle = cell[0]
        start = handle + PREFIX
        header = _header_struct(ndim, name_len, poff - _FIXED - 8 * ndim - name_len)
        header.pack_into(
            m.mm, start, 0, dtype, ndim, *dims_t,
            start + _TENSOR_SHM.size + 8 * ndim, name_len, name_b,
            gpu_pointer_offset, False, 0, memory_type, memory_type_id, byte_size,
            memory_release_id,
        )  # fmt: skip
        at = start + poff
        if slot:
            m.mm[at : at + IPC_HANDLE_SIZE] = slot
        elif src is not None and byte_size:
            if byte_size <= _SMALL and src.flags.c_contiguous:
                # Small payloads: one buffer copy, without building a destination array.
                m.mm[at : at + byte_size] = src.reshape(-1).view(np.uint8).data
            else:
                dst = m.base[at : at + byte_size]
                if src.flags.c_contiguous:
                    np.copyto(dst, src.reshape(-1).view(np.uint8))
                else:
                    # One strided pass straight into the pool (no temporary contiguous copy).
                    np.copyto(dst.view(src.dtype).reshape(src.shape), src)
        if extra:
            m.mm[at + tail : at + tail + len(extra)] = extra
        record = None
        if holder is not None:
            record = _new_record(
                TensorRecord,
                (handle, name, dtype, dims_t, memory_type, memory_type_id, byte_size,
                 gpu_pointer_offset, memory_release_id, slot or None,
                 _ndview(holder, np.ndarray)),
            )  # fmt: skip
        cell[0] = 0  # handed over: nothing that can raise until the return
        return handle, record
    finally:
        if cell[0]:
            pool._op(pool._drop_locked, cell[0], RECORD, True, 0)


def _appendix_at(payload_len: int) -> int:
    """Offset of the appendix from the payload start: the payload's end, 8-byte aligned."""
    return (payload_len + 7) & -8


def _appendix_bytes(appendix: Buffer | None, memory_type: int) -> memoryview | None:
    if appendix is None:
        return None
    if memory_type == MEMORY_GPU:
        raise TritonModelException("an appendix is only stored for CPU records")
    try:
        return memoryview(appendix).cast("B")
    except TypeError:
        raise TritonModelException(
            f"appendix must be a C-contiguous buffer, not {type(appendix).__name__}"
        ) from None


def load_appendix(pool: SharedMemoryPool, record: TensorRecord) -> bytes:
    """A copy of the bytes saved after ``record``'s payload (``save_record(appendix=...)``).

    ``b""`` when there are none: GPU records, and records saved without one (by pb-tensor or
    by anything that writes the plain Triton layout). One lock cycle.

    Raises:
        TritonModelException: ``record.handle`` is no longer a tensor record, or the pool is
            closed.
    """
    if record.memory_type == MEMORY_GPU:
        return b""
    return pool._call(_load_appendix_locked, pool, record)


def _load_appendix_locked(m: Mapping, pool: SharedMemoryPool, record: TensorRecord) -> bytes:
    nbytes = pool._check_block(m, record.handle, RECORD)[1]
    start = record.handle + PREFIX
    poff = record_payload_offset(len(record.dims), len(record.name.encode("utf-8")))
    at = start + poff + _appendix_at(record.byte_size)
    end = start + nbytes
    return m.mm[at:end] if end > at else b""


def _corrupt(handle: int, field: str, detail: str) -> TritonModelException:
    return TritonModelException(
        f"Corrupted tensor record at shared memory handle {handle}: {field} {detail}"
    )


def load_record(
    pool: SharedMemoryPool, handle: int, *, readonly: bool = False, take: bool = False
) -> TensorRecord:
    """Load the tensor record at ``handle``: a reference and a zero-copy payload view.

    With ``take`` the load takes over one pending message of the record (see
    :func:`save_record`) when it has one, as ``Tensor.load_from_shared_memory`` does;
    otherwise, or when every message was taken already, it adds a reference. Either way the
    reference belongs to the payload view: it is given back when the record and every array
    derived from its payload are gone. One lock cycle; the cost does not depend on the
    payload size (nothing is copied or touched). Every field is checked against the
    allocation before any payload byte is exposed. With ``readonly`` the payload view is not
    writable.

    Raises:
        TritonModelException: the handle is out of range, freed or not a tensor record; or the
            record is corrupted (the message names the handle and the field: allocation size,
            memory handle, dtype, dims_count, dims, name length, name, memory_type,
            memory_type_id, byte_size); or the pool is closed or truncated. Nothing is taken
            then.
    """
    fields, holder = pool._hold(handle, RECORD, take, _parse)
    # Until `claimed` is set, the holder dying (an exception on the way) gives a taken message
    # back to the record instead of dropping it.
    payload = _ndview(holder, np.ndarray)
    if readonly:
        payload.flags.writeable = False
    name, dtype, dims, memory_type, memory_type_id, byte_size, gpu_offset, release_id = fields
    record = _new_record(
        TensorRecord,
        (handle, name, dtype, dims, memory_type, memory_type_id, byte_size, gpu_offset,
         release_id, payload.tobytes() if memory_type == MEMORY_GPU else None, payload),
    )  # fmt: skip
    holder._claimed = True
    return record


# Building the NamedTuple through tuple.__new__ skips its Python-level __new__ (0.3 us -> 0.1).
_new_record = tuple.__new__

_Fields = tuple[str, int, tuple[int, ...], int, int, int, int, int]


def _parse(m: Mapping, handle: int, nbytes: int) -> tuple[_Fields, int, int]:
    """Check and decode the record at ``handle``: the fields, and the payload's offset from
    the record start and length. Three struct reads: TensorShm, the name length, then dims,
    name and MemoryShm at once."""
    mm = m.mm
    start = handle + PREFIX
    # The block header was checked: [start, start + nbytes) lies inside the mapping.
    if nbytes < _FIXED:
        raise _corrupt(handle, "allocation size", f"{nbytes} is too small for a record")
    memory, dtype, ndim = _TENSOR_SHM.unpack_from(mm, start)
    if memory:
        raise _corrupt(handle, "memory handle", f"{memory} (only inline memory is supported)")
    if not 0 <= dtype <= _DTYPE_MAX:
        raise _corrupt(handle, "dtype", f"{dtype} is not a TRITONSERVER_DataType")
    if ndim > MAX_DIMS or ndim > (nbytes - _FIXED) // 8:
        raise _corrupt(
            handle, "dims_count", f"{ndim} is over {MAX_DIMS} or does not fit in {nbytes} bytes"
        )
    name_len = _U64.unpack_from(mm, start + _TENSOR_SHM.size + 8 * ndim + 8)[0]
    if name_len > nbytes - _FIXED - 8 * ndim:
        raise _corrupt(handle, "name length", f"{name_len} does not fit in {nbytes} bytes")
    fields = _tail_struct(ndim, name_len).unpack_from(mm, start + _TENSOR_SHM.size)
    dims: tuple[int, ...] = fields[:ndim]
    if ndim and min(dims) < 0:
        raise _corrupt(handle, "dims", f"{list(dims)} has a negative dimension")
    if not _dims_fit(dims):
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
    if not _check_byte_size(dtype, dims, byte_size):
        raise _corrupt(
            handle, "byte_size", f"{byte_size} does not match dims {list(dims)} of dtype {dtype}"
        )
    if dtype == _BYTES and memory_type != MEMORY_GPU and byte_size < 4 * math.prod(dims):
        raise _corrupt(
            handle, "byte_size", f"{byte_size} cannot hold {math.prod(dims)} BYTES elements "
            "(4-byte length each)",
        )  # fmt: skip
    fields = (name, dtype, dims, memory_type, memory_type_id, byte_size, gpu_offset, release_id)
    return fields, poff, payload_len


def release(pool: SharedMemoryPool, handle: int) -> None:
    """Give back one pending message of the record at ``handle`` (from a save that will not
    be loaded): :meth:`SharedMemoryPool.release`.

    Raises:
        TritonModelException: the handle is out of range, freed or not a tensor record, the
            record has no pending message, or the pool is closed.
    """
    pool.release(handle)
