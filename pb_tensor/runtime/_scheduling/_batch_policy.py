"""The configuration of Triton's dynamic batcher (the ``dynamic_batching`` section with
``max_batch_size``, as core's ``dynamic_batch_scheduler.cc`` and ``scheduler_utils.cc`` read
it): batch sizes, the queue delay, priority levels and their queue policies, and the inputs
whose shapes must match within a batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._queue import QueuePolicy

__all__ = ["BatchPolicy", "LevelPolicy", "batch_policy", "one_at_a_time"]


@dataclass(frozen=True)
class LevelPolicy:
    """``ModelQueuePolicy`` of one priority level."""

    timeout_us: int
    allow_override: bool
    reject: bool
    max_queue_size: int

    def deadline_ns(self, data: RequestData, start_ns: int) -> int:
        """When ``data`` times out in the queue (0: never), as core's ``Enqueue`` picks its
        timeout (:class:`QueuePolicy`)."""
        if not self.timeout_us:  # no default timeout: no request's own applies either
            return 0
        timeout = QueuePolicy(self.timeout_us, self.allow_override).timeout_us(data)
        return start_ns + timeout * 1000 if timeout else 0


@dataclass(frozen=True)
class BatchPolicy:
    """What the ``dynamic_batching`` section of a configuration asks for."""

    max_batch_size: int  # at least 1 (a model that cannot batch runs batches of one)
    batching: bool  # max_batch_size > 0: a request's batch size is its first dimension
    preferred: frozenset[int]
    max_preferred: int
    delay_ns: int
    default_level: int  # 1-based; levels are 1..len(levels)
    levels: tuple[LevelPolicy, ...]
    equal_shape: frozenset[str]
    optional_inputs: bool

    def level_of(self, priority: int) -> int:
        """The 0-based queue index of a request's priority (0 or too high: the default)."""
        if priority <= 0 or priority > len(self.levels):
            return self.default_level - 1
        return priority - 1


def _level(policy: dict[str, Any]) -> LevelPolicy:
    return LevelPolicy(
        timeout_us=int(policy.get("default_timeout_microseconds", 0) or 0),
        allow_override=bool(policy.get("allow_timeout_override", False)),
        reject=policy.get("timeout_action", "REJECT") != "DELAY",
        max_queue_size=int(policy.get("max_queue_size", 0) or 0),
    )


def batch_policy(config: dict[str, Any]) -> BatchPolicy | None:
    """The batcher's policy for a completed configuration (JSON form); None without
    ``dynamic_batching`` (each request then runs alone, as in Triton)."""
    batching = config.get("dynamic_batching")
    if not isinstance(batching, dict):
        return None
    max_batch_size = int(config.get("max_batch_size", 0) or 0)
    preferred = frozenset(int(s) for s in batching.get("preferred_batch_size", ()) or ())
    size = max(1, max_batch_size)
    default = _level(batching.get("default_queue_policy") or {})
    count = int(batching.get("priority_levels", 0) or 0)
    per_level = {int(k): _level(v) for k, v in
                 (batching.get("priority_queue_policy") or {}).items()}  # fmt: skip
    levels = tuple(per_level.get(i, default) for i in range(1, max(count, 1) + 1))
    equal: set[str] = set()
    optional = False
    for io in config.get("input", ()):
        dims = [int(d) for d in io.get("dims", ())]
        if io.get("optional"):
            optional = True
        if io.get("is_shape_tensor") or (-1 in dims and not io.get("allow_ragged_batch")):
            equal.add(str(io["name"]))
    return BatchPolicy(
        max_batch_size=size,
        batching=max_batch_size > 0,
        preferred=preferred,
        max_preferred=max(preferred) if preferred else size,
        delay_ns=int(batching.get("max_queue_delay_microseconds", 0) or 0) * 1000,
        default_level=int(batching.get("default_priority_level", 0) or 0) if count else 1,
        levels=levels,
        equal_shape=frozenset(equal),
        optional_inputs=optional,
    )


def one_at_a_time(config: dict[str, Any]) -> BatchPolicy:
    """Triton's default scheduler as a batcher's policy (a model without
    ``dynamic_batching``): one queue, no delay, no queue policy, and every batch one request
    whatever its size."""
    return BatchPolicy(
        max_batch_size=1,
        batching=int(config.get("max_batch_size", 0) or 0) > 0,
        preferred=frozenset(),
        max_preferred=1,
        delay_ns=0,
        default_level=1,
        levels=(LevelPolicy(timeout_us=0, allow_override=False, reject=True, max_queue_size=0),),
        equal_shape=frozenset(),
        optional_inputs=False,
    )
