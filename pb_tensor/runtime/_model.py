"""``LoadedModel``: one loaded model version and the calls that run requests on it."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pb_tensor import Tensor, TritonDtype, triton_to_numpy_type
from pb_tensor.runtime._bls import StubBls
from pb_tensor.runtime._calls import InferFuture, ResponseStream, start, stream_outputs
from pb_tensor.runtime._engines import Engine, StubEngine
from pb_tensor.runtime._errors import InferenceError
from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._inprocess import InProcessEngine
from pb_tensor.runtime._placement import gpu_refusal
from pb_tensor.runtime._queue import queue_policy
from pb_tensor.runtime._seam import (
    InferenceRequest,
    TritonError,
)
from pb_tensor.runtime._tracker import (
    FINAL,
    Cancellation,
    Reply,
    acts_for,
    cancelled_error,
)
from pb_tensor.runtime._validate import ModelSpec, array_tensors, validate_request
from pb_tensor.runtime._values import InputValue, Outputs, ParameterValue, outputs_of, to_tensor

if TYPE_CHECKING:
    from types import TracebackType

    from pb_tensor.runtime._repository import ModelRepository

__all__ = ["LoadedModel"]


def _cancelled(where: list[int]) -> list[Reply]:
    """The replies of requests cancelled before they ran."""
    return [Reply(i, [], cancelled_error(), "{}", FINAL, False) for i in where]

log = logging.getLogger("pb_tensor.runtime")

class LoadedModel:
    """A model version loaded by :meth:`ModelRepository.load`, ready for requests.

    Requests are validated against the configuration as Triton validates them, then run by
    the model's ``execute`` (in its stub process, or here with ``isolated=False``). Calls on
    one model are serialized, as on a single Triton instance. A context manager: leaving it
    calls :meth:`unload`.
    """

    def __init__(
        self,
        repository: ModelRepository,
        *,
        name: str,
        version: int,
        config: dict[str, Any],
        spec: ModelSpec,
        isolated: bool,
        decoupled: bool,
        instance_name: str,
        timeout: float | None,
    ) -> None:
        self._repository = repository
        self._name = name
        self._version = version
        self._config = config
        self._spec = spec
        self._isolated = isolated
        self._decoupled = decoupled
        self._instance_name = instance_name
        self._timeout = timeout
        self._engine: Engine | None = None
        # Replies are complete when the engine's run returns (in-process, not decoupled):
        # they need no generator holding the lock between them.
        self._eager = False
        self._lock = threading.RLock()
        self._busy_thread: int | None = None
        self._stub_bls = StubBls(self.bls_data_replies)
        self._queue_policy = queue_policy(config)
        self._input_dtypes: dict[str, Any] = {}
        for io in spec.inputs:
            if io.dtype != TritonDtype.TYPE_BYTES:
                self._input_dtypes[io.name] = triton_to_numpy_type(io.dtype)

    def _attach(self, engine: Engine) -> None:
        self._engine = engine
        self._eager = isinstance(engine, InProcessEngine) and not self._decoupled

    # -- properties ---------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The model's name."""
        return self._name

    @property
    def version(self) -> int:
        """The loaded version."""
        return self._version

    @property
    def config(self) -> dict[str, Any]:
        """The completed configuration (after ``auto_complete_config``), in the JSON form
        ``initialize`` received as ``args["model_config"]``."""
        copied: dict[str, Any] = json.loads(json.dumps(self._config))
        return copied

    @property
    def isolated(self) -> bool:
        """Whether the model runs in a stub process."""
        return self._isolated

    @property
    def decoupled(self) -> bool:
        """Whether the model uses the decoupled transaction policy (use :meth:`stream`)."""
        return self._decoupled

    @property
    def instance_name(self) -> str:
        """The instance name Triton would give it (``<model>_0_0``)."""
        return self._instance_name

    @property
    def pid(self) -> int | None:
        """The stub's process id (None in-process or while no stub runs)."""
        return None if self._engine is None else self._engine.pid

    @property
    def loaded(self) -> bool:
        """False once :meth:`unload` ran."""
        return self._engine is not None

    # -- requests -----------------------------------------------------------------------------
    def _request(
        self,
        inputs: Mapping[str, InputValue],
        requested_outputs: Sequence[str] | None,
        parameters: Mapping[str, ParameterValue] | None,
        correlation_id: int | str,
        flags: int,
        request_id: str,
    ) -> RequestData:
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            raise TypeError(f"inputs must be a mapping of names to values, not {type(inputs)}")
        params = json.dumps(dict(parameters)) if parameters else "{}"
        if not requested_outputs:
            # Numpy arrays that already match the configuration: validated as they become
            # tensors, as validate_request would find them.
            tensors = array_tensors(self._spec, inputs)
            if tensors is not None:
                return RequestData(tensors, self._spec.output_names, request_id,
                                   correlation_id, flags, params, 0, True)  # fmt: skip
        return RequestData(
            [to_tensor(n, v, self._input_dtypes.get(n)) for n, v in inputs.items()],
            list(requested_outputs or ()),
            request_id,
            correlation_id,
            flags,
            params,
        )

    def _replies(
        self, batch: list[RequestData], timeout: float | None, cancel: Cancellation | None = None
    ) -> Iterable[Reply]:
        """Validate, run, and give every reply (errors included) with batch indexes: a list
        when the engine's run completes them all at once, else a generator. ``cancel``: the
        caller's cancellation of the batch (a batch cancelled while queued does not run)."""
        arrival = time.monotonic() if self._queue_policy is not None else 0.0
        early: list[Reply] = []
        valid: list[RequestData] = []
        where: list[int] = []
        for i, data in enumerate(batch):
            if not data.validated:
                try:
                    data.requested_outputs = validate_request(
                        self._spec, data.inputs, data.requested_outputs, data.request_id
                    )
                except InferenceError as exc:
                    early.append(Reply(i, [], exc, "{}", FINAL, False))
                    continue
                data.validated = True
            if self._isolated:
                refusal = gpu_refusal(data.inputs, "input", f"of model '{self._name}'")
                if refusal is not None:
                    error = InferenceError(refusal, TritonError.UNSUPPORTED)
                    early.append(Reply(i, [], error, "{}", FINAL, False))
                    continue
            valid.append(data)
            where.append(i)
        if not valid:
            return early
        busy = self._busy_thread
        if busy is not None and acts_for(busy):
            error = InferenceError(
                f"model '{self._name}' has one instance and this thread is already using it "
                "(a BLS request to itself, or a request made while iterating its stream)",
                TritonError.UNAVAILABLE,
            )
            early.extend(Reply(i, [], error, "{}", FINAL, False) for i in where)
            return early
        if not self._eager:
            return self._run_lazily(early, valid, where, timeout, cancel, arrival)
        with self._lock:
            engine = self._engine
            if engine is None:
                early.extend(self._unloaded(where))
                return early
            if cancel is not None and cancel.cancelled:
                early.extend(_cancelled(where))
                return early
            if self._queue_policy is not None:
                valid, where, rejected = self._queue_policy.reject_expired(valid, where, arrival)
                early.extend(rejected)
                if not valid:
                    return early
            self._busy_thread = threading.get_ident()
            try:
                ran = engine.run(valid, self._timeout if timeout is None else timeout, cancel)
                replies = ran if type(ran) is list else list(ran)
            finally:
                self._busy_thread = None
        if not early:
            return replies  # every request ran: the indexes are the batch's already
        for reply in replies:
            reply.index = where[reply.index]
        early.extend(replies)
        return early

    def _unloaded(self, where: list[int]) -> list[Reply]:
        error = InferenceError(
            f"Request for unknown model: '{self._name}' is not found", TritonError.INVALID_ARG
        )
        return [Reply(i, [], error, "{}", FINAL, False) for i in where]

    def _run_lazily(
        self, early: list[Reply], valid: list[RequestData], where: list[int],
        timeout: float | None, cancel: Cancellation | None, arrival: float,
    ) -> Iterator[Reply]:
        yield from early
        with self._lock:
            engine = self._engine
            if engine is None:
                yield from self._unloaded(where)
                return
            if cancel is not None and cancel.cancelled:
                yield from _cancelled(where)
                return
            if self._queue_policy is not None:
                valid, where, rejected = self._queue_policy.reject_expired(valid, where, arrival)
                yield from rejected
                if not valid:
                    return
            self._busy_thread = threading.get_ident()
            try:
                run = engine.run(valid, self._timeout if timeout is None else timeout, cancel)
                for reply in run:
                    reply.index = where[reply.index]
                    yield reply
            finally:
                self._busy_thread = None

    def infer(
        self,
        inputs: Mapping[str, InputValue],
        *,
        requested_outputs: Sequence[str] | None = None,
        parameters: Mapping[str, ParameterValue] | None = None,
        correlation_id: int | str = 0,
        flags: int = 0,
        request_id: str = "",
        timeout: float | None = None,
    ) -> Outputs:
        """Run one request; its outputs by name.

        ``requested_outputs`` defaults to every configured output; ``parameters`` reach the
        model as ``request.parameters()`` (a JSON object); ``timeout`` (seconds) overrides
        the model's.

        Raises:
            InferenceError: the request is invalid for the configuration, the model answered
                with an error, raised, crashed or timed out (Triton's message and code).
            TypeError: ``inputs`` is not a mapping.
            TritonModelException: an input value of a type Triton cannot carry.
        """
        __tracebackhide__ = True  # pytest shows the test's line, not the runtime's frames
        data = self._request(inputs, requested_outputs, parameters, correlation_id, flags,
                             request_id)
        return self._first_outputs(data, timeout, None)

    def _first_outputs(
        self, data: RequestData, timeout: float | None, cancel: Cancellation | None
    ) -> Outputs:
        __tracebackhide__ = True
        first: Reply | None = None
        for reply in self._replies([data], timeout, cancel):
            if first is None and (reply.has_response or reply.error is not None):
                first = reply
        if first is None:
            raise InferenceError(
                f"model '{self._name}' sent no response for the request (a decoupled model "
                "answers through stream())",
                TritonError.INTERNAL,
            )
        if first.error is not None:
            raise first.error
        return outputs_of(first)

    def infer_async(
        self,
        inputs: Mapping[str, InputValue],
        *,
        requested_outputs: Sequence[str] | None = None,
        parameters: Mapping[str, ParameterValue] | None = None,
        correlation_id: int | str = 0,
        flags: int = 0,
        request_id: str = "",
        timeout: float | None = None,
    ) -> InferFuture:
        """Run one request in a background thread; a future of its outputs.

        Takes the arguments of :meth:`infer`. Requests wait their turn as with :meth:`infer`
        (one instance). ``future.cancel()`` cancels the request whether it still waits or
        already runs: the model sees ``request.is_cancelled()`` turn True, and the future
        fails with Triton's CANCELLED error. ``asyncio.wrap_future(future)`` awaits it.

        Raises:
            TypeError, TritonModelException: as :meth:`infer`, for malformed inputs (at once;
                every other error comes through the future).
        """
        data = self._request(inputs, requested_outputs, parameters, correlation_id, flags,
                             request_id)
        cancellation = Cancellation()
        future = InferFuture(cancellation)

        start(future, lambda: self._first_outputs(data, timeout, cancellation),
              f"pb-tensor-infer-{self._name}")  # fmt: skip
        return future

    def infer_many(
        self,
        requests: Sequence[Mapping[str, InputValue]],
        *,
        requested_outputs: Sequence[str] | None = None,
        parameters: Mapping[str, ParameterValue] | None = None,
        timeout: float | None = None,
    ) -> list[Outputs | InferenceError]:
        """Run several requests in one ``execute`` call, as Triton batches them.

        Returns one entry per request, in order: its outputs, or the ``InferenceError`` of
        that request (one failed request does not fail the others).

        Raises:
            TypeError, TritonModelException: as :meth:`infer`, for malformed inputs.
        """
        batch = [
            self._request(r, requested_outputs, parameters, 0, 0, "") for r in requests
        ]
        results: list[Outputs | InferenceError | None] = [None] * len(batch)
        for reply in self._replies(batch, timeout):
            if results[reply.index] is not None:
                continue
            if reply.error is not None:
                results[reply.index] = reply.error
            elif reply.has_response:
                results[reply.index] = outputs_of(reply)
        missing = InferenceError(
            f"model '{self._name}' sent no response for the request", TritonError.INTERNAL
        )
        return [missing if r is None else r for r in results]

    def stream(
        self,
        inputs: Mapping[str, InputValue],
        *,
        requested_outputs: Sequence[str] | None = None,
        parameters: Mapping[str, ParameterValue] | None = None,
        correlation_id: int | str = 0,
        flags: int = 0,
        request_id: str = "",
        timeout: float | None = None,
    ) -> ResponseStream:
        """Run one request and yield the outputs of each response as it arrives (decoupled
        models send any number); the iterator ends at the final flag.

        Stopping early cancels the request (``request.is_cancelled()`` turns true in the
        model) and waits for the model to finish it. ``cancel()`` on the returned iterator
        cancels the request from any thread: the iterator then raises Triton's CANCELLED
        error.

        Raises:
            InferenceError: when the model sends an error response, raises, crashes or times
                out, or the request is invalid (raised by the iterator).
        """
        __tracebackhide__ = True  # pytest shows the test's line, not the runtime's frames
        data = self._request(inputs, requested_outputs, parameters, correlation_id, flags,
                             request_id)
        cancellation = Cancellation()
        replies = self._lazy_replies(data, timeout, cancellation)
        return ResponseStream(stream_outputs(replies, self._decoupled), cancellation)

    def _lazy_replies(
        self, data: RequestData, timeout: float | None, cancel: Cancellation
    ) -> Iterator[Reply]:
        """The replies of ``data``, run on first ``next``: a stream cancelled before it
        starts never reaches the model."""
        __tracebackhide__ = True
        yield from self._replies([data], timeout, cancel)

    # -- BLS ----------------------------------------------------------------------------------
    def bls_replies(
        self,
        request: InferenceRequest,
        timeout_us: int | None,
        decoupled: bool,
        cancel: Cancellation | None = None,
    ) -> Iterator[Reply]:
        """Run a BLS request made by this model: route it to its target model (``cancel``:
        the caller's ``ResponseIterator.cancel()``)."""
        data = RequestData(
            list(request.inputs()),
            sorted(request.requested_output_names()),
            request.request_id(),
            request.correlation_id(),
            request.flags(),
            request.parameters(),
            timeout_us or 0,
        )
        return self.bls_data_replies(
            request.model_name(), request.model_version(), data, timeout_us, decoupled, cancel
        )

    def bls_data_replies(
        self,
        model_name: str,
        model_version: int,
        data: RequestData,
        timeout_us: int | None,
        decoupled: bool,
        cancel: Cancellation | None = None,
    ) -> Iterator[Reply]:
        """Replies of ``model_name`` to ``data``, with the errors Triton's BLS executor gives
        for an unknown model or a decoupled one called without ``decoupled=True``."""
        prefix = f"Model {model_name} - Error when running inference: "
        try:
            target = self._repository.bls_target(
                model_name, model_version, self._isolated, self._timeout
            )
        except InferenceError as exc:
            error = InferenceError(prefix + exc.message(), TritonError.INTERNAL)
            return iter([Reply(0, [], error, "{}", FINAL, False)])
        if target.decoupled and not decoupled:
            error = InferenceError(
                prefix + f"Model {model_name} is using the decoupled. The current BLS request "
                "call doesn't support models using the decoupled transaction policy. Please "
                "use 'decoupled=True' argument to the 'exec' or 'async_exec' calls for "
                "decoupled models.",
                TritonError.INTERNAL,
            )
            return iter([Reply(0, [], error, "{}", FINAL, False)])
        timeout = None if not timeout_us else timeout_us / 1e6
        return iter(target._replies([data], timeout, cancel))

    def on_stub_message(self, engine: StubEngine, kind: str, tensors: list[Tensor],
                        body: Any) -> None:
        """Serve a stub's request to the runtime (BLS, model control)."""
        if kind == "bls":
            self._stub_bls.serve(engine, tensors, body)
            return
        if kind == "bls_cancel":
            self._stub_bls.cancel(body)
            return
        call_id, payload = body
        try:
            result = self._repository.control(kind, payload, self._isolated)
        except Exception as exc:
            engine.send("control_reply", (call_id, False, str(exc)))
            return
        engine.send("control_reply", (call_id, True, result))

    # -- lifecycle ----------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """The custom metrics (``pb_utils.MetricFamily``) the model recorded, by family
        name: kind, description and each metric's labels and value."""
        with self._lock:
            engine = self._engine
            return {} if engine is None else engine.metrics()

    def is_ready(self) -> bool:
        """Whether the model is ready, as Triton's readiness check says: loaded, its stub
        healthy, and the model's own ``is_ready()`` (when it defines one) returning True. A
        failing check is logged (``pb_tensor.runtime``) with upstream's text."""
        with self._lock:
            engine = self._engine
            if engine is None:
                return False
            ready, error = engine.is_ready()
        if error is not None:
            log.error("readiness check of model '%s' failed: %s", self._name, error)
        return ready

    def unload(self) -> None:
        """Call the model's ``finalize`` and stop its stub; later requests fail. Idempotent."""
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.stop()
            self._repository.forget(self)

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.unload()

    def __repr__(self) -> str:
        mode = "isolated" if self._isolated else "in-process"
        state = "loaded" if self._engine is not None else "unloaded"
        return f"<LoadedModel {self._name!r} version {self._version}, {mode}, {state}>"
