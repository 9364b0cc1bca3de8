"""The front door's error: Triton's error code and message, mapped to HTTP and gRPC statuses."""

from __future__ import annotations

__all__ = [
    "ALREADY_EXISTS",
    "CANCELLED",
    "INTERNAL",
    "INVALID_ARG",
    "METHOD_NOT_ALLOWED",
    "NOT_FOUND",
    "UNAVAILABLE",
    "UNKNOWN",
    "UNSUPPORTED",
    "ServeError",
    "http_status",
]

# TRITONSERVER_Error_Code values (as pb_utils.TritonError's codes).
UNKNOWN = 0
INTERNAL = 1
NOT_FOUND = 2
INVALID_ARG = 3
UNAVAILABLE = 4
UNSUPPORTED = 5
ALREADY_EXISTS = 6
CANCELLED = 7
# Not a Triton error code: the front end's own 405 answer.
METHOD_NOT_ALLOWED = -1

# Triton's HttpCodeFromError (server/src/http_server.cc).
_HTTP = {INTERNAL: 500, NOT_FOUND: 404, UNAVAILABLE: 503, UNSUPPORTED: 501, METHOD_NOT_ALLOWED: 405}


def http_status(code: int) -> int:
    """The HTTP status Triton answers an error of ``code`` with (400 for the rest)."""
    return _HTTP.get(code, 400)


class ServeError(Exception):
    """A request the front door refuses: Triton's error ``code`` and message text.

    ``refused``: the runtime refused the inference request when it was submitted (its
    ``RequestRefused``), where Triton's ``TRITONSERVER_ServerInferAsync`` fails; False for an
    error the request met once it ran.
    """

    def __init__(self, message: str, code: int = INVALID_ARG, *, refused: bool = False
                 ) -> None:  # fmt: skip
        super().__init__(message)
        self.message = message
        self.code = code
        self.refused = refused
