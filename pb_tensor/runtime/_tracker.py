"""When a batch is finished: :class:`Reply` (one response, or the flags-only final one) and
:class:`Tracker` (Triton's rules for ending each request of a batch), shared by both engines
and the model that drives them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pb_tensor import Tensor
from pb_tensor.runtime._errors import InferenceError
from pb_tensor.runtime._seam import TritonError

__all__ = ["FINAL", "Reply", "Tracker"]

FINAL = 1


@dataclass(slots=True)
class Reply:
    """One response to request ``index`` of a batch (or the flags-only final one)."""

    index: int
    tensors: list[Tensor]
    error: InferenceError | None
    parameters: str
    flags: int
    has_response: bool


class Tracker:
    """Finishes a batch as Triton does: each request ends with its final flag; requests of a
    failed ``execute`` end with its error; a non-decoupled request that got no response ends
    when ``execute`` returns."""

    __slots__ = ("decoupled", "instance_name", "pending", "returned")

    def __init__(self, size: int, decoupled: bool, instance_name: str) -> None:
        self.decoupled = decoupled
        self.instance_name = instance_name
        self.pending = set(range(size))
        self.returned = False

    @property
    def finished(self) -> bool:
        return self.returned and not self.pending

    def reply(self, r: Reply) -> list[Reply]:
        if r.index not in self.pending:
            return []  # after a batch error, or a second final: nobody is waiting for it
        if r.flags & FINAL:
            self.pending.discard(r.index)
        return [r] if (r.has_response or r.error is not None or r.flags & FINAL) else []

    def done(self, error: str | None) -> list[Reply]:
        self.returned = True
        if not self.pending:
            return []
        if error is not None:
            return self.fail(InferenceError(error, TritonError.INTERNAL))
        if self.decoupled:
            return []
        return self.fail(
            InferenceError(
                f"Failed to process the request(s) for model '{self.instance_name}', message: "
                "the model neither returned nor sent a response for the request",
                TritonError.INTERNAL,
            )
        )

    def fail(self, error: InferenceError) -> list[Reply]:
        out = [Reply(i, [], error, "{}", FINAL, False) for i in sorted(self.pending)]
        self.pending.clear()
        self.returned = True
        return out
