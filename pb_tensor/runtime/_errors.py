"""Exceptions of :mod:`pb_tensor.runtime`."""

from __future__ import annotations

from pb_tensor.errors import TritonModelException
from pb_tensor.runtime._seam import TritonError, TritonErrorCode

__all__ = [
    "InferenceError",
    "ModelLoadError",
    "RequestRefused",
    "ResponseSenderDropped",
    "VersionNotServed",
    "model_control_error",
]


class InferenceError(TritonModelException):
    """A request failed: invalid for the model's configuration, answered with an error
    response, or the model raised, crashed or timed out.

    ``message()`` is Triton's text, ``code()`` the ``TritonError`` status code (an
    ``IntEnum``: ``TritonError.INVALID_ARG`` ...).
    """

    def __init__(self, message: str, code: int = TritonError.INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        if type(code) is int and 0 <= code <= max(TritonErrorCode):
            # The runtime's own int codes (plain ints are refused inside models, as in Triton).
            code = TritonErrorCode(code)
        self._code = TritonError(message, code).code()

    def message(self) -> str:
        """Triton's error message."""
        return self._message

    def code(self) -> int:
        """The status code, one of the ``TritonError`` codes."""
        return self._code

    def __reduce__(self) -> tuple[type[InferenceError], tuple[str, int]]:
        return (type(self), (self._message, int(self._code)))


class RequestRefused(InferenceError):
    """A request refused before it reached an instance: invalid for the model's
    configuration, a full queue, a sequence that did not start, a model that is not loaded.

    Triton returns these from ``TRITONSERVER_ServerInferAsync`` itself, not in a response;
    its front doors tell the two apart (a gRPC stream's error for a refused request carries
    only the request's id, and a ``triton_grpc_error`` stream stays open after it).
    """


class ResponseSenderDropped(InferenceError):
    """The model let go of a request's response sender (it was garbage collected) without
    sending the final flag.

    Triton's stub deletes the request's response factory then: the client gets no further
    response and no final flag, and waits; the runtime ends the request with this error
    instead (``pb-tensor serve`` sends such a client nothing, as Triton does).
    """


class ModelLoadError(TritonModelException):
    """A model could not be loaded: a missing or malformed ``config.pbtxt``, a missing
    ``model.py``, no ``TritonPythonModel`` class, or ``auto_complete_config`` /
    ``initialize`` raised. The message names the model, the file and Triton's message.

    ``version`` and ``reason`` are set when a version failed as it was created (core's
    ``ModelLifeCycle``): the version, and its state reason as core records it (the status
    code's name and Triton's message: ``Internal: ValueError: ...``); None otherwise.
    """

    def __init__(self, message: str, *, version: int | None = None,
                 reason: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.version = version
        self.reason = reason

    def core_status(self) -> str:
        """The message of core's load status for this failure: ``version N is at
        UNAVAILABLE state: <reason>;`` for a version that failed as it was created (what a
        Triton client's load request reports after ``load failed for model 'm': ``), else
        the message."""
        if self.version is None or self.reason is None:
            return str(self)
        return f"version {self.version} is at UNAVAILABLE state: {self.reason};"


class VersionNotServed(ModelLoadError):
    """The server a repository serves in does not serve the version of a model an ensemble's
    step names (the ensemble fails to load, as in Triton)."""


# What upstream's stub puts before a failed model-control call's message (pb_utils.load_model
# and co.: ModelLoader's Send*Request and Stub::SendMessage).
_CONTROL_PREFIX = {
    "load_model": "Failed to load model: ",
    "unload_model": "Failed to unload model: ",
    "is_model_ready": "Failed to check model readiness: ",
}


def model_control_error(kind: str, instance_name: str, message: str) -> str:
    """The text of the ``TritonModelException`` a model's failed ``pb_utils.load_model`` /
    ``unload_model`` / ``is_model_ready`` call raises in Triton (``kind``: the call;
    ``instance_name``: the calling model instance; ``message``: the server's error)."""
    prefix = _CONTROL_PREFIX.get(kind, "")
    return (f"{prefix}Failed to process the request for model '{instance_name}', "
            f"message: {message}")  # fmt: skip
