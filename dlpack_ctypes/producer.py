"""Producing DLPack capsules from pure Python: :func:`export_buffer` and :func:`negotiate`.

Lifetime model (implemented in ``_blocks``): each export is one ctypes block (managed struct,
shape, strides) kept with the data's owner in a registry until the deleter runs. Capsules are
created **without a destructor** (a ctypes destructor cannot run while an exception is pending
without losing the deleter call or turning the consumer's error into ``SystemError``, numpy#32697);
every exported capsule waits in a pending queue and is *swept* at safe points: a bounded number
of entries during exports and after each garbage collection, all of them at :func:`flush` and at
exit. A swept capsule that still carries its fresh name and that nobody else references was never
consumed, so the sweep runs the deleter for it; a renamed one belongs to its consumer.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    # typing_extensions is not a runtime dependency: only annotations and string casts use it.
    from typing_extensions import CapsuleType

from dlpack_ctypes._blocks import (
    EXPORT_SWEEP_STEP,
    GC_SWEEP_EVERY,
    GC_SWEEP_STEP,
    SWEEP_LIMIT,
    flush,
    live_exports,
)
from dlpack_ctypes._pack import export
from dlpack_ctypes._shapes import c_strides, check_shape, contiguous_strides
from dlpack_ctypes._views import HOST_DEVICES
from dlpack_ctypes.abi import (
    DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_READ_ONLY,
    DLDeviceType,
    kDLCPU,
)
from dlpack_ctypes.dtypes import DataType

__all__ = [
    "EXPORT_SWEEP_STEP",
    "GC_SWEEP_EVERY",
    "GC_SWEEP_STEP",
    "HOST_DEVICES",
    "SWEEP_LIMIT",
    "c_strides",
    "export_buffer",
    "flush",
    "live_exports",
    "negotiate",
]


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
    check_shape(shape, strides)
    if readonly and not versioned:
        raise BufferError(
            "cannot export read-only data as a legacy 'dltensor' capsule, which cannot signal "
            "read-only; ask for max_version >= (1, 0)"
        )
    if strides is None:
        strides = contiguous_strides(shape)
    return export(owner, data, tuple(shape), tuple(strides), dtype, device, versioned,
                  (DLPACK_FLAG_BITMASK_READ_ONLY if readonly else 0)
                  | (DLPACK_FLAG_BITMASK_IS_COPIED if copied else 0))


# --------------------------------------------------------------------------------------------
# Negotiation (the __dlpack__ request rules)


def _parse_pair(value: Any, what: str) -> tuple[int, int]:
    try:
        first, second = value
        return int(first), int(second)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be a pair of integers or None: {what}={value!r}") from None


# max_version tuples of plain ints -> versioned? (the request's fast path; others are parsed).
_COMMON_REQUESTS: Final[dict[object, bool]] = {
    (major, minor): major >= 1 for major in range(3) for minor in range(16)
}


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
    if stream is None and dl_device is None and copy is None and not readonly:
        # The common request (numpy, torch, JAX ask exactly this): one dict lookup decides it.
        versioned_or_none = _COMMON_REQUESTS.get(max_version) if type(max_version) is tuple else (
            False if max_version is None else None)
        if versioned_or_none is not None:
            return versioned_or_none, False, device
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


def _check_stream(device_type: int, stream: Any) -> None:
    if isinstance(stream, bool):
        raise TypeError(f"stream must be an int or None: {stream=!r}")
    try:
        stream = operator.index(stream)  # numpy integers are fine too
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
