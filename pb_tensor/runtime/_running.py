"""The stub's record of a batch in flight: a decoupled ``async def execute`` leaves its batch
running on the model's event loop while the stub takes the next one, so cancellations and
final flags are kept per batch (by the runtime's batch id)."""

from __future__ import annotations

__all__ = ["RunningBatch"]


class RunningBatch:
    """A batch whose requests may still be answered: the cancellations the runtime sent for
    it, and which requests got their final flag (the stub forgets it once all did)."""

    __slots__ = ("cancelled", "pending")

    def __init__(self, size: int) -> None:
        self.cancelled: set[int] = set()
        self.pending = set(range(size))

    def finished(self, index: int) -> bool:
        """Request ``index`` got its final flag; True once every request did."""
        self.pending.discard(index)
        return not self.pending

    def all_finished(self) -> bool:
        """Whether every request got its final flag."""
        return not self.pending
