"""Shape checks and C-order strides of exports (shared privately by the exporters and consumers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

__all__ = [
    "C_STRIDES",
    "MAX_NDIM",
    "c_strides",
    "check_shape",
    "contiguous_strides",
]

MAX_NDIM: Final = 64

_C_STRIDES: dict[tuple[int, ...], tuple[int, ...]] = {}


def check_shape(shape: Sequence[int], strides: Sequence[int] | None) -> None:
    """Reject more than :data:`MAX_NDIM` dimensions, mismatched strides, negative sizes.

    Raises:
        BufferError: too many dimensions.
        ValueError: strides of another length, or a negative dimension.
    """
    ndim = len(shape)
    if ndim > MAX_NDIM:
        raise BufferError(f"cannot export {ndim=}: at most {MAX_NDIM} dimensions are supported")
    if strides is not None and len(strides) != ndim:
        raise ValueError(f"strides must have one entry per dimension: {shape=} {strides=}")
    if any(n < 0 for n in shape):
        raise ValueError(f"shape entries must be >= 0: {shape=}")


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """C-order strides of ``shape`` in elements (size-0 dimensions count as 1)."""
    strides = [1] * len(shape)
    acc = 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = acc
        acc *= max(shape[i], 1)
    return strides


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The C-order strides of ``shape``, in elements (memoised: shapes repeat)."""
    found = _C_STRIDES.get(shape)
    if found is None:
        if len(_C_STRIDES) > 4096:
            _C_STRIDES.clear()
        found = _C_STRIDES[shape] = tuple(contiguous_strides(shape))
    return found


#: The memo behind :func:`c_strides`, for callers that look up before calling.
C_STRIDES: Final = _C_STRIDES
