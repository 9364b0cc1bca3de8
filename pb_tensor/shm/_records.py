"""Saving and loading tensor records (private; import from ``pb_tensor.shm``).

:func:`save_record` and :func:`save_and_load_record` copy a payload into a new record,
:func:`load_record` hands out a zero-copy view of one, :func:`load_appendix` reads what a save
stored after the payload, :func:`release` gives a message back. The layout, its checks and the
decoding of a stored record are in :mod:`pb_tensor.shm._record_layout`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from pb_tensor.errors import TritonModelException
from pb_tensor.shm._heap import PREFIX, RECORD
from pb_tensor.shm._record_layout import (
    DTYPE_MAX,
    FIXED,
    I64_MAX,
    IPC_HANDLE_SIZE,
    MAX_DIMS,
    MEMORY_CPU,
    MEMORY_GPU,
    TENSOR_SHM,
    U64_MAX,
    RecordFields,
    TensorRecord,
    check_byte_size,
    checked_int,
    dims_fit,
    header_struct,
    parse_record,
    record_payload_offset,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from pb_tensor.shm._held import Held
    from pb_tensor.shm._pool import SharedMemoryPool
    from pb_tensor.shm._segment import Mapping

__all__ = [
    "load_appendix",
    "load_record",
    "record_of",
    "release",
    "save_and_load_record",
    "save_record",
    "save_small_held",
    "untake",
]

# Payloads up to this size are copied with one mmap slice assignment (no numpy destination).
_SMALL: Final = 1 << 16
_ndview: Final = np.ndarray.view
_DIMS_AT: Final = TENSOR_SHM.size  # the dims follow TensorShm


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


def save_and_load_record_into(
    cell: list[int],
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
    appendix: Buffer | None = None,
) -> TensorRecord:
    """:func:`save_and_load_record` whose message goes into the caller's ``cell[0]``.

    For a caller that hands the message on itself (``Tensor.save_to_shared_memory``): from
    the moment the record exists the message is in ``cell``, journalled by the pool, and the
    caller either empties the cell when it returns the handle or gives the message back with
    ``pool._release_cell_locked``; if neither happens (the call was abandoned by an
    asynchronous exception at any point) the pool's next sweep gives it back.

    Raises:
        TritonModelException: as :func:`save_record`.
    """
    record = _save(
        pool, name, dtype, dims, memory_type, memory_type_id, payload, byte_size,
        gpu_pointer_offset, ipc_handle, 0, appendix, hold=True, cell=cell,
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
    cell: list[int] | None = None,
) -> tuple[int, TensorRecord | None]:
    if not isinstance(name, str):
        raise TritonModelException(f"name must be a str, not {type(name).__name__}")
    try:
        name_b = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TritonModelException(f"name {name!r} is not valid UTF-8 text: {exc}") from None
    dtype = checked_int(dtype, "dtype", 0, DTYPE_MAX)
    dims_t = tuple(checked_int(d, "dimension", 0, I64_MAX) for d in dims)
    if len(dims_t) > MAX_DIMS:
        raise TritonModelException(f"{len(dims_t)} dimensions: at most {MAX_DIMS} are supported")
    memory_type = checked_int(memory_type, "memory_type", MEMORY_CPU, MEMORY_GPU)
    memory_type_id = checked_int(memory_type_id, "memory_type_id", 0, I64_MAX)
    byte_size = checked_int(byte_size, "byte_size", 0, I64_MAX)
    gpu_pointer_offset = checked_int(gpu_pointer_offset, "gpu_pointer_offset", 0, U64_MAX)
    memory_release_id = checked_int(memory_release_id, "memory_release_id", 0, U64_MAX)
    if not check_byte_size(dtype, dims_t, byte_size):
        raise TritonModelException(
            f"byte_size {byte_size} does not match dims {list(dims_t)} of dtype {dtype}"
        )
    if not dims_fit(dims_t):
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
    # A caller's cell stays the caller's to empty or give back.
    own = cell is None
    if cell is None:
        cell = [0]
    try:
        m, holder = pool._allocate(
            poff + (tail + len(extra) if extra else payload_len), RECORD, 2 if hold else 1, 1,
            cell,
            (poff, payload_len) if hold else None,
        )  # fmt: skip
        handle = cell[0]
        start = handle + PREFIX
        header = header_struct(ndim, name_len, poff - FIXED - 8 * ndim - name_len)
        header.pack_into(
            m.mm, start, 0, dtype, ndim, *dims_t,
            start + TENSOR_SHM.size + 8 * ndim, name_len, name_b,
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
        if own:
            cell[0] = 0  # handed over: nothing that can raise until the return
        return handle, record
    finally:
        if own and cell[0]:
            pool._op(pool._release_cell_locked, cell)


# (ndim, name length) -> (header struct, payload offset) for save_small_held.
_small_headers: dict[tuple[int, int], tuple[struct.Struct, int]] = {}
SMALL_PAYLOAD: Final = _SMALL
"""The largest payload :func:`save_small_held` takes (bytes)."""


def _small_header(ndim: int, name_len: int) -> tuple[struct.Struct, int]:
    poff = record_payload_offset(ndim, name_len)
    entry = (header_struct(ndim, name_len, poff - FIXED - 8 * ndim - name_len), poff)
    if len(_small_headers) >= 1024:
        _small_headers.clear()
    _small_headers[(ndim, name_len)] = entry
    return entry


def save_small_held(
    pool: SharedMemoryPool, name: str, dtype: int, src: npt.NDArray[Any], cell: list[int]
) -> TensorRecord:
    """:func:`save_and_load_record` of a small CPU array, for a caller that vouches for it.

    The small-transfer path of ``Tensor.save_to_shared_memory``: the record is the one
    :func:`save_and_load_record` would write (same bytes, same references, one lock cycle),
    without re-checking what the caller guarantees: ``src`` is a C-contiguous numeric array
    of at most :data:`SMALL_PAYLOAD` bytes whose element type is ``dtype``'s (not BYTES),
    ``name`` is ASCII, and the dims are ``src.shape``. Anything else takes the general path.
    The message goes into the caller's ``cell[0]``, who hands it on or gives it back
    (``pool._release_cell_locked``) as :func:`save_and_load_record_into` describes.

    Raises:
        TritonModelException: the pool is closed, or it cannot grow enough.
    """
    dims = src.shape
    ndim = len(dims)
    name_len = len(name)  # ASCII: one byte a character
    entry = _small_headers.get((ndim, name_len))
    if entry is None:
        entry = _small_header(ndim, name_len)
    header, poff = entry
    nbytes = src.nbytes
    m, holder = pool._allocate(poff + nbytes, RECORD, 2, 1, cell, (poff, nbytes))
    # The caller's cell holds the message from here: an exception leaves it to the caller.
    handle = cell[0]
    if holder is None:  # pragma: no cover - a view was asked for
        raise TritonModelException("internal error: no holder from a held allocation")
    start = handle + PREFIX
    mm = m.mm
    header.pack_into(
        mm, start, 0, dtype, ndim, *dims, start + _DIMS_AT + 8 * ndim, name_len,
        name.encode(), 0, False, 0, MEMORY_CPU, 0, nbytes, 0,
    )  # fmt: skip
    at = start + poff
    mm[at : at + nbytes] = src.data  # one buffer copy (C-contiguous)
    record = _new_record(
        TensorRecord,
        (handle, name, dtype, dims, MEMORY_CPU, 0, nbytes, 0, 0, None,
         _ndview(holder, np.ndarray)),
    )  # fmt: skip
    return record


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
    # As load_tensor: the try starts before the take, and until `_claim[0]` is set the holder
    # dying gives a taken message back to the record instead of dropping it.
    box: list[Held | None] = [None]
    try:
        fields, holder = pool._hold(handle, RECORD, take, parse_record, box)
        payload = _ndview(holder, np.ndarray)
        if readonly:
            payload.flags.writeable = False
        record = record_of(handle, fields, payload)
        holder._claim[0] = True
        return record
    except BaseException:
        untake(pool, box)
        raise


def untake(pool: SharedMemoryPool, box: list[Held | None]) -> None:
    """After a load raised: give back what it took (``box`` as passed to ``pool._hold``).

    A taken message is pending again when this returns, so the load's caller can release or
    load it at once, even while its exception (and the frames holding the holder) lives on.
    Retried here until it has happened: a second asynchronous exception inside the cleanup of
    the first is swallowed (the first goes on). Only one that lands on this function's own
    entry or loop jump escapes: the holder then gives the message back when it dies, or the
    pool's next sweep does once it is dead.
    """
    holder = box[0]
    while True:
        if holder is None or not holder._token:
            break
        try:
            pool._untake(box)
        except TritonModelException:
            return  # the pool is closed (nothing to give back to) or the record corrupted
        except BaseException:  # retried
            pass


def record_of(handle: int, fields: RecordFields, payload: npt.NDArray[np.uint8]) -> TensorRecord:
    """The :class:`TensorRecord` of a record read by ``parse_record`` and its payload view."""
    name, dtype, dims, memory_type, memory_type_id, byte_size, gpu_offset, release_id = fields
    return _new_record(
        TensorRecord,
        (handle, name, dtype, dims, memory_type, memory_type_id, byte_size, gpu_offset,
         release_id, payload.tobytes() if memory_type == MEMORY_GPU else None, payload),
    )  # fmt: skip


# Building the NamedTuple through tuple.__new__ skips its Python-level __new__ (0.3 us -> 0.1).
_new_record = tuple.__new__


def release(pool: SharedMemoryPool, handle: int) -> None:
    """Give back one pending message of the record at ``handle`` (from a save that will not
    be loaded): :meth:`SharedMemoryPool.release`.

    Raises:
        TritonModelException: the handle is out of range, freed or not a tensor record, the
            record has no pending message, or the pool is closed.
    """
    pool.release(handle)
