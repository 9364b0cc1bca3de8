"""The seam between ``pb_tensor.utils`` and the runtime that serves models.

Everything the runtime needs beyond the public ``pb_utils`` surface, under public names:

* :class:`ModelBackend`, :func:`set_backend` (per context), :func:`set_process_backend`
  (process-wide fallback), :func:`get_backend`: where BLS and model control go;
* :func:`make_request` and :func:`new_request` (the requests ``execute`` receives, the
  latter with senders made on first use from a :class:`SenderSource`),
  :func:`claim_direct_send`, :func:`created_senders`, :func:`cancel_request`,
  :func:`release_flags`;
* :class:`InferenceResponseSender` construction, :func:`close_sender`,
  :func:`sender_is_closed`, :func:`responses_sent`, :func:`prune_output_tensors`;
* :func:`metric_snapshot` / :func:`reset_metrics`; :data:`LOGGER_NAME`.

Model code never needs this module.
"""

from __future__ import annotations

from pb_tensor.utils._backend import (
    BLS_OUTSIDE_EXECUTE_MESSAGE,
    NO_BACKEND_MESSAGE,
    ModelBackend,
    get_backend,
    get_backend_or_none,
    set_backend,
    set_process_backend,
)
from pb_tensor.utils._logger import LOGGER_NAME, model_logger
from pb_tensor.utils._metrics import metric_snapshot, reset_metrics
from pb_tensor.utils._params import parameters_to_json
from pb_tensor.utils._request import SenderSource
from pb_tensor.utils._request_runtime import (
    cancel_request,
    claim_direct_send,
    created_senders,
    make_request,
    new_request,
    release_flags,
)
from pb_tensor.utils._response import (
    InferenceResponseSender,
    close_sender,
    prune_output_tensors,
    responses_sent,
    sender_is_closed,
)

__all__ = [
    "BLS_OUTSIDE_EXECUTE_MESSAGE",
    "LOGGER_NAME",
    "NO_BACKEND_MESSAGE",
    "InferenceResponseSender",
    "ModelBackend",
    "SenderSource",
    "cancel_request",
    "claim_direct_send",
    "close_sender",
    "created_senders",
    "get_backend",
    "get_backend_or_none",
    "make_request",
    "metric_snapshot",
    "model_logger",
    "new_request",
    "parameters_to_json",
    "prune_output_tensors",
    "release_flags",
    "reset_metrics",
    "responses_sent",
    "sender_is_closed",
    "set_backend",
    "set_process_backend",
]
