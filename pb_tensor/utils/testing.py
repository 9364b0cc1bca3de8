"""Helpers for unit-testing model code without ``pb_tensor.runtime``.

Triton builds the requests ``execute`` receives; in a unit test, :func:`make_request` does
(with an :class:`~pb_tensor.utils.InferenceResponseSender` recording what a decoupled model
sends), :func:`cancel_request` plays the client that gives up, and :func:`metric_snapshot`
reads the custom metrics a model recorded. The runtime uses the same functions.
"""

from __future__ import annotations

from pb_tensor.utils._metrics import metric_snapshot, reset_metrics
from pb_tensor.utils._request_runtime import cancel_request, make_request, release_flags
from pb_tensor.utils._response import InferenceResponseSender, responses_sent, sender_is_closed

__all__ = [
    "InferenceResponseSender",
    "cancel_request",
    "make_request",
    "metric_snapshot",
    "release_flags",
    "reset_metrics",
    "responses_sent",
    "sender_is_closed",
]
