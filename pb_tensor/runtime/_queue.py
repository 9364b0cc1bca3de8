"""A queue policy's timeout (``ModelQueuePolicy``): how long a request may wait in the
dynamic batcher's queue, as core's ``PriorityQueue::PolicyQueue::Enqueue`` picks it. The
batcher (``_scheduling``) rejects a request whose timeout passed
(``timeout_action: REJECT``) with "Request timeout expired"."""

from __future__ import annotations

from dataclasses import dataclass

from pb_tensor.runtime._host import RequestData

__all__ = ["QueuePolicy"]


@dataclass(frozen=True)
class QueuePolicy:
    """The timeout part of a ``ModelQueuePolicy``."""

    default_timeout_us: int
    allow_timeout_override: bool

    def timeout_us(self, data: RequestData) -> int:
        """The request's queue timeout, as core's ``Enqueue`` picks it (0: none): the
        default, or the request's own when overriding is allowed and it is smaller than a
        non-zero default."""
        timeout = self.default_timeout_us
        if self.allow_timeout_override and 0 != data.timeout_us < timeout:
            timeout = data.timeout_us
        return timeout
