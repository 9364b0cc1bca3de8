"""The names the runtime uses from :mod:`pb_tensor.utils`, in one place: public names from
the package, runtime hooks from its seam module ``pb_tensor.utils._context``."""

from __future__ import annotations

from pb_tensor.utils import (
    TRITONSERVER_MEMORY_CPU,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
    InferenceRequest,
    InferenceResponse,
    ModelConfig,
    PreferredMemory,
    TritonError,
    TritonErrorCode,
)
from pb_tensor.utils._context import (
    BLS_OUTSIDE_EXECUTE_MESSAGE,
    InferenceResponseSender,
    ModelBackend,
    claim_direct_send,
    close_sender,
    created_senders,
    make_request,
    metric_snapshot,
    new_request,
    release_flags,
    sender_is_closed,
    set_backend,
    set_process_backend,
)

__all__ = [
    "BLS_OUTSIDE_EXECUTE_MESSAGE",
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "ModelBackend",
    "ModelConfig",
    "PreferredMemory",
    "TritonError",
    "TritonErrorCode",
    "claim_direct_send",
    "close_sender",
    "created_senders",
    "make_request",
    "metric_snapshot",
    "new_request",
    "release_flags",
    "sender_is_closed",
    "set_backend",
    "set_process_backend",
]
