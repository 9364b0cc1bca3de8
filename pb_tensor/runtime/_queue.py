"""The part of Triton's queue policy a runtime without a scheduler honours: a request whose
queue timeout passed while it waited for the instance is rejected, as the dynamic batcher's
``default_queue_policy { timeout_action: REJECT }`` rejects it (core's
``PriorityQueue::PolicyQueue``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pb_tensor.runtime._errors import InferenceError
from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._seam import TritonError
from pb_tensor.runtime._tracker import FINAL, Reply

__all__ = ["QueuePolicy", "queue_policy"]


@dataclass(frozen=True)
class QueuePolicy:
    """``dynamic_batching.default_queue_policy`` with ``timeout_action: REJECT``."""

    default_timeout_us: int
    allow_timeout_override: bool

    def timeout_us(self, data: RequestData) -> int:
        """The request's queue timeout, as core's ``Enqueue`` picks it (0: none)."""
        timeout = self.default_timeout_us
        if self.allow_timeout_override and 0 != data.timeout_us < timeout:
            timeout = data.timeout_us
        return timeout

    def reject_expired(
        self, valid: list[RequestData], where: list[int], arrival: float
    ) -> tuple[list[RequestData], list[int], list[Reply]]:
        """Split off the requests whose timeout passed since ``arrival``
        (``time.monotonic()``): the rest, their batch indexes, and the rejections."""
        waited_us = (time.monotonic() - arrival) * 1e6
        kept: list[RequestData] = []
        kept_where: list[int] = []
        rejected: list[Reply] = []
        for data, index in zip(valid, where):
            timeout = self.timeout_us(data)
            if timeout and waited_us > timeout:
                error = InferenceError("Request timeout expired", TritonError.UNAVAILABLE)
                rejected.append(Reply(index, [], error, "{}", FINAL, False))
            else:
                kept.append(data)
                kept_where.append(index)
        return kept, kept_where, rejected


def queue_policy(config: dict[str, Any]) -> QueuePolicy | None:
    """The policy of a configuration (JSON form) whose expired requests are rejected; None
    when none are (no dynamic batcher, ``timeout_action: DELAY``, no timeout)."""
    batching = config.get("dynamic_batching")
    if not isinstance(batching, dict):
        return None
    policy = batching.get("default_queue_policy") or {}
    if policy.get("timeout_action", "REJECT") != "REJECT":
        return None
    default = int(policy.get("default_timeout_microseconds", 0) or 0)
    if default == 0:
        return None  # core: an override applies only below a non-zero default
    return QueuePolicy(default, bool(policy.get("allow_timeout_override", False)))
