"""``Tensor.save_to_shared_memory`` / ``Tensor.load_from_shared_memory`` on top of
:mod:`pb_tensor.shm` (records of primitives) and :mod:`pb_tensor.cuda` (IPC for GPU data).

Private to ``pb_tensor``: :mod:`pb_tensor.tensor` calls these with the tensor (and, to load, a
factory of blank tensors), so this module never imports the Tensor class at run time."""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

import dlpack_ctypes as dl
from pb_tensor import bytes_codec, shm
from pb_tensor.dtypes import MemoryType, TritonDtype, numpy_dtype_of, triton_to_dlpack
from pb_tensor.errors import TritonModelException
from pb_tensor.shm._heap import RECORD
from pb_tensor.shm._held import new_lock
from pb_tensor.shm._record_layout import MEMORY_GPU, parse_record
from pb_tensor.shm._records import (
    SMALL_PAYLOAD,
    record_of,
    save_and_load_record_into,
    save_small_held,
    untake,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from pb_tensor.shm._held import Held
    from pb_tensor.tensor import Tensor

__all__ = ["give_back", "load_tensor", "save_tensor", "untake"]

_ndview = np.ndarray.view
# Serialized (BYTES) or kept through DLPack (BF16): these always take the general path.
_GENERAL_ONLY = frozenset((TritonDtype.TYPE_BYTES, TritonDtype.TYPE_BF16))
_DTYPES = {int(t): t for t in TritonDtype}
_MEMORY_TYPES = {int(t): t for t in MemoryType}
# The element type of each numeric dtype: loaded as a plain numpy view.
_NUMERIC = {
    int(t): numpy_dtype_of(t)
    for t in TritonDtype
    if t not in _GENERAL_ONLY and t != TritonDtype.TYPE_INVALID
}

# GPU tensors this process saved, by (pid, IPC handle, offset). CUDA cannot open an IPC handle
# in the process that made it, so a load here reuses the saving tensor's memory instead.
_saved_here: weakref.WeakValueDictionary[tuple[int, bytes, int], Tensor] = (
    weakref.WeakValueDictionary()
)


def _wrap(owner: object, data: int, dims: tuple[int, ...], dtype: TritonDtype,
          device: tuple[int, int]) -> dl.DLPackTensor:
    """A DLPackTensor over memory we already own (kept alive through ``owner``)."""
    exporter = dl.BufferExporter(owner, data, dims, None, dl.DataType(*triton_to_dlpack(dtype)),
                                 device)
    return dl.from_dlpack(exporter)


# Saves of one tensor are serialised (by a lock chosen from its id): two threads saving the
# same tensor must not both copy it, nor swap its data under each other. Striped, so that
# unrelated tensors rarely wait for each other's copy. Re-entrant locks for their ownership
# test (_held.OwnedLock), not for nesting.
_STRIPES = 64
_save_locks = [new_lock() for _ in range(_STRIPES)]


def _reinit_locks() -> None:
    # A fork while another thread held a stripe would leave it locked forever in the child.
    _save_locks[:] = [new_lock() for _ in range(_STRIPES)]


os.register_at_fork(after_in_child=_reinit_locks)


def save_tensor(tensor: Tensor, pool: shm.SharedMemoryPool, cell: list[int]) -> None:
    """Copy ``tensor`` into ``pool`` (once) and point the tensor at the pool's copy; the
    message goes to ``cell[0]``, which the caller (``Tensor.save_to_shared_memory``) hands out.

    Each call hands out one message on the record (see :func:`pb_tensor.shm.save_record`):
    the first copies the data; later calls (and saves of a tensor loaded from ``pool``)
    only add a message to the same record. Anything raised on the way (a signal handler,
    MemoryError) gives the message back (:func:`give_back`), so a save that raised hands out
    nothing; the caller hands the handle over in its own frame, so that no frame of the
    library is left between the hand-over and the caller (CPython 3.10 runs signal handlers
    after every call returns, in the frame the call returns to).
    """
    # `cell` holds the message from the moment it exists (it is journalled, see
    # _sweep_locked): if this is cut short before the give-back, the next sweep does it.
    try:
        state = tensor._shm
        if state is not None and state[0] is pool:
            pool._call(pool._add_message_locked, int(state[1]), cell)
        else:
            _save_serialised(tensor, pool, cell)
    except BaseException:
        give_back(pool, cell)
        raise


def give_back(pool: shm.SharedMemoryPool, cell: list[int]) -> None:
    """Give back the message ``cell`` holds, if any (a save that will not hand it out).

    Emptied with the release, under the lock; if this is interrupted before, the pool's next
    sweep gives the message back (the cell is journalled, see ``_sweep_locked``).
    """
    if cell[0]:
        pool._op(pool._release_cell_locked, cell)


def _save_serialised(tensor: Tensor, pool: shm.SharedMemoryPool, cell: list[int]) -> None:
    """The first save of ``tensor`` to ``pool`` (unless another thread's save got there
    first), holding the tensor's stripe lock; the message goes to ``cell[0]``."""
    lock = _save_locks[id(tensor) % _STRIPES]
    if lock._is_owned():
        # A save of this thread holds the stripe already: this one runs inside it (a signal
        # handler or a finaliser). Nothing else can run in this thread meanwhile, and the pool
        # refuses an operation started inside another one.
        _save_once(tensor, pool, cell)
        return
    try:
        with lock:
            _save_once(tensor, pool, cell)
    except BaseException:
        if lock._is_owned():  # the with statement's exit never ran (see _held.OwnedLock)
            lock.release()
        raise


def _save_once(tensor: Tensor, pool: shm.SharedMemoryPool, cell: list[int]) -> None:
    state = tensor._shm
    if state is not None and state[0] is pool:
        pool._call(pool._add_message_locked, int(state[1]), cell)
    else:
        _save_locked(tensor, pool, cell)


def _save_locked(tensor: Tensor, pool: shm.SharedMemoryPool, cell: list[int]) -> None:
    dtype = tensor._dtype
    dims = tensor._dims
    array = tensor._array
    if (
        array is not None
        and array.nbytes <= SMALL_PAYLOAD
        and tensor._memory_type != MemoryType.GPU
        and dtype not in _GENERAL_ONLY
        and array.shape == dims
        and array.flags.c_contiguous
        and tensor._name.isascii()
    ):
        # The small-transfer path: a numeric CPU array, nothing for the general path's checks
        # to find; the same record and the same adoption (_adopt) as the general path.
        record = save_small_held(pool, tensor._name, int(dtype), array, cell)
        tensor._array = _ndview(record.payload, numpy_dtype_of(dtype)).reshape(dims)
        tensor._dl = None
        tensor._memory_type = MemoryType.CPU
        tensor._memory_id = 0
        tensor._shm = (pool, record.handle, record.payload)
        return
    if tensor._memory_type == MemoryType.GPU:
        _save_gpu(tensor, pool, cell)
        return
    payload = _host_payload(tensor)
    # Pinned data lands in ordinary shared memory: the copy is plain CPU memory (as Triton's
    # server maps pinned buffers to CPU shared memory).
    # One lock cycle: the record is born with the message reference (for the handle) and the
    # saver's own (held by the payload view, that is by the tensor's data from now on).
    record = save_and_load_record_into(
        cell, pool, name=tensor._name, dtype=int(dtype), dims=dims,
        memory_type=int(MemoryType.CPU), memory_type_id=0,
        payload=payload, byte_size=int(payload.nbytes), appendix=_length_index(tensor),
    )  # fmt: skip
    _adopt(tensor, record)
    tensor._memory_type = MemoryType.CPU
    tensor._memory_id = 0
    tensor._shm = (pool, record.handle, record.payload)


def _save_gpu(tensor: Tensor, pool: shm.SharedMemoryPool, cell: list[int]) -> None:
    """Record the CUDA IPC handle of the tensor's allocation and the pointer's offset in it
    (upstream's layout); the data stays in device memory. No CUDA call for an empty tensor."""
    state = tensor._shm
    byte_size = tensor.byte_size
    device = tensor._memory_id
    origin = state[2] if state is not None else None
    if isinstance(origin, shm.TensorRecord) and origin.ipc_handle is not None:
        # Saved or loaded before: reuse that record's handle. Memory mapped from another
        # process's handle could not be exported again (cudaIpcGetMemHandle refuses it).
        ipc_handle, offset = origin.ipc_handle, origin.gpu_pointer_offset
    else:
        from pb_tensor import cuda

        ipc_handle, offset = cuda.ipc_export(tensor.data_ptr, byte_size, device=device)
    # As for CPU data: the tensor holds the record (the device memory must outlive every
    # reader), beside the message reference of the handle.
    record = save_and_load_record_into(
        cell, pool, name=tensor._name, dtype=int(tensor._dtype), dims=tensor._dims,
        memory_type=int(MemoryType.GPU), memory_type_id=device, payload=None,
        byte_size=byte_size, gpu_pointer_offset=offset, ipc_handle=ipc_handle,
    )  # fmt: skip
    tensor._shm = (pool, record.handle, record)
    key = (os.getpid(), ipc_handle, offset)
    if byte_size and key not in _saved_here:
        _saved_here[key] = tensor


def _open_gpu(record: shm.TensorRecord, dtype: TritonDtype) -> dl.DLPackTensor:
    """Device memory of a GPU record: IPC-mapped on the record's device (closed when the last
    user of the returned tensor is gone), or the saving tensor's memory in the saving process.
    """
    device = (int(dl.DLDeviceType.kDLCUDA), record.memory_type_id)
    ipc_handle = record.ipc_handle or b""
    offset = record.gpu_pointer_offset
    if record.byte_size:
        saver = _saved_here.get((os.getpid(), ipc_handle, offset))
        if (
            saver is not None
            and saver._dl is not None
            and saver._memory_id == record.memory_type_id
            and saver.byte_size >= record.byte_size
        ):
            return _wrap((saver._dl, record), saver.data_ptr, record.dims, dtype, device)
        if not any(ipc_handle):
            raise TritonModelException(
                f"GPU tensor record at shared memory handle {record.handle} holds no CUDA IPC "
                "handle"
            )
    from pb_tensor import cuda

    # 0 bytes: nothing is opened and no CUDA call is made (upstream server#4865).
    mapping = cuda.ipc_import(ipc_handle or bytes(cuda.IPC_HANDLE_SIZE), offset,
                              record.byte_size, device=record.memory_type_id)
    return _wrap((mapping, record), mapping.ptr, record.dims, dtype, device)


def _length_index(tensor: Tensor) -> bytes | None:
    """A BYTES tensor's element lengths, stored after its payload so loads skip the walk."""
    lengths = tensor._lengths
    return None if lengths is None else bytes_codec.length_index(lengths)


def _host_payload(tensor: Tensor) -> np.ndarray[Any, Any]:
    if tensor._serialized is not None:
        return tensor._serialized
    if tensor._array is not None:
        return tensor._array
    imported = tensor._dl
    if imported is None:
        return np.empty(0, dtype=np.uint8)
    return imported.numpy(raw=True)


def _adopt(tensor: Tensor, record: shm.TensorRecord) -> None:
    if tensor._dtype == TritonDtype.TYPE_BYTES:
        tensor._serialized = record.payload
    elif tensor._dtype == TritonDtype.TYPE_BF16:
        tensor._dl = _wrap(record.payload, _address(record.payload), tensor._dims,
                           tensor._dtype, (int(dl.DLDeviceType.kDLCPU), 0))
        tensor._array = None
    else:
        tensor._array = _view(record, tensor._dtype, tensor._dims)
        tensor._dl = None


def _address(array: np.ndarray[Any, Any]) -> int:
    return int(array.__array_interface__["data"][0])


def _view(record: shm.TensorRecord, dtype: TritonDtype, dims: tuple[int, ...]) -> Any:
    return record.payload.view(numpy_dtype_of(dtype)).reshape(dims)


def load_tensor(
    pool: shm.SharedMemoryPool,
    handle: int,
    blank: Callable[[str, TritonDtype, tuple[int, ...], MemoryType, int], Tensor],
    box: list[Held | None],
) -> tuple[Tensor, list[bool]]:
    """A Tensor viewing the record at ``handle``; GPU records open the CUDA IPC handle.

    ``blank(name, dtype, dims, memory_type, memory_type_id)`` makes a tensor with no data yet.
    The holder of the reference goes to ``box[0]`` before anything is taken; returned with
    its claim, which the caller (``Tensor.load_from_shared_memory``) sets once it holds the
    tensor in its own frame: until then the load can still fail, and the holder dying (or
    :func:`untake` with ``box``) gives the taken message back to the record. On an exception
    this gives it back itself before the exception goes on.
    """
    # shm.load_record(pool, handle, take=True), with the numeric CPU tensor built straight from
    # the parsed fields (no TensorRecord on the way): the small-transfer path of a load.
    # The try starts before the take: an exception that lands after it (even before _hold
    # returns) finds the holder in `box` and gives the message back before it goes on.
    try:
        fields, holder = pool._hold(handle, RECORD, True, parse_record, box)
        payload = _ndview(holder, np.ndarray)
        name, dtype, dims, memory_type, memory_type_id = fields[:5]
        element = _NUMERIC.get(dtype)
        if element is not None and memory_type != MEMORY_GPU:
            tensor = blank(name, _DTYPES[dtype], dims, _MEMORY_TYPES[memory_type], memory_type_id)
            tensor._shm = (pool, handle, payload)
            tensor._array = _ndview(payload, element).reshape(dims)
        else:
            tensor = _build(pool, handle, record_of(handle, fields, payload), blank)
        return tensor, holder._claim
    except BaseException:
        # A failed (or interrupted) load leaves the record as it found it: the message it
        # took is pending again, for another load or a release.
        untake(pool, box)
        raise


def _build(
    pool: shm.SharedMemoryPool,
    handle: int,
    record: shm.TensorRecord,
    blank: Callable[[str, TritonDtype, tuple[int, ...], MemoryType, int], Tensor],
) -> Tensor:
    # Looked up rather than called: an enum call costs more than the rest of this function.
    dtype = _DTYPES.get(record.dtype)
    memory_type = _MEMORY_TYPES.get(record.memory_type)
    if dtype is None or memory_type is None:
        raise TritonModelException(
            f"Corrupted tensor record at shared memory handle {handle}: "
            f"dtype {record.dtype} / memory_type {record.memory_type} unknown"
        )
    if dtype == TritonDtype.TYPE_INVALID:
        raise TritonModelException(
            f"Corrupted tensor record at shared memory handle {handle}: dtype 0 (TYPE_INVALID) "
            "cannot be loaded as a tensor"
        )
    tensor = blank(record.name, dtype, record.dims, memory_type, record.memory_type_id)
    if memory_type == MemoryType.GPU:
        tensor._dl = _open_gpu(record, dtype)
        tensor._shm = (pool, handle, record)
        return tensor
    tensor._shm = (pool, handle, record.payload)
    if dtype == TritonDtype.TYPE_BYTES:
        count = 1
        for n in record.dims:
            count *= n
        tensor._serialized = record.payload
        # Few elements are walked faster than an index is read and checked.
        index = shm.load_appendix(pool, record) if count > bytes_codec.INDEX_MIN_ELEMENTS else None
        try:
            tensor._array = bytes_codec.deserialize(record.payload, count, index=index).reshape(
                record.dims
            )
        except (TritonModelException, ValueError) as exc:
            raise TritonModelException(
                f"Corrupted tensor record at shared memory handle {handle}: BYTES payload {exc}"
            ) from None
        return tensor
    if dtype in _GENERAL_ONLY:
        _adopt(tensor, record)
    else:  # _adopt's numeric case, inline
        tensor._array = _ndview(record.payload, numpy_dtype_of(dtype)).reshape(record.dims)
    return tensor
