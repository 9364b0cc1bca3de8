"""The names the runtime uses from :mod:`pb_tensor.utils`, in one place: public names from
the package, runtime hooks from its seam module ``pb_tensor.utils._context``."""

from __future__ import annotations

from pb_tensor.utils import (
    InferenceRequest,
    InferenceResponse,
    ModelConfig,
    TritonError,
    TritonErrorCode,
)
from pb_tensor.utils._context import (
    LOGGER_NAME,
    InferenceResponseSender,
    ModelBackend,
    cancel_request,
    close_sender,
    make_request,
    metric_snapshot,
    sender_is_closed,
    set_backend,
    set_process_backend,
)

__all__ = [
    "LOGGER_NAME",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "ModelBackend",
    "ModelConfig",
    "TritonError",
    "TritonErrorCode",
    "cancel_request",
    "close_sender",
    "make_request",
    "metric_snapshot",
    "sender_is_closed",
    "set_backend",
    "set_process_backend",
]
