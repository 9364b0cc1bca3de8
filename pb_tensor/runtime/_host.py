"""Hosting one model instance: import ``model.py``, ``auto_complete_config``, ``initialize``,
``execute`` with upstream's checks of what it returns, ``finalize``.

The same code runs in a stub process (isolated mode) and in the caller's process
(``isolated=False``); only where responses go (the ``sink``) and where BLS calls go (the
backend) differ.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import traceback
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from pb_tensor import Tensor
from pb_tensor.errors import TritonModelException
from pb_tensor.runtime._background import background_done
from pb_tensor.runtime._dropped import drop_notice
from pb_tensor.runtime._model_code import ExecuteOnlyBls, ModelCode
from pb_tensor.runtime._model_import import UserModelError, format_exception
from pb_tensor.runtime._reshape import output_reshapes, reshape_outputs
from pb_tensor.runtime._seam import (
    BLS_OUTSIDE_EXECUTE_MESSAGE,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
    InferenceRequest,
    InferenceResponse,
    InferenceResponseSender,
    ModelBackend,
    claim_direct_send,
    close_sender,
    created_senders,
    new_request,
    release_flags,
    sender_is_closed,
    set_backend,
)

__all__ = [
    "Batch",
    "HostInfo",
    "ModelHost",
    "RequestData",
    "Sink",
]

log = logging.getLogger("pb_tensor.runtime")

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

_LOOP_STOP_TIMEOUT = 5.0


@dataclass(frozen=True)
class HostInfo:
    """Everything a host needs to know about the model instance it runs."""

    name: str
    version: int
    model_dir: str
    model_path: str
    instance_name: str
    instance_kind: str
    device_id: int
    config_json: str
    decoupled: bool
    # The repository's opt-ins (ModelRepository): BF16 as_numpy() inside the model, and
    # in-process inputs handed over without a copy.
    bf16_as_numpy: bool = False
    share_inputs: bool = False
    # pb-tensor's additions to Triton's API inside the model (pb_tensor.extras_policy).
    pb_tensor_extras: bool = False
    # The CPUs of the instance's host policy ("cpu-cores"; empty: no binding). A stub binds
    # its process to them; an in-process instance shares the caller's threads and binds none
    # (its load only checks that the kernel would accept them).
    cpus: tuple[int, ...] = ()

    def initialize_args(self) -> dict[str, str]:
        """``initialize(args)``: the keys and string values Triton's stub launcher passes."""
        return {
            "model_config": self.config_json,
            "model_instance_kind": self.instance_kind,
            "model_instance_name": self.instance_name,
            "model_instance_device_id": str(self.device_id),
            "model_repository": self.model_dir,
            "model_version": str(self.version),
            "model_name": self.name,
        }


@dataclass(slots=True)  # made for every request and step: slots build faster
class RequestData:
    """One request as the runtime hands it to a host (inputs already as tensors)."""

    inputs: list[Tensor]
    requested_outputs: list[str]
    request_id: str = ""
    correlation_id: int | str = 0
    flags: int = 0
    parameters: str = "{}"
    timeout_us: int = 0
    # True once requested_outputs holds what validation of this request gave.
    validated: bool = False
    # Tensors already in the shared-memory pool to send to a stub in place of ``inputs``
    # (same data, other names: an ensemble's step outputs feeding the next step); the stub
    # names them as ``inputs`` are named, so that nothing is copied on the way.
    pooled: list[Tensor] | None = None
    # True when ``inputs`` are already as an in-process engine hands them to the model (its
    # own copies of the caller's arrays where it copies them, as Triton does; no BYTES to
    # convert): the engine takes them as they are.
    delivered: bool = False


Sink = Callable[[int, InferenceResponse | None, int], None]
"""Where responses go: ``sink(request_index, response_or_None, flags)``."""


