"""``InferenceResponse``, the decoupled ``InferenceResponseSender`` and BLS's
``ResponseIterator``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Final, Protocol

from pb_tensor.errors import TritonModelException
from pb_tensor.tensor import Tensor
from pb_tensor.utils._errors import TritonError
from pb_tensor.utils._params import ParameterValue, parameters_to_json

__all__ = [
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "InferenceResponse",
    "InferenceResponseSender",
    "ResponseIterator",
    "SenderSource",
    "close_sender",
    "mark_final_sent",
    "prune_output_tensors",
    "responses_sent",
    "sender_is_closed",
]

TRITONSERVER_RESPONSE_COMPLETE_FINAL: Final = 1


def _check_tensors(tensors: object, what: str, empty_message: str) -> list[Tensor]:
    if isinstance(tensors, (list, tuple)):
        for t in tensors:
            if type(t) is not Tensor:
                break
        else:
            return list(tensors)  # the common case, without the ABC checks
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        raise TypeError(f"{what} must be a list of Tensor, got {type(tensors).__name__}")
    checked = list(tensors)
    for item in checked:
        if item is None:
            raise TritonModelException(empty_message)
        if not isinstance(item, Tensor):
            raise TypeError(f"{what} must be a list of Tensor, found {type(item).__name__}")
    return checked


class InferenceResponse:
    """A model's answer to one request: output tensors, or an error, plus parameters.

    ``InferenceResponse(output_tensors=[], error=None, parameters=None)`` as upstream.

    Raises:
        TypeError: ``output_tensors`` is not a sequence of ``Tensor`` or ``error`` is not a
            ``TritonError``.
        TritonModelException: an output tensor is None, or ``parameters`` breaks upstream's
            rules (not a dict; a non-``str`` key; a value not ``bool``/``int``/``str``).
    """

    __slots__ = ("_error", "_output_tensors", "_parameters")

    def __init__(
        self,
        output_tensors: Sequence[Tensor] = (),
        error: TritonError | None = None,
        parameters: Mapping[str, ParameterValue] | None = None,
    ) -> None:
        tensors = _check_tensors(
            output_tensors,
            "InferenceResponse(): output_tensors",
            "Output tensor for inference response should not be empty.",
        )
        if error is not None and not isinstance(error, TritonError):
            raise TypeError(
                "InferenceResponse(): error must be a TritonError or None, "
                f"got {type(error).__name__}"
            )
        self._parameters = parameters_to_json(parameters)
        self._output_tensors = tensors
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        """The output tensors (a new list each call, as upstream's binding returns)."""
        return list(self._output_tensors)

    def has_error(self) -> bool:
        """Whether the response carries an error."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The response's error, or None."""
        return self._error

    def parameters(self) -> str:
        """The response parameters as a JSON object text (``"{}"`` when none)."""
        return self._parameters

    def __repr__(self) -> str:
        names = [t.name() for t in self._output_tensors]
        return f"InferenceResponse(output_tensors={names!r}, error={self._error!r})"


def prune_output_tensors(
    response: InferenceResponse, requested_output_names: Collection[str]
) -> None:
    """Drop the outputs that were not requested (upstream's ``PruneOutputTensors``)."""
    tensors = response._output_tensors
    for t in tensors:
        if t.name() not in requested_output_names:
            response._output_tensors = [t for t in tensors if t.name() in requested_output_names]
            return
    # Every output was requested (the usual case): the response's own list stays.


class InferenceResponseSender:
    """Sends responses for one request (``request.get_response_sender()``).

    The runtime constructs it: ``send`` delivers a response (or None with the final flag) and
    ``is_cancelled`` says whether the client cancelled the request. ``decoupled`` is the
    model's transaction policy, or None when unknown (a sender of a request the model built
    itself for BLS, which upstream refuses to use). When ``requested_output_names`` is given,
    outputs not in it are dropped before sending, as upstream does. ``on_drop`` runs when the
    sender is garbage collected before it was closed (upstream's stub then deletes the
    request's response factory); it may run in any thread, inside the garbage collector, so
    it must only hand the news on (a ``queue.SimpleQueue.put``).
    """

    __slots__ = (
        "_closed",
        "_decoupled",
        "_is_cancelled",
        "_lock",
        "_on_drop",
        "_requested",
        "_send",
        "_sent",
    )

    def __init__(
        self,
        send: Callable[[InferenceResponse | None, int], None],
        is_cancelled: Callable[[], bool],
        *,
        decoupled: bool | None,
        requested_output_names: Collection[str] | None = None,
        on_drop: Callable[[], None] | None = None,
    ) -> None:
        self._send = send
        self._is_cancelled = is_cancelled
        self._decoupled = decoupled
        self._requested = (
            None if requested_output_names is None else frozenset(requested_output_names)
        )
        self._lock = threading.Lock()
        self._closed = False
        self._sent = 0
        self._on_drop = on_drop  # last: __del__ reads the other slots once it is set

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send ``response``; ``flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL`` closes the sender.

        Raises:
            TypeError: ``response`` is not an ``InferenceResponse`` or None, or ``flags`` is
                not an int.
            TritonModelException: with upstream's message for an unsupported flag, a missing
                response without the final flag, a second response or a final flag before
                any response from a non-decoupled model, a closed sender, a sender without a
                known transaction policy, or a failure the runtime reports while sending.
        """
        if response is not None and not isinstance(response, InferenceResponse):
            raise TypeError(
                "send(): response must be an InferenceResponse or None, "
                f"got {type(response).__name__}"
            )
        if isinstance(flags, bool) or not isinstance(flags, int):
            raise TypeError(f"send(): flags must be an int, got {type(flags).__name__}")
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero."
            )
        self._update_state(response, flags)
        if response is not None and self._requested is not None:
            prune_output_tensors(response, self._requested)
        self._send(response, flags)

    def _update_state(self, response: InferenceResponse | None, flags: int) -> None:
        if self._decoupled is None:
            raise TritonModelException(
                "Unable to send response. Response sender has no reference to the decoupled "
                "state of the model."
            )
        with self._lock:
            if not self._decoupled:
                if response is not None and self._sent > 0:
                    raise TritonModelException(
                        "Unable to send response. Non-decoupled model cannot send more than "
                        "one response."
                    )
                if (
                    response is None
                    and flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
                    and self._sent == 0
                ):
                    raise TritonModelException(
                        "Unable to send response. Non-decoupled model cannot send complete "
                        "final before sending a response."
                    )
            if self._closed:
                raise TritonModelException(
                    "Unable to send response. Response sender has been closed."
                )
            if flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self._closed = True
            self._sent += 1

    def is_cancelled(self) -> bool:
        """Whether the request was cancelled (the client gave up); models may stop early."""
        return bool(self._is_cancelled())

    def __del__(self) -> None:
        # getattr: a constructor that raised leaves it unset.
        on_drop = getattr(self, "_on_drop", None)
        if on_drop is not None and not self._closed:
            on_drop()

    def __repr__(self) -> str:
        return (
            f"InferenceResponseSender(decoupled={self._decoupled!r}, sent={self._sent}, "
            f"closed={self._closed})"
        )


class SenderSource(Protocol):
    """Where the requests the runtime builds get their response senders, on first use: a
    non-decoupled model rarely asks for one, so none is made until it does."""

    def make_sender(
        self, index: int, requested_output_names: Collection[str]
    ) -> InferenceResponseSender:
        """The sender of request ``index`` of the batch (closed once the batch is over)."""
        ...

    def is_cancelled(self, index: int) -> bool:
        """Whether the client cancelled request ``index`` of the batch."""
        ...


def close_sender(sender: InferenceResponseSender) -> None:
    """Close ``sender`` without sending (upstream's ``ResponseSender::Close``: the runtime
    does it once a request is done, so later sends fail with Triton's error)."""
    with sender._lock:
        sender._closed = True


def mark_final_sent(sender: InferenceResponseSender) -> None:
    """Count one response with the final flag as sent through ``sender`` (the runtime
    delivered the response ``execute`` returned before the model asked for its sender)."""
    with sender._lock:
        sender._sent += 1
        sender._closed = True


def sender_is_closed(sender: InferenceResponseSender) -> bool:
    """Whether ``sender`` sent the final flag or was closed."""
    with sender._lock:
        return sender._closed


def responses_sent(sender: InferenceResponseSender) -> int:
    """How many ``send`` calls went through (the final flag alone counts, as upstream)."""
    with sender._lock:
        return sender._sent


class ResponseIterator:
    """The responses of a decoupled BLS call (``request.exec(decoupled=True)``).

    Iterating again after the last response replays the responses from the start, as
    upstream's iterator does. ``cancel()`` asks the runtime to cancel the BLS request.
    """

    __slots__ = ("_ahead", "_cancel", "_finished", "_idx", "_responses", "_source")

    def __init__(
        self,
        responses: Iterable[InferenceResponse] | InferenceResponse,
        cancel: Callable[[], None] | None = None,
    ) -> None:
        source: Iterable[InferenceResponse] = (
            (responses,) if isinstance(responses, InferenceResponse) else responses
        )
        self._source: Iterator[InferenceResponse] = iter(source)
        if cancel is None:
            found = getattr(responses, "cancel", None)
            cancel = found if callable(found) else None
        self._cancel = cancel
        self._responses: list[InferenceResponse] = []
        self._finished = False
        self._idx = 0
        self._ahead: InferenceResponse | None = None

    def wait_first(self) -> None:
        """Wait for the first response (or the end), as upstream's ``exec(decoupled=True)``
        returns once the first response arrived (``async_exec`` too, in its executor
        thread): iterating in a coroutine then blocks the event loop only for the later
        responses."""
        if self._finished or self._ahead is not None or self._responses:
            return
        try:
            self._ahead = next(self._source)
        except StopIteration:
            self._finished = True

    def __iter__(self) -> ResponseIterator:
        if self._finished and self._idx >= len(self._responses):
            self._idx = 0
        return self

    def __next__(self) -> InferenceResponse:
        if self._finished:
            if self._idx < len(self._responses):
                self._idx += 1
                return self._responses[self._idx - 1]
            raise StopIteration("Iteration is done for the responses.")
        if self._ahead is not None:
            response, self._ahead = self._ahead, None
            self._responses.append(response)
            return response
        try:
            response = next(self._source)
        except StopIteration:
            self._finished = True
            self._idx = len(self._responses)
            raise StopIteration("Iteration is done for the responses.") from None
        self._responses.append(response)
        return response

    def cancel(self) -> None:
        """Cancel the BLS request (a no-op once every response arrived)."""
        if self._cancel is not None and not self._finished:
            self._cancel()
