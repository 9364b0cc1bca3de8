"""``InferenceRequest`` (what ``execute`` receives and what BLS sends) and its small types."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from typing import Final, Literal, overload

from pb_tensor.errors import TritonModelException
from pb_tensor.tensor import Tensor
from pb_tensor.utils._backend import ModelBackend, get_backend
from pb_tensor.utils._params import ParameterValue, parameters_to_json
from pb_tensor.utils._request_args import (
    check_correlation_id,
    check_inputs,
    check_requested_names,
)
from pb_tensor.utils._response import (
    InferenceResponse,
    InferenceResponseSender,
    ResponseIterator,
    SenderSource,
    mark_final_sent,
)
from pb_tensor.utils._types import (
    INT64_MAX,
    INT64_MIN,
    NO_PREFERENCE,
    NO_TRACE,
    UINT32_MAX,
    UINT64_MAX,
    InferenceTrace,
    PreferredMemory,
    check_int,
)

__all__ = [
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "InferenceRequest",
    "SenderSource",
]

TRITONSERVER_REQUEST_RELEASE_ALL: Final = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: Final = 2

_LAZY_LOCK: Final = threading.Lock()


class _Delivered:
    """Stands in ``InferenceRequest._sender`` once the runtime delivered the response
    ``execute`` returned without a sender: one made later counts that response as sent."""

    __slots__ = ()


_DELIVERED: Final = _Delivered()


class InferenceRequest:
    """An inference request: what ``execute`` receives, and what a model builds for BLS.

    The constructor takes upstream's keywords (keyword-only here; upstream's pybind signature
    also accepted them positionally)::

        InferenceRequest(model_name=..., inputs=[...], requested_output_names=[...],
                         request_id="", correlation_id=0, model_version=-1, flags=0,
                         timeout=0, preferred_memory=PreferredMemory(...),
                         trace=InferenceTrace(), parameters=None)

    ``model_name`` may be ``bytes`` (UTF-8), as pybind11 lets it be in Triton; ``model_name()``
    returns a ``str``. ``timeout`` is in microseconds (0: none). ``parameters`` is a dict of
    ``str`` to ``bool``/``int``/``str``; ``parameters()`` returns it as JSON text.

    Raises:
        TypeError: an argument has the wrong type or is out of its C range (upstream's pybind
            signature refuses those, ``None`` included).
        TritonModelException: upstream's messages for a None input, an empty requested output
            name, a correlation id neither int nor str, or bad ``parameters``.
    """

    __slots__ = (
        "_cancelled",
        "_correlation_id",
        "_flags",
        "_index",
        "_inputs",
        "_model_name",
        "_model_version",
        "_parameters",
        "_preferred_memory",
        "_release_flags",
        "_request_id",
        "_requested_output_names",
        "_sender",
        "_source",
        "_timeout",
        "_trace",
    )

    def __init__(
        self,
        *,
        model_name: str | bytes,
        inputs: Sequence[Tensor],
        requested_output_names: Sequence[str],
        request_id: str = "",
        correlation_id: int | str = 0,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: PreferredMemory | None = None,
        trace: InferenceTrace | None = None,
        parameters: Mapping[str, ParameterValue] | None = None,
    ) -> None:
        if not isinstance(request_id, str):
            raise TypeError(
                f"InferenceRequest(): request_id must be a str, got {type(request_id).__name__}"
            )
        if isinstance(model_name, bytes):
            # pybind11's std::string takes bytes too: upstream's BLS example passes the name
            # straight from a BYTES input. Its str() comes back as UTF-8.
            try:
                model_name = model_name.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TypeError(
                    f"InferenceRequest(): model_name {model_name!r} is not UTF-8 ({exc.reason})"
                ) from None
        if not isinstance(model_name, str):
            raise TypeError(
                "InferenceRequest(): model_name must be a str or bytes, got "
                f"{type(model_name).__name__}"
            )
        if preferred_memory is None:
            preferred_memory = NO_PREFERENCE
        elif not isinstance(preferred_memory, PreferredMemory):
            raise TypeError(
                "InferenceRequest(): preferred_memory must be a PreferredMemory, got "
                f"{type(preferred_memory).__name__}"
            )
        if trace is None:
            trace = NO_TRACE
        elif not isinstance(trace, InferenceTrace):
            raise TypeError(
                f"InferenceRequest(): trace must be an InferenceTrace, got {type(trace).__name__}"
            )
        self._model_version = check_int(
            model_version, "InferenceRequest(): model_version", INT64_MIN, INT64_MAX
        )
        self._flags = check_int(flags, "InferenceRequest(): flags", 0, UINT32_MAX)
        self._timeout = check_int(timeout, "InferenceRequest(): timeout", 0, UINT64_MAX)
        self._parameters = parameters_to_json(parameters)
        self._correlation_id = check_correlation_id(correlation_id)
        self._inputs = check_inputs(inputs, request_id, model_name)
        self._requested_output_names = check_requested_names(
            requested_output_names, request_id, model_name
        )
        self._request_id = request_id
        self._model_name = model_name
        self._preferred_memory = preferred_memory
        self._trace = trace
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        # A plain flag: one attribute store is atomic, and an Event would cost more than the
        # rest of a request built for execute.
        self._cancelled = False
        # Made on first use: the runtime gives its requests a source of their own.
        self._sender: InferenceResponseSender | _Delivered | None = None
        self._source: SenderSource | None = None
        self._index = 0

    # -- accessors --------------------------------------------------------------------------

    def inputs(self) -> list[Tensor]:
        """The input tensors (a new list of the same tensors each call, as upstream's binding
        converts its vector)."""
        return list(self._inputs)

    def requested_output_names(self) -> set[str]:
        """The names of the outputs to compute (a new ``set`` each call, as upstream converts
        its ``std::set``)."""
        return set(self._requested_output_names)

    def request_id(self) -> str:
        """The request id ("" when none)."""
        return self._request_id

    def correlation_id(self) -> int | str:
        """The sequence correlation id: an int (0 when none) or a str."""
        return self._correlation_id

    def flags(self) -> int:
        """The request flags (``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START``/``_END`` bits)."""
        return self._flags

    def set_flags(self, flags: int) -> None:
        """Set the request flags (for a BLS request).

        Raises:
            TypeError: ``flags`` is not an int in the uint32 range.
        """
        self._flags = check_int(flags, "set_flags(): flags", 0, UINT32_MAX)

    def timeout(self) -> int:
        """The request timeout in microseconds (0: none)."""
        return self._timeout

    def parameters(self) -> str:
        """The request parameters as a JSON object text (``"{}"`` when none)."""
        return self._parameters

    def trace(self) -> InferenceTrace:
        """The request's trace."""
        return self._trace

    def model_name(self) -> str:
        """The model the request is for. Typed extra: upstream keeps it internal."""
        return self._model_name

    def model_version(self) -> int:
        """The model version the request asks for (-1: the latest). Typed extra."""
        return self._model_version

    def preferred_memory(self) -> PreferredMemory:
        """The BLS caller's preferred output memory. Typed extra."""
        return self._preferred_memory

    def is_cancelled(self) -> bool:
        """Whether the client cancelled this request; a model may stop work early."""
        if self._cancelled:
            return True
        sender = self._sender
        if type(sender) is InferenceResponseSender:
            return sender.is_cancelled()
        source = self._source
        return source is not None and bool(source.is_cancelled(self._index))

    def get_response_sender(self) -> InferenceResponseSender:
        """The sender that delivers this request's responses (decoupled models; a
        non-decoupled model may send exactly one response through it)."""
        sender = self._sender
        if type(sender) is InferenceResponseSender:
            return sender
        with _LAZY_LOCK:  # two threads asking at once must get the same sender
            sender = self._sender
            if type(sender) is InferenceResponseSender:
                return sender
            source = self._source
            if source is not None:
                made = source.make_sender(self._index, self._requested_output_names)
                if sender is _DELIVERED:
                    mark_final_sent(made)
            else:
                # A request the model builds (BLS) has a sender with no transaction
                # policy: upstream's sender then refuses to send (no reference to the
                # decoupled state).
                made = InferenceResponseSender(_refuse_send, self._is_flagged, decoupled=None)
            self._sender = made
        return made

    def _is_flagged(self) -> bool:
        return self._cancelled

    def set_release_flags(self, flags: int) -> None:
        """Tell the runtime how to release the request after ``execute``
        (``TRITONSERVER_REQUEST_RELEASE_ALL`` or ``..._RESCHEDULE``).

        Raises:
            TypeError: ``flags`` is not an int in the uint32 range.
        """
        self._release_flags = check_int(flags, "set_release_flags(): flags", 0, UINT32_MAX)

    # -- BLS ---------------------------------------------------------------------------------

    @overload
    def exec(self, decoupled: Literal[False] = False) -> InferenceResponse: ...

    @overload
    def exec(self, decoupled: Literal[True]) -> ResponseIterator: ...

    @overload
    def exec(self, decoupled: bool) -> InferenceResponse | ResponseIterator: ...

    def exec(self, decoupled: bool = False) -> InferenceResponse | ResponseIterator:
        """Run this request on ``model_name`` (BLS) and wait: one response, or with
        ``decoupled=True`` an iterator over the responses of a decoupled model.

        A failed inference comes back as a response whose ``has_error()`` is true, as in
        Triton; it does not raise.

        Raises:
            TypeError: ``decoupled`` is not a bool.
            TritonModelException: no runtime serves a model here, or the runtime's errors
                (BLS outside ``execute`` ...).
        """
        if not isinstance(decoupled, bool):
            raise TypeError(f"exec(): decoupled must be a bool, got {type(decoupled).__name__}")
        return _run(self, decoupled)

    @overload
    def async_exec(self, decoupled: Literal[False] = False) -> Awaitable[InferenceResponse]: ...

    @overload
    def async_exec(self, decoupled: Literal[True]) -> Awaitable[ResponseIterator]: ...

    @overload
    def async_exec(self, decoupled: bool) -> Awaitable[InferenceResponse | ResponseIterator]: ...

    def async_exec(
        self, decoupled: bool = False
    ) -> (
        Awaitable[InferenceResponse]
        | Awaitable[ResponseIterator]
        | Awaitable[InferenceResponse | ResponseIterator]
    ):
        """``exec`` for ``async def execute``: a future of the running event loop, resolved
        by running the request in the loop's default executor (as upstream does).

        Raises:
            TypeError: ``decoupled`` is not a bool.
            RuntimeError: no event loop is running in this thread (asyncio's error).
            TritonModelException: (when awaited) as :meth:`exec`.
        """
        if not isinstance(decoupled, bool):
            raise TypeError(
                f"async_exec(): decoupled must be a bool, got {type(decoupled).__name__}"
            )
        import asyncio  # here: asyncio costs more to import than the rest of pb_tensor.utils

        loop = asyncio.get_running_loop()
        # The executor thread does not inherit this context: resolve the backend here.
        backend = get_backend()

        def call() -> InferenceResponse | ResponseIterator:
            return _run(self, decoupled, backend)

        return loop.run_in_executor(None, call)

    def __repr__(self) -> str:
        names = [t.name() for t in self._inputs]
        return (
            f"InferenceRequest(model_name={self._model_name!r}, inputs={names!r}, "
            f"requested_output_names={sorted(self._requested_output_names)!r}, "
            f"request_id={self._request_id!r}, correlation_id={self._correlation_id!r}, "
            f"flags={self._flags})"
        )


def _refuse_send(response: InferenceResponse | None, flags: int) -> None:
    # Never reached (a sender without a transaction policy refuses first); kept honest anyway.
    raise TritonModelException(
        "Unable to send response. Response sender has no reference to the decoupled state of "
        "the model."
    )


def _run(
    request: InferenceRequest, decoupled: bool, backend: ModelBackend | None = None
) -> InferenceResponse | ResponseIterator:
    chosen = get_backend() if backend is None else backend
    timeout = request.timeout()
    result = chosen.exec_request(
        request, decoupled=decoupled, timeout_us=timeout if timeout else None
    )
    if decoupled:
        if isinstance(result, InferenceResponse | Iterator):
            responses = ResponseIterator(result)
            responses.wait_first()
            return responses
        raise TritonModelException(
            f"the runtime returned {type(result).__name__} for a decoupled BLS request"
        )
    if not isinstance(result, InferenceResponse):
        raise TritonModelException(
            f"the runtime returned {type(result).__name__} for a BLS request, not a response"
        )
    return result
