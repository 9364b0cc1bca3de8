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

This package is the public face; the code is in private modules: the pool in ``_pool`` (with
``_mapped``, ``_locked``, ``_heap`` and ``_segment`` under it), the record layout in
``_record_layout``, saving and loading records in ``_records``.
"""

from __future__ import annotations

from pb_tensor.shm._heap import PoolStats
from pb_tensor.shm._pool import DEFAULT_GROWTH, DEFAULT_SIZE, SharedMemoryPool
from pb_tensor.shm._record_layout import (
    IPC_HANDLE_SIZE,
    MAX_DIMS,
    MEMORY_CPU,
    MEMORY_CPU_PINNED,
    MEMORY_GPU,
    PAYLOAD_ALIGNMENT,
    TensorRecord,
    record_payload_offset,
)
from pb_tensor.shm._records import (
    load_appendix,
    load_record,
    release,
    save_and_load_record,
    save_record,
)
from pb_tensor.shm._segment import SHM_DIR

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
