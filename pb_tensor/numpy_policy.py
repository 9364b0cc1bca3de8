"""Whether ``Tensor.as_numpy()`` of a BF16 tensor gives an ``ml_dtypes.bfloat16`` view.

Triton's ``as_numpy()`` always refuses BF16 ("Tensor dtype is BF16 and cannot be converted to
NumPy. Use to_dlpack() and from_dlpack() instead."). pb-tensor gives a view when ``ml_dtypes``
is installed: a documented extra, on by default for code using the Tensor directly. Inside a
model served by ``pb_tensor.runtime`` the extra is off unless the repository opts in
(``ModelRepository(..., bf16_as_numpy=True)``), so that a model passing here does not fail in
Triton. The setting is process-wide (:func:`set_bf16_numpy_default`, what a stub process sets)
with a per-context override (:func:`allow_bf16_numpy`, what an in-process model's calls use).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = [
    "allow_bf16_numpy",
    "bf16_numpy_allowed",
    "bf16_numpy_context",
    "reset_bf16_numpy_context",
    "set_bf16_numpy_default",
]

_default = True
_here: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "pb_tensor_bf16_numpy", default=None
)


def bf16_numpy_allowed() -> bool:
    """Whether BF16 ``as_numpy()`` may give an ``ml_dtypes`` view in the current context."""
    value = _here.get()
    return _default if value is None else value


def set_bf16_numpy_default(allowed: bool) -> bool:
    """Set the process-wide setting (True unless changed); returns the previous one."""
    global _default
    previous, _default = _default, bool(allowed)
    return previous


def bf16_numpy_context(allowed: bool) -> contextvars.Token[bool | None]:
    """From now on, in this thread or asyncio task only, BF16 ``as_numpy()`` follows
    ``allowed`` whatever the process-wide setting; pass the token to
    :func:`reset_bf16_numpy_context` to undo it."""
    return _here.set(bool(allowed))


def reset_bf16_numpy_context(token: contextvars.Token[bool | None]) -> None:
    """Undo the :func:`bf16_numpy_context` call that returned ``token``.

    Raises:
        ValueError: ``token`` was made in another context, or was used already.
        RuntimeError: ``token`` was used already (Python's ``ContextVar.reset`` rules).
    """
    _here.reset(token)


@contextlib.contextmanager
def allow_bf16_numpy(allowed: bool) -> Iterator[None]:
    """Within the block, in this thread or asyncio task only, BF16 ``as_numpy()`` follows
    ``allowed`` whatever the process-wide setting."""
    token = bf16_numpy_context(allowed)
    try:
        yield
    finally:
        reset_bf16_numpy_context(token)
