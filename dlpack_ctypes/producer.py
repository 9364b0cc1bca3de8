"""Producing DLPack capsules from pure Python.

Lifetime model:

* Each export allocates one ctypes block holding the managed struct followed by ``shape`` and
  ``strides``. ``_LIVE[address] = (block, owner)`` keeps the block and the data's owner alive
  until the deleter runs. The deleter is one immortal ``CFUNCTYPE(None, c_void_p)`` thunk whose
  body is pure bytecode, so it still works when a consumer calls it from a foreign thread, while
  an exception is pending, or during interpreter teardown (where it leaks on purpose).
* Capsules are created **without a destructor**. A ctypes destructor cannot run while an
  exception is pending without either losing the deleter call or turning the consumer's error
  into ``SystemError`` (numpy#32697). Instead every exported capsule is remembered in a
  pending queue and *swept* at safe points: when the queue outgrows a
  threshold during an export, after each garbage collection, at :func:`flush`, and at exit. A
  swept capsule that nobody else references and that still carries its fresh name was never
  consumed, so the sweep runs the deleter for it; a renamed one belongs to its consumer.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import gc
import operator
import struct
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, SupportsIndex, cast

if TYPE_CHECKING:
    # typing_extensions is not a runtime dependency: only annotations and string casts use it.
    from typing_extensions import CapsuleType

from dlpack_ctypes import _capi
from dlpack_ctypes.abi import (
    DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_READ_ONLY,
    DLPACK_MAJOR_VERSION,
    DLPACK_MINOR_VERSION,
    DLDeviceType,
    kDLCPU,
)
from dlpack_ctypes.dtypes import DataType

__all__ = [
    "HOST_DEVICES",
    "c_strides",
    "export_buffer",
    "flush",
    "live_exports",
    "negotiate",
]

#: Device types whose memory the CPU can address directly (numpy can view it).
HOST_DEVICES: Final = frozenset(
    {
        DLDeviceType.kDLCPU,
        DLDeviceType.kDLCUDAHost,
        DLDeviceType.kDLROCMHost,
        DLDeviceType.kDLCUDAManaged,
    }
)
_MAX_NDIM: Final = 64
_DEVICE_TYPES: Final = frozenset(int(d) for d in DLDeviceType)

# --------------------------------------------------------------------------------------------
# Registry and deleter

_LIVE: dict[int, tuple[object, object]] = {}
# _STATE[0]: set by the atexit hook; from then on deleters leak instead of touching Python state
# that teardown may already have cleared.
_STATE: list[bool] = [False]
_capi.immortalize(_LIVE)
_capi.immortalize(_STATE)


def _deleter_impl(addr: int | None, _live: Any = _LIVE, _state: Any = _STATE) -> None:
    # Pure bytecode on purpose (no calls): it must work with a pending exception, on any thread,
    # and after module globals are gone, which is why everything it needs is a default argument.
    if _state[0]:
        return
    if addr in _live:
        del _live[addr]


_DELETER: Final = _capi.VOIDFN(_deleter_impl)
_capi.immortalize(_DELETER)
_capi.immortalize(_deleter_impl)
DELETER_ADDRESS: Final[int] = cast(int, ctypes.cast(_DELETER, ctypes.c_void_p).value)

# --------------------------------------------------------------------------------------------
# Pending capsules (deferred release)

_PENDING: collections.deque[tuple[object, int, int]] = collections.deque()
_capi.immortalize(_PENDING)
# Re-entrant: dropping an owner during a sweep can run user finalisers that call flush().
_SWEEP_LOCK = threading.RLock()
_SWEEP_AT: list[int] = [64]
_getrefcount = sys.getrefcount
_is_valid = _capi.PyCapsule_IsValid


def _sweep_once(pending: Any = _PENDING, live: Any = _LIVE, rc_base: int = 0) -> int:
    """Examine every pending capsule once; returns how many are still pending."""
    for _ in range(len(pending)):
        try:
            cap, addr, fresh = pending.popleft()
        except IndexError:
            break
        if addr not in live:
            continue  # a consumer already ran our deleter
        if _getrefcount(cap) > rc_base:
            pending.append((cap, addr, fresh))  # still held by someone
            continue
        if _is_valid(cap, fresh):
            _deleter_impl(addr)  # dropped without being consumed
        # else: renamed, so the consumer owns it and will call the deleter.
    return len(pending)


def _calibrate_refcount() -> int:
    # The reference count _sweep_once sees for a capsule that only the queue holds depends on the
    # interpreter's calling conventions; find it by running the sweep itself on a probe capsule.
    for base in range(1, 16):
        probe: collections.deque[tuple[object, int, int]] = collections.deque()
        capsule = _capi.PyCapsule_New(_capi.ADDR_DLTENSOR, _capi.ADDR_DLTENSOR, None)
        probe.append((capsule, -1, _capi.ADDR_DLTENSOR))
        del capsule
        if _sweep_once(probe, {-1: None}, base) == 0:
            return base
    raise ImportError("dlpack_ctypes: could not calibrate capsule reference counts")


_RC_BASE: Final = _calibrate_refcount()


def flush() -> int:
    """Release every exported capsule that was dropped without being consumed.

    Sweeps also happen automatically (during exports, after garbage collections and at exit);
    call this where memory must be released at a known point, e.g. in tests.

    Returns:
        The number of exports still alive afterwards (consumed but not yet released by their
        consumer, or capsules still referenced).
    """
    with _SWEEP_LOCK:
        _sweep_once(_PENDING, _LIVE, _RC_BASE)
    return len(_LIVE)


def _maybe_sweep() -> None:
    if _SWEEP_LOCK.acquire(blocking=False):
        try:
            left = _sweep_once(_PENDING, _LIVE, _RC_BASE)
            _SWEEP_AT[0] = max(64, 2 * left)
        finally:
            _SWEEP_LOCK.release()


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "stop" and _PENDING:
        _maybe_sweep()


def _at_exit() -> None:
    flush()
    _STATE[0] = True


gc.callbacks.append(_on_gc)
atexit.register(_at_exit)


def live_exports() -> int:
    """Number of exports whose deleter has not run yet (after sweeping dropped capsules)."""
    return flush()


# --------------------------------------------------------------------------------------------
# Struct packing

# Native alignment ("@") reproduces the C layout; abi.py checks the same offsets at import.
_LEGACY_HEAD = "@PiiiBBHPPQPP"  # DLManagedTensor, 64 bytes
_VERSIONED_HEAD = "@IIPPQPiiiBBHPPQ"  # DLManagedTensorVersioned, 80 bytes
_PACKERS: dict[tuple[bool, int], tuple[Any, Any, int]] = {}


def _packer(versioned: bool, ndim: int) -> tuple[Any, Any, int]:
    key = (versioned, ndim)
    found = _PACKERS.get(key)
    if found is None:
        head = _VERSIONED_HEAD if versioned else _LEGACY_HEAD
        fmt = struct.Struct(head + "q" * (2 * ndim))
        block_type = ctypes.c_int64 * (fmt.size // 8)
        head_size = struct.calcsize(head)
        found = _PACKERS[key] = (fmt.pack_into, block_type, head_size)
    return found


def _check_shape(shape: Sequence[int], strides: Sequence[int] | None) -> None:
    ndim = len(shape)
    if ndim > _MAX_NDIM:
        raise BufferError(f"cannot export {ndim=}: at most {_MAX_NDIM} dimensions are supported")
    if strides is not None and len(strides) != ndim:
        raise ValueError(f"strides must have one entry per dimension: {shape=} {strides=}")
    if any(n < 0 for n in shape):
        raise ValueError(f"shape entries must be >= 0: {shape=}")


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    acc = 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = acc
        acc *= max(shape[i], 1)
    return strides


def export_buffer(
    owner: object,
    data: int,
    shape: Sequence[int],
    strides: Sequence[int] | None,
    dtype: DataType,
    device: tuple[int, int] = (kDLCPU, 0),
    *,
    versioned: bool = True,
    readonly: bool = False,
    copied: bool = False,
) -> CapsuleType:
    """Export memory as a fresh DLPack capsule, without any negotiation.

    Args:
        owner: kept alive until the consumer releases the tensor (or the capsule is dropped
            unconsumed); it must keep ``data`` valid.
        data: address of the first element (any offset already folded in; ``byte_offset`` is
            always emitted as 0).
        shape: dimensions.
        strides: strides **in elements**, or None for C-contiguous.
        dtype: the DLPack data type.
        device: ``(device_type, device_id)``.
        versioned: emit ``"dltensor_versioned"`` (version 1.3, with flags) rather than the
            legacy ``"dltensor"``.
        readonly: the data must not be written; sets READ_ONLY on versioned capsules.
        copied: sets IS_COPIED on versioned capsules.

    Raises:
        BufferError: read-only data requested as a legacy capsule (which cannot say so), or
            too many dimensions.
        ValueError: malformed shape or strides.
    """
    _check_shape(shape, strides)
    if readonly and not versioned:
        raise BufferError(
            "cannot export read-only data as a legacy 'dltensor' capsule, which cannot signal "
            "read-only; ask for max_version >= (1, 0)"
        )
    if strides is None:
        strides = _contiguous_strides(shape)
    return _export(owner, data, tuple(shape), tuple(strides), dtype, device, versioned,
                   (DLPACK_FLAG_BITMASK_READ_ONLY if readonly else 0)
                   | (DLPACK_FLAG_BITMASK_IS_COPIED if copied else 0))


def _export(
    owner: object,
    data: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: DataType,
    device: tuple[int, int],
    versioned: bool,
    flags: int,
    _live: Any = _LIVE,
    _pending: Any = _PENDING,
    _new: Any = _capi.PyCapsule_New,
    _addressof: Any = ctypes.addressof,
) -> CapsuleType:
    ndim = len(shape)
    found = _PACKERS.get((versioned, ndim))
    pack, block_type, head = found if found is not None else _packer(versioned, ndim)
    block = block_type()
    addr = _addressof(block)
    dims = addr + head if ndim else 0
    strd = dims + 8 * ndim if ndim else 0
    if versioned:
        pack(block, 0, DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION, 0, DELETER_ADDRESS, flags,
             data, device[0], device[1], ndim, dtype[0], dtype[1], dtype[2], dims, strd, 0,
             *shape, *strides)
        name = _capi.ADDR_DLTENSOR_VERSIONED
    else:
        pack(block, 0, data, device[0], device[1], ndim, dtype[0], dtype[1], dtype[2],
             dims, strd, 0, 0, DELETER_ADDRESS, *shape, *strides)
        name = _capi.ADDR_DLTENSOR
    _live[addr] = (block, owner)
    try:
        capsule = _new(addr, name, None)
    except BaseException:
        del _live[addr]
        raise
    _pending.append((capsule, addr, name))
    if len(_pending) > _SWEEP_AT[0]:
        _maybe_sweep()
    return cast("CapsuleType", capsule)


# --------------------------------------------------------------------------------------------
# Negotiation (the __dlpack__ request rules)


def _parse_pair(value: object, what: str) -> tuple[int, int]:
    try:
        first, second = cast("tuple[Any, Any]", value)
        return int(first), int(second)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a pair of integers or None: {what}={value!r}") from None


def negotiate(
    device: tuple[int, int],
    *,
    stream: object = None,
    max_version: object = None,
    dl_device: object = None,
    copy: bool | None = None,
    readonly: bool = False,
) -> tuple[bool, bool, tuple[int, int]]:
    """Apply the ``__dlpack__`` request rules for data on ``device``.

    Returns:
        ``(versioned, make_copy, out_device)``: which capsule kind to emit, whether the caller
        must copy the data first (``copy=True``), and the device to put in the capsule
        (``dl_device=(kDLCPU, 0)`` relabels host-accessible memory).

    Raises:
        TypeError: ``max_version`` or ``dl_device`` is not a pair, or ``copy`` is not a bool.
        ValueError: a ``stream`` that is invalid for the device (CPU takes None or -1; CUDA and
            ROCm reject 0 and negatives other than -1).
        BufferError: ``dl_device`` names another device; read-only data requested as a
            legacy capsule without a copy.
    """
    versioned = max_version is not None and _parse_pair(max_version, "max_version")[0] >= 1
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"copy must be True, False or None: {copy=!r}")
    out_device = device
    if dl_device is not None:
        target = _parse_pair(dl_device, "dl_device")
        if target != device:
            if target == (kDLCPU, 0) and device[0] in HOST_DEVICES:
                out_device = target
            else:
                raise BufferError(
                    f"unsupported device requested: dl_device={target!r}, the data is on "
                    f"device={device!r}"
                )
    if stream is not None:
        _check_stream(out_device[0], stream)
    make_copy = copy is True
    if readonly and not versioned and not make_copy:
        raise BufferError(
            "cannot export read-only data as a legacy 'dltensor' capsule, which cannot signal "
            "read-only; ask for max_version >= (1, 0)"
        )
    return versioned, make_copy, out_device


def _check_stream(device_type: int, stream: object) -> None:
    if isinstance(stream, bool):
        raise TypeError(f"stream must be an int or None: {stream=!r}")
    try:
        stream = operator.index(cast("SupportsIndex", stream))  # numpy integers are fine too
    except TypeError:
        raise TypeError(f"stream must be an int or None: {stream=!r}") from None
    if device_type in (DLDeviceType.kDLCUDA, DLDeviceType.kDLROCM, DLDeviceType.kDLCUDAManaged):
        if stream == 0 and device_type != DLDeviceType.kDLROCM:
            raise ValueError("stream=0 is ambiguous for CUDA and not allowed by DLPack: pass "
                             "1 for the legacy default stream, 2 for per-thread, or a handle")
        if stream < -1:
            raise ValueError(f"stream must be -1, None or a stream handle: {stream=}")
    elif stream != -1:
        raise ValueError(
            f"device type {device_type} has no streams: stream must be None or -1: {stream=}"
        )


_C_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The C-order strides of ``shape``, in elements (memoised: shapes repeat)."""
    found = _C_STRIDES.get(shape)
    if found is None:
        if len(_C_STRIDES) > 4096:
            _C_STRIDES.clear()
        found = _C_STRIDES[shape] = tuple(_contiguous_strides(shape))
    return found

