"""``TritonError`` (an error value carried by a response) and its status codes."""

from __future__ import annotations

import enum
from typing import ClassVar

from pb_tensor.errors import TritonModelException
from pb_tensor.extras_policy import extras_allowed

__all__ = ["TritonError", "TritonErrorCode", "TritonModelException"]


class TritonErrorCode(enum.IntEnum):
    """``TRITONSERVER_Error_Code`` (values as in C); upstream's ``TritonError.__ErrorCode``."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __str__(self) -> str:
        return self.name


class TritonError:
    """An error a model puts into an ``InferenceResponse`` (not an exception, as upstream).

    ``TritonError(message, code=TritonError.INTERNAL)``; the codes are class attributes
    (``TritonError.NOT_FOUND`` ...) as in Triton.

    Raises:
        TypeError: ``message`` is not a ``str`` or ``code`` is not a code (upstream's pybind
            signature refuses both, ``None`` included).
    """

    UNKNOWN: ClassVar[TritonErrorCode] = TritonErrorCode.UNKNOWN
    INTERNAL: ClassVar[TritonErrorCode] = TritonErrorCode.INTERNAL
    NOT_FOUND: ClassVar[TritonErrorCode] = TritonErrorCode.NOT_FOUND
    INVALID_ARG: ClassVar[TritonErrorCode] = TritonErrorCode.INVALID_ARG
    UNAVAILABLE: ClassVar[TritonErrorCode] = TritonErrorCode.UNAVAILABLE
    UNSUPPORTED: ClassVar[TritonErrorCode] = TritonErrorCode.UNSUPPORTED
    ALREADY_EXISTS: ClassVar[TritonErrorCode] = TritonErrorCode.ALREADY_EXISTS
    CANCELLED: ClassVar[TritonErrorCode] = TritonErrorCode.CANCELLED

    __slots__ = ("_code", "_message")

    def __init__(
        self, message: str, code: TritonErrorCode | int = TritonErrorCode.INTERNAL
    ) -> None:
        if not isinstance(message, str):
            raise TypeError(f"TritonError(): message must be a str, got {type(message).__name__}")
        if type(code) is int and not extras_allowed():
            raise TypeError(
                "TritonError(): incompatible constructor arguments: code must be a "
                f"TritonError code such as TritonError.INTERNAL, got int {code!r} (Triton "
                "refuses plain ints; ModelRepository(..., pb_tensor_extras=True) accepts them)"
            )
        if isinstance(code, bool) or not isinstance(code, int):
            raise TypeError(
                f"TritonError(): code must be a TritonError code, got {type(code).__name__}"
            )
        try:
            checked = TritonErrorCode(code)
        except ValueError:
            raise TypeError(
                f"TritonError(): {code=!r} is not a TritonError code (0 to 7)"
            ) from None
        self._message = message
        self._code = checked

    def message(self) -> str:
        """The error message."""
        return self._message

    def code(self) -> TritonErrorCode:
        """The status code (``TritonError.INTERNAL`` unless given)."""
        return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code=TritonError.{self._code.name})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TritonError):
            return NotImplemented
        return (self._message, self._code) == (other._message, other._code)

    def __hash__(self) -> int:
        return hash((self._message, self._code))


# Upstream's pybind enum is nested as ``TritonError.__ErrorCode``; a class body would mangle the
# name, so it is attached afterwards (reachable as ``TritonError.__ErrorCode`` outside classes).
setattr(TritonError, "__ErrorCode", TritonErrorCode)
