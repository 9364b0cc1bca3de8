"""Whether pb-tensor's additions to Triton's ``pb_utils`` API are available in this context.

pb-tensor's ``Tensor`` and ``TritonError`` do more than Triton's: ``triton_dtype()`` returns a
:class:`~pb_tensor.dtypes.TritonDtype` (Triton's raises ``TypeError``, python_backend#382),
``__dlpack__`` takes ``max_version`` / ``dl_device`` / ``copy`` (Triton's takes ``stream``
only), tensors pickle (Triton's do not), ``TritonError`` takes plain ``int`` codes (Triton's
takes its code enum only), and ``Tensor.from_dlpack`` accepts every C-contiguous layout (Triton's
check rejects some empty tensors). Code using pb-tensor directly gets them all (the default).
Inside a model served by ``pb_tensor.runtime`` they are off, so that model code fails here where
it would fail in Triton, unless the repository opts in (``ModelRepository(...,
pb_tensor_extras=True)``). The setting is process-wide (:func:`set_extras_default`, what a stub
process sets) with a per-context override (:func:`allow_extras`, what an in-process model's
calls use), as :mod:`pb_tensor.numpy_policy` does for BF16.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = [
    "allow_extras",
    "extras_allowed",
    "extras_context",
    "reset_extras_context",
    "set_extras_default",
]

_default = True
_here: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "pb_tensor_extras", default=None
)


def extras_allowed() -> bool:
    """Whether pb-tensor's additions to Triton's API are available in the current context."""
    value = _here.get()
    return _default if value is None else value


def set_extras_default(allowed: bool) -> bool:
    """Set the process-wide setting (True unless changed); returns the previous one."""
    global _default
    previous, _default = _default, bool(allowed)
    return previous


def extras_context(allowed: bool) -> contextvars.Token[bool | None]:
    """From now on, in this thread or asyncio task only, the additions follow ``allowed``
    whatever the process-wide setting; pass the token to :func:`reset_extras_context` to undo
    it."""
    return _here.set(bool(allowed))


def reset_extras_context(token: contextvars.Token[bool | None]) -> None:
    """Undo the :func:`extras_context` call that returned ``token``.

    Raises:
        ValueError: ``token`` was made in another context.
        RuntimeError: ``token`` was used already (Python's ``ContextVar.reset`` rules).
    """
    _here.reset(token)


@contextlib.contextmanager
def allow_extras(allowed: bool) -> Iterator[None]:
    """Within the block, in this thread or asyncio task only, the additions follow ``allowed``
    whatever the process-wide setting."""
    token = extras_context(allowed)
    try:
        yield
    finally:
        reset_extras_context(token)
