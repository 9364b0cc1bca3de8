"""Exceptions raised by :mod:`pb_tensor`, matching ``triton_python_backend_utils``."""

from __future__ import annotations

__all__ = ["TritonBufferError", "TritonModelException"]


class TritonModelException(Exception):
    """What Triton's ``pb_utils.TritonModelException`` is: every error the C++ Tensor raises.

    Model code that catches ``pb_utils.TritonModelException`` catches this one when
    ``pb_tensor`` stands in for ``triton_python_backend_utils``.
    """


class TritonBufferError(TritonModelException, BufferError):
    """A DLPack refusal (a ``BufferError`` per the DLPack protocol) that is also a
    :class:`TritonModelException`, so both kinds of handler catch it."""