class ModelHost:
    """One running ``TritonPythonModel`` instance."""

    def __init__(self, info: HostInfo, cls: type, backend: ModelBackend) -> None:
        self.info = info
        self._cls = cls
        self._backend: ModelBackend = ExecuteOnlyBls(backend, self.check_bls)
        # Triton's stub: BLS works once initialize returned and until finalize starts.
        self._serving = False
        self._instance: Any = None
        config = json.loads(info.config_json)
        self._reshapes = output_reshapes(config)
        self._batched = int(config.get("max_batch_size", 0)) > 0
        # The event loop of ``async def execute``, running in a thread of its own once made
        # (upstream's stub does the same): tasks a coroutine starts keep running after it.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # (file, line, function) of the model's frame where the last failed execute raised.
        self._raised_at: tuple[str, int, str] | None = None

    def _model_code(self) -> ModelCode:
        # argv [''], BF16 as_numpy() and pb-tensor's API additions refused unless the
        # repository opted in.
        return ModelCode(self.info.bf16_as_numpy, self.info.pb_tensor_extras)

    # -- lifecycle ----------------------------------------------------------------------------
    def initialize(self) -> None:
        """Instantiate the class and call ``initialize(args)`` when defined.

        Raises:
            UserModelError: the constructor or ``initialize`` raised (Triton's text).
        """
        previous = set_backend(self._backend)
        try:
            with self._model_code():
                self._instance = self._cls()
                init = getattr(self._instance, "initialize", None)
                if init is not None:
                    init(self.info.initialize_args())
        except Exception as exc:
            raise UserModelError(format_exception(exc)) from exc
        finally:
            set_backend(previous)
        self._serving = True

    def check_bls(self) -> None:
        """Refuse BLS outside ``execute`` as Triton's stub does: before ``initialize``
        returned (``auto_complete_config``, ``initialize``) and from ``finalize`` on.

        Raises:
            TritonModelException: ``BLS is only supported during the 'execute' function.``
        """
        if not self._serving:
            raise TritonModelException(BLS_OUTSIDE_EXECUTE_MESSAGE)

    @property
    def defines_is_ready(self) -> bool:
        """Whether the model object has an ``is_ready`` attribute (python_backend looks
        once, after ``initialize``, and asks the model nothing without one)."""
        return self._instance is not None and hasattr(self._instance, "is_ready")

    def is_ready(self) -> tuple[bool, str | None]:
        """The model's own ``is_ready()`` when defined (True otherwise); an error text when it
        raised or did not return a bool (upstream's message)."""
        fn = getattr(self._instance, "is_ready", None)
        if fn is None:
            return self._instance is not None, None
        previous = set_backend(self._backend)
        try:
            with self._model_code():
                result = fn()
                if asyncio.iscoroutine(result):
                    # As upstream's stub: an ``async def is_ready`` runs on the model's loop.
                    result = asyncio.run_coroutine_threadsafe(
                        _await_serving(self._backend, result), self._event_loop()
                    ).result()
        except BaseException as exc:  # (pybind11's catch: SystemExit too)
            # It runs on a readiness thread (never the main one), which must answer.
            return False, format_exception(exc)
        finally:
            set_backend(previous)
        if not isinstance(result, bool):
            return False, "is_ready() must return a boolean value"
        return result, None

    def finalize(self) -> str | None:
        """Stop the event loop of ``async def execute`` (as upstream, before ``finalize``),
        then call ``finalize()`` when defined; the error text if it raised."""
        instance, self._instance = self._instance, None
        self._serving = False
        self._stop_loop()
        previous = set_backend(self._backend)
        try:
            fin = getattr(instance, "finalize", None)
            if fin is not None:
                with self._model_code():
                    fin()
        except Exception as exc:
            log.error("finalize of model '%s' raised: %s", self.info.name, exc)
            return format_exception(exc)
        finally:
            set_backend(previous)
        return None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop coroutines of ``execute`` run on (started on first use)."""
        loop = self._loop
        if loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=loop.run_forever, name=f"pb-tensor-loop-{self.info.name}", daemon=True
            )
            thread.start()
            self._loop, self._loop_thread = loop, thread
        return loop

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._loop_thread
        self._loop = self._loop_thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_LOOP_STOP_TIMEOUT)
        if not thread.is_alive():  # a task blocking the loop keeps it: leave it to exit
            loop.close()

    # -- execute ------------------------------------------------------------------------------
    def build_requests(
        self,
        batch: Sequence[RequestData],
        sink: Sink,
        is_cancelled: Callable[[int], bool],
    ) -> Batch:
        """The ``InferenceRequest`` objects ``execute`` receives; each gets its sender when
        the model first asks for it."""
        info = self.info
        if self._reshapes:
            sink = self._reshaping(sink)
        built = Batch(sink, is_cancelled, info.decoupled)
        name, version = info.name, info.version
        built.requests = [
            new_request(data.inputs, data.requested_outputs, name, version, data.request_id,
                        data.correlation_id, data.flags, data.timeout_us, data.parameters,
                        built, i)
            for i, data in enumerate(batch)
        ]  # fmt: skip
        built.count = len(built.requests)
        return built

    def _reshaping(self, sink: Sink) -> Sink:
        reshapes, batched, name = self._reshapes, self._batched, self.info.name

        def send(index: int, response: InferenceResponse | None, flags: int) -> None:
            if response is not None:
                response = reshape_outputs(response, reshapes, batched, name)
            sink(index, response, flags)

        return send

    def execute(self, batch: Batch) -> str | None:
        """Run ``execute`` on the batch's requests; responses go to its sink.

        Returns None on success, or Triton's message for the whole batch
        (``Failed to process the request(s) for model '<instance>', message: ...``); the
        senders of a failed batch are closed.
        """
        requests = batch.requests
        with self._lock:
            previous = set_backend(self._backend)
            try:
                error = self._execute(batch)
                if error is None:
                    batch.rescheduled = [
                        i for i, r in enumerate(requests)
                        if release_flags(r) == TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
                    ]
            finally:
                set_backend(previous)
                # The requests point at their batch: a batch pointing back would be a cycle
                # that keeps their tensors (pool records) alive until the garbage collector.
                batch.requests = []
        if error is not None:
            error = (
                f"Failed to process the request(s) for model '{self.info.instance_name}', "
                f"message: {error}"
            )
            _log_execute_error(error, self._raised_at)
            self._raised_at = None
        if error is not None or not self.info.decoupled:
            # Senders made from now on come closed. After a failure, close the ones the
            # model took; a non-decoupled model may still send its one response through an
            # open sender (from another thread), as in Triton.
            batch.done = True
            if error is not None and batch.direct != len(requests):
                for sender in created_senders(requests):
                    close_sender(sender)
        return error

    def _execute(self, batch: Batch) -> str | None:
        requests = batch.requests
        instance = self._instance
        if instance is None or not hasattr(instance, "execute"):
            return (
                f"Python model {self.info.model_path} does not implement `execute` method."
            )
        try:
            with self._model_code():
                returned = instance.execute(requests)
                if type(returned) is not list and asyncio.iscoroutine(returned):
                    if self.info.decoupled:
                        # As upstream: a decoupled model's coroutine runs on in the background
                        # (its responses come through the senders) and the instance takes its
                        # next batch. It starts in start_background(), once the runtime knows
                        # the instance is free: a response it sent first would reach a caller
                        # while the instance still looked busy.
                        batch.background = returned
                        return None
                    future = asyncio.run_coroutine_threadsafe(
                        _await_serving(self._backend, returned), self._event_loop()
                    )
                    returned = future.result()
            return self._process_returned(batch, returned)
        except (Exception, SystemExit) as exc:
            self._raised_at = _model_frame(exc, self.info.model_path)
            return format_exception(exc)

    def start_background(self, batch: Batch) -> None:
        """Start the coroutine a decoupled ``async def execute`` of ``batch`` returned (if
        any) on the model's event loop; its failure is logged and ends its unfinished
        requests. Call it once the instance is known to be free (the stub: after its "done"
        message; in-process: after the instance's release)."""
        coroutine, batch.background = batch.background, None
        if coroutine is None:
            return
        future = asyncio.run_coroutine_threadsafe(
            _await_serving(self._backend, coroutine), self._event_loop()
        )
        future.add_done_callback(functools.partial(
            background_done, batch, batch.count, self._background_error
        ))  # fmt: skip

    def _background_error(self, exc: BaseException) -> str:
        """The error of the requests a decoupled coroutine that raised left unfinished."""
        return (
            f"Failed to process the request(s) for model '{self.info.instance_name}', "
            f"message: {format_exception(exc)}"
        )

    def _process_returned(self, batch: Batch, returned: object) -> str | None:
        requests = batch.requests
        if returned is None:
            return None
        if self.info.decoupled:
            return (
                f"Python model '{self.info.instance_name}' is using the decoupled mode and the "
                "execute function must return None."
            )
        if not isinstance(returned, list):
            return f"Expected a list in the execute return, found type '{type(returned)}'."
        if len(returned) != len(requests):
            return (
                "Number of InferenceResponse objects do not match the number of "
                f"InferenceRequest objects. InferenceRequest(s) size is:{len(requests)}, and "
                f"InferenceResponse(s) size is:{len(returned)}\n"
            )
        sink = batch.sink
        for index, (request, response) in enumerate(zip(requests, returned)):
            if response is None:
                continue
            if release_flags(request) == TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
                return (  # upstream's text, typo included
                    "Expected a None object in the execute function return list for "
                    f"reschduled request, found type '{type(response)}'."
                )
            if not isinstance(response, InferenceResponse):
                return (
                    "Expected an 'InferenceResponse' object in the execute function return "
                    f"list, found type '{type(response)}'."
                )
            try:
                if claim_direct_send(request, response):
                    # What the sender's send(response, FINAL) does for a request that sent
                    # nothing yet, without making the sender.
                    batch.direct += 1
                    sink(index, response, TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                else:
                    request.get_response_sender().send(
                        response, TRITONSERVER_RESPONSE_COMPLETE_FINAL
                    )
            except TritonModelException as exc:
                return str(exc)
        return None


def _model_frame(exc: BaseException, model_path: str) -> tuple[str, int, str] | None:
    """The innermost frame of ``exc``'s traceback in the model's file, if any."""
    path = os.path.abspath(model_path)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(f.filename) == path]  # fmt: skip
    if not frames:
        return None
    return frames[-1].filename, frames[-1].lineno or 0, frames[-1].name


def _log_execute_error(error: str, raised_at: tuple[str, int, str] | None) -> None:
    # The caller gets this text as an InferenceError too: handlers that print the caller's
    # errors (the command line) skip records so marked.
    extra = {"reported_to_caller": True}
    if raised_at is None or not log.isEnabledFor(logging.ERROR):
        log.error("%s", error, extra=extra)
        return
    # The record names the model's line that raised (pytest's captured log shows it), not
    # the runtime's.
    filename, lineno, function = raised_at
    log.handle(log.makeRecord(log.name, logging.ERROR, filename, lineno, "%s", (error,), None,
                              function, extra))  # fmt: skip


async def _await_serving(backend: ModelBackend, coroutine: Any) -> Any:
    """Await ``coroutine`` with ``backend`` serving its BLS calls (the loop's task has a
    context of its own; tasks it starts inherit the backend)."""
    set_backend(backend)
    return await coroutine


class Batch:
    """The requests of one ``execute`` call and where their responses go; the source of
    their senders (made on first use: non-decoupled models rarely ask for one)."""

    __slots__ = ("_is_cancelled", "background", "count", "decoupled", "direct", "done",
                 "requests", "rescheduled", "senders", "sink")  # fmt: skip

    def __init__(self, sink: Sink, is_cancelled: Callable[[int], bool], decoupled: bool) -> None:
        self.sink = sink
        self._is_cancelled = is_cancelled
        self.decoupled = decoupled
        self.requests: list[InferenceRequest] = []
        # Set once the requests ended (a non-decoupled execute returned, or execute failed):
        # senders made afterwards come closed.
        self.done = False
        # How many returned responses the runtime delivered without a sender.
        self.direct = 0
        self.senders: dict[int, InferenceResponseSender] = {}
        # The requests ``execute`` released with the RESCHEDULE flag (set when it returns).
        self.rescheduled: list[int] = []
        # How many requests it had (``requests`` is emptied once execute returned).
        self.count = 0
        # A decoupled ``async def execute``'s coroutine, until start_background() runs it.
        self.background: Coroutine[Any, Any, object] | None = None

    def waiting(self) -> list[int]:
        """The requests whose sender the model took and did not close: a non-decoupled
        model may send their response after ``execute`` returned."""
        # A copy first: a model thread may make a sender meanwhile.
        return [i for i, s in list(self.senders.items()) if not sender_is_closed(s)]

    def make_sender(
        self, index: int, requested_output_names: Collection[str]
    ) -> InferenceResponseSender:
        """The sender of request ``index``."""
        sender = InferenceResponseSender(
            functools.partial(self.sink, index),
            functools.partial(self._is_cancelled, index),
            decoupled=self.decoupled,
            requested_output_names=requested_output_names,
            on_drop=drop_notice(self.sink, index),
        )
        if self.done:
            close_sender(sender)
        self.senders[index] = sender
        return sender

    def is_cancelled(self, index: int) -> bool:
        """Whether request ``index`` was cancelled."""
        return self._is_cancelled(index)
