"""A stub's side of BLS: the responses a model's ``exec``/``async_exec`` gets, and the
``cancel()`` of a decoupled BLS request's iterator."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator

from pb_tensor import Tensor
from pb_tensor.errors import TritonModelException
from pb_tensor.runtime._channel import ChannelClosed
from pb_tensor.runtime._placement import place
from pb_tensor.runtime._seam import (
    InferenceResponse,
    PreferredMemory,
    TritonError,
    TritonErrorCode,
)

__all__ = ["BlsStream", "bls_response"]


class BlsStream(Iterator[InferenceResponse]):
    """A BLS request's responses, with the ``cancel()`` that ``ResponseIterator.cancel()``
    calls: it asks the runtime to cancel the request in the called model."""

    __slots__ = ("_cancel", "_responses")

    def __init__(
        self, responses: Iterator[InferenceResponse], cancel: Callable[[], None]
    ) -> None:
        self._responses = responses
        self._cancel = cancel

    def __iter__(self) -> BlsStream:
        return self

    def __next__(self) -> InferenceResponse:
        return next(self._responses)

    def cancel(self) -> None:
        with contextlib.suppress(ChannelClosed):
            self._cancel()


def bls_response(
    tensors: list[Tensor], error: tuple[str, int] | None, parameters: str,
    preferred: PreferredMemory,
) -> InferenceResponse:
    """A BLS response as the model sees it: its tensors placed where the request prefers
    them (a placement that fails becomes the response's error)."""
    params = json.loads(parameters) if parameters else None
    if tensors:
        # Onto a GPU when the caller prefers one: a copy inside this process.
        try:
            tensors = place(tensors, preferred)
        except TritonModelException as exc:
            return InferenceResponse(error=TritonError(str(exc)), parameters=params or None)
    return InferenceResponse(
        output_tensors=tensors,
        error=None if error is None else TritonError(error[0], TritonErrorCode(error[1])),
        parameters=params or None,
    )
