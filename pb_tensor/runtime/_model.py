"""``LoadedModel``: one loaded model version and the calls that run requests on it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pb_tensor import Tensor, TritonDtype, triton_to_numpy_type
from pb_tensor.runtime._bls import StubBls
from pb_tensor.runtime._calls import (
    FutureSink,
    InferFuture,
    ResponseStream,
    first_outputs,
    start,
    stream_outputs,
)
from pb_tensor.runtime._engines import StubEngine, StubFailure
from pb_tensor.runtime._errors import (
    InferenceError,
    ModelLoadError,
    RequestRefused,
    model_control_error,
)
from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._inprocess import InProcessEngine
from pb_tensor.runtime._model_import import UserModelError
from pb_tensor.runtime._placement import all_host, gpu_refusal
from pb_tensor.runtime._scheduling import (
    Instance,
    InstanceFactory,
    Scheduler,
    Statistics,
    merge_metrics,
    unloaded_error,
)
from pb_tensor.runtime._seam import (
    InferenceRequest,
    TritonError,
)
from pb_tensor.runtime._tracker import FINAL, Cancellation, Reply, acts_for
from pb_tensor.runtime._validate import (
    ModelSpec,
    array_tensors,
    known_outputs,
    validate_request,
)
from pb_tensor.runtime._values import (
    InputValue,
    Outputs,
    RequestParameterValue,
    outputs_of,
    to_tensor,
)

if TYPE_CHECKING:
    from types import TracebackType

    from pb_tensor.runtime._repository import ModelRepository

__all__ = ["LoadedModel"]

log = logging.getLogger("pb_tensor.runtime")


class LoadedModel:
    """A model version loaded by :meth:`ModelRepository.load`, ready for requests.

    Requests are validated against the configuration as Triton validates them, then run by
    the model's ``execute`` (in its stub processes, or here with ``isolated=False``). The
    ``instance_group`` count gives that many instances; concurrent requests run on idle
    ones, one request per ``execute`` call, or gathered into batches by the dynamic batcher
    when ``dynamic_batching`` is configured. A context manager: leaving it calls
    :meth:`unload`.
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
        self._scheduler: Scheduler | None = None
        self._instances: list[Instance] = []
        self._lock = threading.Lock()
        # What an instance update needs (set by the repository; None: the model has none).
        self._factory: InstanceFactory | None = None
        self._updating = threading.Lock()  # one instance update at a time
        # The configuration the repository gave this copy (normalized, before
        # auto_complete_config): what a later load compares to decide between an instance
        # update and a reload (core's ConfigChangeRequiresReload).
        self.source_config: Any = None
        self._stub_bls = StubBls(self.bls_data_replies)
        self._in_process = False
        self._copy_inputs = False
        self._input_dtypes: dict[str, Any] = {}
        for io in spec.inputs:
            if io.dtype != TritonDtype.TYPE_BYTES:
                self._input_dtypes[io.name] = triton_to_numpy_type(io.dtype)

    def _attach(self, instances: list[Instance], factory: InstanceFactory | None = None) -> None:
        self._factory = factory
        engine = instances[0].engine
        eager = isinstance(engine, InProcessEngine) and not self._decoupled
        # In-process models receive copies of the caller's arrays (as Triton's do, through
        # its shared memory): _request makes them where it makes the tensors anyway, and
        # marks tensors it made as the engine would deliver them.
        self._in_process = isinstance(engine, InProcessEngine)
        self._copy_inputs = (
            isinstance(engine, InProcessEngine) and not engine.host.info.share_inputs
        )
        self._instances = instances
        self._scheduler = Scheduler(self._name, self._config, instances, eager,
                                    self._decoupled)  # fmt: skip

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
    def repository(self) -> ModelRepository:
        """The repository that loaded this model."""
        return self._repository

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
        """The name Triton gives its first instance (``<model>_0`` for a model without
        ``instance_group``, ``<model>_0_0`` for an unnamed first group)."""
        return self._instance_name

    @property
    def instance_names(self) -> list[str]:
        """The names Triton gives its instances (``<group>_<index>``, group by group)."""
        return [i.name for i in self._instances]

    @property
    def pid(self) -> int | None:
        """The first instance's stub process id (None in-process or while no stub runs)."""
        return self._instances[0].engine.pid if self.loaded else None

    @property
    def pids(self) -> list[int | None]:
        """The stub process id of each instance (None in-process)."""
        return [i.engine.pid for i in self._instances] if self.loaded else []

    @property
    def loaded(self) -> bool:
        """False once :meth:`unload` ran."""
        scheduler = self._scheduler
        return scheduler is not None and not scheduler.instances.closed

    def statistics(self) -> dict[str, Any]:
        """This version's entry of Triton's statistics extension (``model_stats``):
        ``name``, ``version``, ``last_inference`` (ms since the epoch),
        ``inference_count`` (batch elements of successful requests), ``execution_count``
        (``execute`` calls), ``inference_stats`` (``success``, ``fail``, ``queue``,
        ``compute_input``, ``compute_infer``, ``compute_output``, ``cache_hit``,
        ``cache_miss``; each ``{"count", "ns"}``), ``response_stats``, ``batch_stats``
        (per batch size) and ``memory_usage``, recorded as Triton's core records them."""
        scheduler = self._scheduler
        if scheduler is None:
            return Statistics().entry(self._name, self._version)
        return scheduler.stats.entry(self._name, self._version)

    # -- requests -----------------------------------------------------------------------------
    def _request(
        self,
        inputs: Mapping[str, InputValue],
        requested_outputs: Sequence[str] | None,
        parameters: Mapping[str, RequestParameterValue] | None,
        correlation_id: int | str,
        flags: int,
        request_id: str,
    ) -> RequestData:
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            raise TypeError(f"inputs must be a mapping of names to values, not {type(inputs)}")
        params = json.dumps(dict(parameters)) if parameters else "{}"
        spec = self._spec
        requested = list(requested_outputs) if requested_outputs else []
        wanted = known_outputs(spec, requested) if requested else spec.output_names
        if wanted is not None:
            # Numpy arrays that already match the configuration: validated as they become
            # tensors, as validate_request would find them. Numeric only (no BYTES to
            # convert), copied when the model's inputs are copies: what an in-process engine
            # delivers.
            tensors = array_tensors(spec, inputs, self._copy_inputs)
            if tensors is not None:
                return RequestData(tensors, wanted, request_id, correlation_id, flags, params,
                                   0, True, delivered=self._in_process)  # fmt: skip
        return RequestData(
            [to_tensor(n, v, self._input_dtypes.get(n)) for n, v in inputs.items()],
            requested,
            request_id,
            correlation_id,
            flags,
            params,
        )

    def _unrefusable(self, data: RequestData) -> bool:
        """Whether none of :meth:`_replies`'s checks could refuse ``data``: validated, an int
        correlation id, and (with stub processes) every input on the host."""
        return (data.validated and type(data.correlation_id) is int
                and (not self._isolated or all_host(data.inputs)))  # fmt: skip

    def _replies(
        self, batch: list[RequestData], timeout: float | None, cancel: Cancellation | None = None,
        priority: int = 0, *, queued: bool = False,
    ) -> Iterable[Reply]:
        """Validate, run, and give every reply (errors included) with batch indexes: a list
        when the engine's run completes them all at once, else a generator. ``cancel``: the
        caller's cancellation of the batch (a batch cancelled while queued does not run).
        ``queued``: the scheduler queues the requests now (:meth:`Scheduler.run`)."""
        start_ns = time.monotonic_ns()
        scheduler = self._scheduler
        if len(batch) == 1 and scheduler is not None and self._unrefusable(batch[0]):
            # One valid request, which none of the checks below could refuse: straight on.
            return scheduler.run(batch, [0], self._timeout if timeout is None else timeout,
                                 cancel, start_ns, priority, queued=queued)  # fmt: skip
        early: list[Reply] = []
        valid: list[RequestData] = []
        where: list[int] = []
        for i, data in enumerate(batch):
            if isinstance(data.correlation_id, str) and len(data.correlation_id) > 128:
                # TRITONSERVER_InferenceRequestSetCorrelationIdString's refusal
                error: InferenceError = RequestRefused(
                    "string correlation ID cannot be longer than 128 characters",
                    TritonError.UNSUPPORTED,
                )
                early.append(Reply(i, [], error, "{}", FINAL, False))
                continue
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
                    error = RequestRefused(refusal, TritonError.UNSUPPORTED)
                    early.append(Reply(i, [], error, "{}", FINAL, False))
                    continue
            valid.append(data)
            where.append(i)
        scheduler = self._scheduler
        if scheduler is None:  # a request during initialize
            error = unloaded_error(self._name, refused=True)
            return early + [Reply(i, [], error, "{}", FINAL, False) for i in where]
        if early:
            end = time.monotonic_ns()
            for _ in early:
                scheduler.stats.failure(start_ns, end)
        if not valid:
            return early
        ran = scheduler.run(valid, where, self._timeout if timeout is None else timeout,
                            cancel, start_ns, priority, queued=queued)  # fmt: skip
        if not early:
            return ran
        if type(ran) is list:
            return early + ran
        return itertools.chain(early, ran)

    def infer(
        self,
        inputs: Mapping[str, InputValue],
        *,
        requested_outputs: Sequence[str] | None = None,
        parameters: Mapping[str, RequestParameterValue] | None = None,
        correlation_id: int | str = 0,
        flags: int = 0,
        sequence_start: bool = False,
        sequence_end: bool = False,
        request_id: str = "",
        timeout: float | None = None,
        priority: int = 0,
    ) -> Outputs:
        """Run one request; its outputs by name.

        ``requested_outputs`` defaults to every configured output; ``parameters`` reach the
        model as ``request.parameters()`` (a JSON object); ``timeout`` (seconds) overrides
        the model's; ``priority`` picks the dynamic batcher's priority level (0: the
        default level). ``correlation_id`` (an int, or a string of at most 128
        characters) and ``flags`` (``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START`` = 1,
        ``..._END`` = 2) reach the model as ``request.correlation_id()`` and
        ``request.flags()``; ``sequence_start`` / ``sequence_end`` set those flags (as
        tritonclient's keywords do). A model with ``sequence_batching`` routes the request
        to its sequence's instance and adds the configured control inputs.

        Raises:
            InferenceError: the request is invalid for the configuration, the model answered
                with an error, raised, crashed or timed out (Triton's message and code).
            TypeError: ``inputs`` is not a mapping.
            TritonModelException: an input value of a type Triton cannot carry.
        """
        __tracebackhide__ = True  # pytest shows the test's line, not the runtime's frames
        flags |= (1 if sequence_start else 0) | (2 if sequence_end else 0)
        data = self._request(inputs, requested_outputs, parameters, correlation_id, flags,
                             request_id)
        return self._first_outputs(data, timeout, None, priority)

    def _first_outputs(
        self, data: RequestData, timeout: float | None, cancel: Cancellation | None,
        priority: int = 0, replies: Iterable[Reply] | None = None,
    ) -> Outputs:
        """The first response's outputs of ``data``, from ``replies`` when it was queued."""
        __tracebackhide__ = True
        first: Reply | None = None
        if replies is None:
            replies = self._replies([data], timeout, cancel, priority)
        for reply in replies:
            if first is None and (reply.has_response or reply.error is not None):
                first = reply
        return first_outputs(first, self._name)

    def _queued_replies(
        self, data: RequestData, timeout: float | None, cancel: Cancellation, priority: int
    ) -> Iterable[Reply] | None:
        """The replies of ``data`` queued now, in the calling thread, where the scheduler has
        a queue for it; None where it would run in the thread that reads them."""
        scheduler = self._scheduler
        if scheduler is None or not scheduler.queues():
            return None
        return self._replies([data], timeout, cancel, priority, queued=True)

    def infer_async(
        self,
        inputs: Mapping[str, InputValue],
        *,
        requested_outputs: Sequence[str] | None = None,
        parameters: Mapping[str, RequestParameterValue] | None = None,
        correlation_id: int | str = 0,
        flags: int = 0,
        sequence_start: bool = False,
        sequence_end: bool = False,
        request_id: str = "",
        timeout: float | None = None,
        priority: int = 0,
    ) -> InferFuture:
        """Run one request in the background; a future of its outputs. A request that
        joins a queue (the dynamic batcher's, or a stub model's default scheduler's) is
        queued now and the thread that runs its batch completes the future; any other runs
        in a background thread (a long-lived worker, idle ones reused).

        Takes the arguments of :meth:`infer`. Requests wait for an idle instance (or their batch)
        as with :meth:`infer`. ``future.cancel()`` cancels the request whether it still waits or
        already runs: the model sees ``request.is_cancelled()`` turn True, and the future
        fails with Triton's CANCELLED error. ``asyncio.wrap_future(future)`` awaits it.
        A request queued by the dynamic or the sequence batcher (or a stub model's default
        scheduler) joins its queue before this returns: calls made one after the other from
        one thread keep their order there (a sequence's requests need not wait for each
        other), as the requests of one Triton stream do. Other requests start in the
        background and reach the model's instances in either order.

        Raises:
            TypeError, TritonModelException: as :meth:`infer`, for malformed inputs (at once;
                every other error comes through the future).
        """
        flags |= (1 if sequence_start else 0) | (2 if sequence_end else 0)
        data = self._request(inputs, requested_outputs, parameters, correlation_id, flags,
                             request_id)
        cancellation = Cancellation()
        future = InferFuture(cancellation)
        scheduler = self._scheduler
        if (
            scheduler is not None and self._unrefusable(data)
            and scheduler.enqueue(data, self._timeout if timeout is None else timeout,
                                  cancellation, time.monotonic_ns(), priority,
                                  FutureSink(future, self._name))
        ):  # fmt: skip
            return future
        # The sequence batcher's queue (which no thread waits on here) takes it now: the
        # requests of one caller reach it in the caller's order.
        replies = self._queued_replies(data, timeout, cancellation, priority)
        start(future, lambda: self._first_outputs(data, timeout, cancellation, priority,
                                                  replies),
              f"pb-tensor-infer-{self._name}")  # fmt: skip
        return future

    def infer_many(
        self,
        requests: Sequence[Mapping[str, InputValue]],
        *,
        requested_outputs: Sequence[str] | None = None,
        parameters: Mapping[str, RequestParameterValue] | None = None,
        timeout: float | None = None,
    ) -> list[Outputs | InferenceError]:
        """Run several requests together. Without ``dynamic_batching`` they reach the
        model as one ``execute`` call (a batch Triton's default scheduler would not form:
        a test of the model's batch handling); with it, they join the batcher's queue and
        leave it in batches by its rules (``max_batch_size``, preferred sizes, shapes).

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
        parameters: Mapping[str, RequestParameterValue] | None = None,
        correlation_id: int | str = 0,
        flags: int = 0,
        sequence_start: bool = False,
        sequence_end: bool = False,
        request_id: str = "",
        timeout: float | None = None,
        priority: int = 0,
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
        flags |= (1 if sequence_start else 0) | (2 if sequence_end else 0)
        data = self._request(inputs, requested_outputs, parameters, correlation_id, flags,
                             request_id)
        cancellation = Cancellation()
        # Queued now where the scheduler queues it (the requests of one caller keep their
        # order, as on a Triton stream); else run on the first ``next``.
        replies = self._queued_replies(data, timeout, cancellation, priority)
        if replies is None:
            replies = self._lazy_replies(data, timeout, cancellation, priority)
        return ResponseStream(stream_outputs(iter(replies), self._decoupled), cancellation)

    def _lazy_replies(
        self, data: RequestData, timeout: float | None, cancel: Cancellation, priority: int
    ) -> Iterator[Reply]:
        """The replies of ``data``, run on first ``next``: a stream cancelled before it
        starts never reaches the model."""
        __tracebackhide__ = True
        yield from self._replies([data], timeout, cancel, priority)

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
        except Exception as exc:  # the model's call fails with it, as upstream's stub says it
            instance = engine.info.instance_name if engine.info is not None else self._name
            engine.send("control_reply", (call_id, False,
                                          model_control_error(kind, instance, str(exc))))
            return
        engine.send("control_reply", (call_id, True, result))

    # -- lifecycle ----------------------------------------------------------------------------
    def _each_instance(self) -> Iterator[Instance]:
        """Each instance, held while the caller uses it (between requests)."""
        scheduler = self._scheduler
        if scheduler is None:
            return
        for instance in list(self._instances):
            held = scheduler.instances.hold(instance)
            if held is None:
                if scheduler.instances.closed:
                    return
                continue  # an update removed it meanwhile
            try:
                yield instance
            finally:
                if held:
                    scheduler.instances.release(instance)

    def metrics(self) -> dict[str, Any]:
        """The custom metrics (``pb_utils.MetricFamily``) the model recorded, by family
        name: kind, description and each metric's labels and value (summed over instances
        for counters and histograms with the same labels, as Triton's shared families)."""
        snapshots = [i.engine.metrics() for i in self._each_instance()]
        if not self._isolated:
            return snapshots[0] if snapshots else {}  # in-process: one registry
        return merge_metrics(snapshots)

    def is_ready(self) -> bool:
        """Whether the model is ready, as Triton's readiness check says: loaded, the stub
        of every instance healthy, and the model's own ``is_ready()`` (when it defines one)
        returning True within five seconds. The checks run beside the model's requests (a
        model's ``execute`` may ask about itself through ``pb_utils.is_model_ready``); a
        check asked while another waits for the model's answer waits for that answer. Why
        a model is not ready is logged at the verbose level (DEBUG, ``pb_tensor.runtime``)
        with Triton's text: ``Model 'm' version 1 is not ready: <reason>``."""
        why = self.not_ready_reason()
        if why is not None and self.loaded:
            log.debug("Model '%s' version %d is not ready: %s", self._name, self._version, why)
        return why is None

    def not_ready_reason(self) -> str | None:
        """None when :meth:`is_ready` would say True, else why not, as Triton words it
        (``Stub process '<instance>' is not healthy.``, ``Model '<instance>' is not ready
        (user-defined check failed).``, the error of an ``is_ready()`` that raised, ...).
        Runs the same checks as :meth:`is_ready`, without logging."""
        scheduler = self._scheduler
        if not self.loaded or scheduler is None:
            return f"model '{self._name}' version {self._version} is not loaded"
        instances = scheduler.instances.instances
        for instance in instances:
            why = instance.readiness.check(instance.engine, instance.name)
            if why is not None and instance in scheduler.instances.instances:
                return why  # (else an instance update removed, and stopped, it meanwhile)
        return None

    def update_instance_group(self, instance_group: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
        """Change the model's instances to ``instance_group`` (its configuration's JSON
        form) without reloading it, as Triton's core updates a loaded model whose
        configuration changed only there (``TritonModel::UpdateInstanceGroup``): each
        instance the new groups ask for reuses an existing one of the same signature (its
        group's settings but for name and count, and its device), keeping its name, its
        model object and its state; the others start (``initialize``) before the update
        takes effect; the instances left over stop (``finalize``) before this returns, once
        the batch each one runs ended (under the sequence batcher, an instance with
        sequences keeps them and stops in the background once the last one ended; an
        instance running the calling thread's own request, in the background once that
        ended). Requests keep running meanwhile, and the statistics go on. A ``count``
        below 1 counts as 1.

        Returns:
            How many instances started and how many were removed.

        Raises:
            ModelLoadError: the groups are invalid (Triton's message), or a new instance
                failed to start; the model then keeps its instances, unchanged.
            TypeError: ``instance_group`` is not a list of groups.
        """
        groups: object = instance_group  # (checked: callers may pass anything)
        if not isinstance(groups, list | tuple) or not all(isinstance(g, Mapping) for g in groups):
            raise TypeError("instance_group must be a list of mappings (the configuration's "
                            f"JSON form), not {instance_group!r}")  # fmt: skip
        # (protobuf, which reading configurations needs, is no dependency of the stubs)
        from pb_tensor.runtime import _schema

        where = f"model '{self._name}' version {self._version}"
        with self._updating:
            scheduler, factory = self._scheduler, self._factory
            if scheduler is None or scheduler.instances.closed or factory is None:
                raise ModelLoadError(f"failed to update the instances of {where}: the model "
                                     "is not loaded")  # fmt: skip
            current = _schema.config_from_dict(self._config, where=where)
            wanted = json.loads(json.dumps(self._config))
            wanted["instance_group"] = [dict(g) for g in instance_group]
            try:
                final = _schema.config_from_dict(wanted, where=where)
                _schema.normalize_instance_groups(final, factory.gpu_count)
            except _schema.ConfigError as exc:
                raise ModelLoadError(str(exc)) from None
            # A new instance's initialize sees the model's configuration as it is until the
            # update takes effect (core creates the instances first).
            config_json = _schema.config_to_json(current)
            existing: dict[object, list[Instance]] = {}
            for instance in self._instances:
                existing.setdefault(instance.signature, []).append(instance)
            placed: list[Instance | None] = []
            starting: list[tuple[int, object, Any]] = []
            for info, signature in factory.plan(final):
                reusable = existing.get(signature)
                if reusable:  # core takes the last one of that signature
                    placed.append(reusable.pop())
                else:
                    starting.append((len(placed), signature,
                                     dataclasses.replace(info, config_json=config_json)))
                    placed.append(None)
            removed = [i for group in existing.values() for i in group]
            try:
                started = factory.start([info for _, _, info in starting]) if starting else []
            except (StubFailure, UserModelError, ModelLoadError) as exc:
                raise ModelLoadError(str(exc)) from None
            for (at, signature, _), instance in zip(starting, started):
                instance.signature = signature
                placed[at] = instance
            instances = [i for i in placed if i is not None]
            # A removed instance that runs a batch stops once the batch ended, and the update
            # waits for it (core destroys it in CommitInstances, whose destructor joins its
            # backend thread), unless the batch is the calling thread's own request (a model
            # updating itself: it goes in the background then), or the sequence batcher
            # keeps it for its sequences (it goes when the last one ended).
            freed: list[Instance] = []
            state = threading.Condition()
            waiting = [True]

            def retired(instance: Instance) -> None:
                with state:
                    if waiting[0]:
                        freed.append(instance)
                        state.notify_all()
                        return
                factory.retire(instance)

            sequenced = scheduler.sequencer is not None
            now = scheduler.update(instances, started, removed,
                                   factory.retire if sequenced else retired)  # fmt: skip
            if now is None:  # the model began to unload meanwhile
                for instance in started:
                    instance.engine.stop()
                raise ModelLoadError(f"failed to update the instances of {where}: the model "
                                     "is not loaded")  # fmt: skip
            self._instances = instances
            self._config["instance_group"] = _schema.config_to_dict(final)["instance_group"]
            awaited = [] if sequenced else [
                i for i in removed if i not in now
                and not (i.owner not in (None, 0) and acts_for(i.owner))
            ]  # fmt: skip
            with state:
                while not all(any(i is f for f in freed) for i in awaited):
                    state.wait()
                waiting[0] = False
                now = [*now, *freed]
        for instance in now:
            instance.engine.stop()
        return len(started), len(removed)

    def unload(self) -> None:
        """Call the model's ``finalize`` in every instance and stop their stubs; queued
        requests fail, running ones finish first; later requests fail. Idempotent."""
        with self._lock:
            scheduler = self._scheduler
            if scheduler is None or scheduler.instances.closed:
                return
            instances = scheduler.close()
        for instance in instances:
            instance.engine.stop()
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
        state = "loaded" if self.loaded else "unloaded"
        return f"<LoadedModel {self._name!r} version {self._version}, {mode}, {state}>"
