"""Ensembles (``platform: "ensemble"``): :class:`EnsembleModel` and its dataflow run.

A request to an ensemble runs as Triton's ``EnsembleContext`` runs it: each ensemble tensor
holds one value per *iteration* (a decoupled step adds one per response); a step runs for
iteration ``k`` as soon as every tensor it maps has a value for ``k`` (the order of the steps
in the file does not matter); a response goes out when every requested ensemble output has a
value for the same iteration. Without decoupled steps every step runs once, in an order the
dataflow allows. Tensors pass from step to step as the ``Tensor`` objects the steps answered
with: a step running in a stub process answers with tensors that live in the repository's
shared-memory pool, and the next stub gets the same records (its stub names them), so nothing
is copied through the runtime process.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from pb_tensor import Tensor
from pb_tensor.runtime._ensemble_flow import Flow
from pb_tensor.runtime._ensemble_steps import (
    Override,
    Step,
    Value,
    dataflow_order,
    plain_request,
    reshaped,
    sequence_override,
    step_request,
)
from pb_tensor.runtime._errors import InferenceError, RequestRefused
from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._model import LoadedModel
from pb_tensor.runtime._reshape import renamed
from pb_tensor.runtime._scheduling import Statistics
from pb_tensor.runtime._seam import TritonError
from pb_tensor.runtime._tracker import FINAL, Cancellation, Reply, cancelled_error
from pb_tensor.runtime._validate import ModelSpec, validate_request
from pb_tensor.runtime._values import Outputs, outputs_of

if TYPE_CHECKING:
    from pb_tensor.runtime._repository import ModelRepository

__all__ = ["EnsembleModel"]


class _Run:
    """The state of one request to an ensemble (core's ``EnsembleContext``)."""

    def __init__(self, model: EnsembleModel, data: RequestData, priority: int = 0) -> None:
        self.model = model
        self.data = data
        # The ensemble request's priority, which core gives every step's request.
        self.priority = priority
        self.requested = list(data.requested_outputs)
        # tensor name -> iteration -> (tensor or None for a missing optional one, batch size)
        self.values: dict[str, dict[int, Value]] = {}
        self.counts: dict[str, int] = {}
        # (tensor name, iteration) -> the steps that still have to read it
        self.remaining: dict[tuple[str, int], int] = {}
        self.launched: set[tuple[int, int]] = set()
        self.error: InferenceError | None = None
        self.responses = 0
        # ids of the stored tensors that a stub sent (their data is in the pool)
        self.pooled: set[int] = set()
        # the ensemble inputs a step may take as they are (EnsembleModel._owned)
        self.owned: frozenset[str] = model._owned if data.delivered else frozenset()

    def add(
        self, name: str, tensor: Tensor | None, batch_size: int, override: Override = None
    ) -> tuple[str, int]:
        iteration = self.counts.get(name, 0)
        self.counts[name] = iteration + 1
        self.values.setdefault(name, {})[iteration] = (tensor, batch_size, override)
        self.remaining[(name, iteration)] = len(self.model._consumers.get(name, ()))
        return name, iteration

    def release(self, tensors: Iterable[str], iteration: int) -> None:
        """A step read ``tensors`` of ``iteration``: drop each that no other step reads
        and that is no requested output (core prunes them too)."""
        for name in dict.fromkeys(tensors):
            key = (name, iteration)
            left = self.remaining.get(key, 0) - 1
            self.remaining[key] = left
            if left <= 0 and name not in self.requested:
                self.values[name].pop(iteration, None)
                del self.remaining[key]

    def ready_steps(self, updated: Iterable[tuple[str, int]]) -> list[tuple[int, int]]:
        found = []
        for name, iteration in updated:
            for index in self.model._consumers.get(name, ()):
                key = (index, iteration)
                if key in self.launched:
                    continue
                step = self.model._steps[index]
                if all(iteration in self.values.get(t, {}) for _, t, _ in step.inputs):
                    self.launched.add(key)
                    found.append(key)
        return found

    def response(self, updated: Iterable[tuple[str, int]]) -> Reply | None:
        """Core's ``CheckAndSetEnsembleOutput``: the ensemble's response for the iteration
        an update completed, if it completed one."""
        requested = self.requested
        iteration = -1
        for name, it in updated:
            if name in requested and all(it in self.values.get(o, {}) for o in requested):
                iteration = it
        if iteration < 0:
            return None
        found = []
        for name in requested:
            entry = self.values[name]
            value = entry[iteration] if self.remaining.get((name, iteration)) else entry.pop(
                iteration
            )
            found.append((name, value[0], value[1]))
        tensors = self.model._outputs(self.data, found)
        self.responses += 1
        return Reply(0, tensors, None, "{}", 0, True)


class EnsembleModel(LoadedModel):
    """A loaded ensemble: the calls of :class:`LoadedModel` (``infer``, ``infer_async``,
    ``infer_many``, ``stream`` for a decoupled ensemble), each request running the steps
    as a dataflow graph over the composing models. BLS requests reach it by name, as in
    Triton.

    Unloading it leaves the composing models loaded (Triton's ``unload``);
    ``unload(unload_dependents=True)`` unloads them too.
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
        timeout: float | None,
        steps: list[Step],
        optional_inputs: list[str],
        output_dims: dict[str, tuple[int, ...]],
    ) -> None:
        super().__init__(
            repository, name=name, version=version, config=config, spec=spec,
            isolated=isolated, decoupled=decoupled, instance_name="", timeout=timeout,
        )  # fmt: skip
        self._steps = steps
        self._optional_inputs = optional_inputs
        self._output_dims = output_dims
        self._consumers: dict[str, list[int]] = {}
        for index, step in enumerate(steps):
            for tensor in dict.fromkeys(t for _, t, _ in step.inputs):
                self._consumers.setdefault(tensor, []).append(index)
        self._live = True
        # The ensemble's own statistics, recorded per request as core's RequestTracker does.
        self._stats = Statistics()
        self._batching = spec.max_batch_size > 0
        self._ordered = [steps[i] for i in dataflow_order(steps, [i.name for i in spec.inputs])]
        # Triton copies each step's inputs into shared memory, so a step writing into its
        # inputs changes nothing another step or the caller sees. When every step reading
        # the ensemble's inputs is an in-process model that copies its inputs, the request
        # copies the caller's arrays once, as an in-process model's does (_request:
        # RequestData.delivered), and an ensemble input mapped to exactly one step input
        # (and no ensemble output) goes to that step as it is: nobody else can see it.
        # Every other tensor is copied for each step input it feeds.
        reads: dict[str, int] = {}
        for step in steps:
            for _, tensor, _ in step.inputs:
                reads[tensor] = reads.get(tensor, 0) + 1
        given = [i.name for i in spec.inputs]
        readers = [s for s in steps if any(t in given for _, t, _ in s.inputs)]
        copying = bool(readers) and all(s.copies for s in readers)
        self._in_process = self._copy_inputs = copying
        outputs = {o.name for o in spec.outputs}
        self._owned: frozenset[str] = frozenset(
            n for n in given if copying and reads.get(n) == 1 and n not in outputs
        )

    @property
    def composing_models(self) -> list[LoadedModel]:
        """The models the steps run, in step order (one entry per distinct model)."""
        return list(dict.fromkeys(s.model for s in self._steps))

    @property
    def loaded(self) -> bool:
        """False once :meth:`unload` ran."""
        return self._live

    @property
    def pid(self) -> int | None:
        """None: an ensemble has no process of its own."""
        return None

    def _request_batch(self, data: RequestData) -> int:
        """The batch size of a request to the ensemble (0 without batching)."""
        if self._spec.max_batch_size <= 0:
            return 0
        for t in data.inputs:
            shape = t.shape()
            if shape:
                return int(shape[0])
        return 0

    def _outputs(
        self, data: RequestData, values: Iterable[tuple[str, Tensor | None, int]]
    ) -> list[Tensor]:
        """The response tensors of ``values`` (ensemble output, tensor, its batch size):
        named and shaped as the ensemble's outputs (a missing optional one left out)."""
        batching = self._request_batch(data) != 0
        tensors = []
        for name, tensor, batch_size in values:
            if tensor is None:
                continue
            if batching == (batch_size != 0):  # no batch dimension to add or strip
                tensors.append(tensor if tensor.name() == name else renamed(tensor, name))
            else:
                shape = reshaped(self._output_dims[name], batching, batch_size,
                                  tuple(tensor.shape()))  # fmt: skip
                tensors.append(renamed(tensor, name, shape))
        return tensors

    def statistics(self) -> dict[str, Any]:
        """The ensemble's entry of Triton's statistics extension, recorded as core records
        an ensemble's requests: each request a success or a failure, and each success one
        execution of its batch size. Its ``compute_infer`` is the whole run of the steps
        (Triton sums the steps' compute times); queue times are 0, as an ensemble request
        waits in its steps' queues (their statistics have those)."""
        return self._stats.entry(self._name, self._version)

    def _account(self, data: RequestData, ok: bool, start_ns: int) -> None:
        end = time.monotonic_ns()
        if ok:
            size = max(1, self._request_batch(data)) if self._batching else 1
            self._stats.one_request(size, False, start_ns, start_ns, end)
        else:
            self._stats.failure(start_ns, end)

    # -- running ------------------------------------------------------------------------------
    def _replies(
        self, batch: list[RequestData], timeout: float | None, cancel: Cancellation | None = None,
        priority: int = 0, *, queued: bool = False,
    ) -> Iterable[Reply]:
        # (queued: never asked; an ensemble has no scheduler of its own to queue in)
        if self._decoupled:
            return self._run_batch(batch, timeout, cancel, priority)
        replies = []
        for index, data in enumerate(batch):
            reply = self._run_static(data, timeout, cancel, priority)
            reply.index = index
            replies.append(reply)
        return replies

    def _first_outputs(
        self, data: RequestData, timeout: float | None, cancel: Cancellation | None,
        priority: int = 0, replies: Iterable[Reply] | None = None,
    ) -> Outputs:
        __tracebackhide__ = True
        if self._decoupled or replies is not None:
            return super()._first_outputs(data, timeout, cancel, priority, replies)
        # The one reply of a static run (a response or an error), without the batch's list.
        reply = self._run_static(data, timeout, cancel, priority)
        if reply.error is not None:
            raise reply.error
        return outputs_of(reply)

    def _refusal(self, data: RequestData) -> Reply | None:
        """The error reply of a request that cannot run (validated here otherwise)."""
        if not self._live:
            error = RequestRefused(
                f"Request for unknown model: '{self._name}' is not found",
                TritonError.INVALID_ARG,
            )
            return Reply(0, [], error, "{}", FINAL, False)
        if not data.validated:
            try:
                data.requested_outputs = validate_request(
                    self._spec, data.inputs, data.requested_outputs, data.request_id
                )
            except InferenceError as exc:
                return Reply(0, [], exc, "{}", FINAL, False)
            data.validated = True
        return None

    def _failed(self, error: InferenceError) -> Reply:
        return Reply(0, [], InferenceError(f"in ensemble '{self._name}', {error.message()}",
                                           error.code()), "{}", FINAL, False)  # fmt: skip

    def _run_static(
        self, data: RequestData, timeout: float | None, cancel: Cancellation | None,
        priority: int = 0,
    ) -> Reply:
        """A request to an ensemble without decoupled steps, recorded in the statistics."""
        start = time.monotonic_ns()
        reply = self._static(data, timeout, cancel, priority)
        self._account(data, reply.error is None, start)
        return reply

    def _static(
        self, data: RequestData, timeout: float | None, cancel: Cancellation | None,
        priority: int,
    ) -> Reply:
        """:meth:`_run_static`'s run: every step runs once, in an order where each step's
        inputs exist before it runs (any such order gives the dataflow's result)."""
        if not (self._live and data.validated):
            refused = self._refusal(data)
            if refused is not None:
                return refused
        batch_size = self._request_batch(data) if self._batching else 0
        values: dict[str, Value] = {}
        for t in data.inputs:
            values[t.name()] = (t, batch_size, None)
        for name in self._optional_inputs:
            values.setdefault(name, (None, batch_size, None))
        pooled_ids: set[int] = set()
        owned = self._owned if data.delivered else frozenset()
        read = values.__getitem__
        for step in self._ordered:
            if cancel is not None and cancel.cancelled:
                return self._failed(cancelled_error())
            # A plain step's request straight away; the general path for any other (and
            # for inputs the plain path declines).
            request = None if step.plain is None else plain_request(step, read, data, owned)
            if request is None:
                request, step_batch = step_request(step, read, pooled_ids, data, owned,
                                                   plain=False)  # fmt: skip
            else:
                step_batch = 0
            got: Reply | None = None
            for reply in step.model._replies([request], timeout, cancel, priority):
                if got is None and (reply.has_response or reply.error is not None):
                    got = reply
            produced: dict[str, Tensor] = {}
            override: Override = None
            if got is not None:
                if got.error is not None:
                    return self._failed(got.error)
                for t in got.tensors:
                    produced[t.name()] = t
                parameters = got.parameters
                if parameters != "{}":
                    try:
                        override = sequence_override(parameters, request.correlation_id)
                    except InferenceError as exc:
                        return self._failed(exc)
            if step.pooled_outputs:
                pooled_ids.update(id(t) for t in produced.values())
            for output, tensor_name in step.outputs.items():
                values[tensor_name] = (produced.get(output), step_batch, override)
        tensors: list[Tensor] = []
        for name in data.requested_outputs:
            tensor, made_batch, _ = values[name]
            if tensor is None:
                continue  # an optional output left out
            if not batch_size and not made_batch and tensor.name() == name:
                tensors.append(tensor)  # as it is, as _outputs gives it
            else:
                tensors.extend(self._outputs(data, [(name, tensor, made_batch)]))
        return Reply(0, tensors, None, "{}", FINAL, True)

    def _run_batch(
        self, batch: list[RequestData], timeout: float | None, cancel: Cancellation | None,
        priority: int = 0,
    ) -> Iterator[Reply]:
        for index, data in enumerate(batch):
            for reply in self._run_one(data, timeout, cancel, priority):
                reply.index = index
                yield reply

    def _run_one(
        self, data: RequestData, timeout: float | None, cancel: Cancellation | None,
        priority: int = 0,
    ) -> Iterator[Reply]:
        start = time.monotonic_ns()
        ok = False
        try:
            for reply in self._flow(data, timeout, cancel, priority):
                ok = reply.error is None
                yield reply
        finally:
            self._account(data, ok, start)

    def _flow(
        self, data: RequestData, timeout: float | None, cancel: Cancellation | None,
        priority: int,
    ) -> Iterator[Reply]:
        """:meth:`_run_one`'s run: the dataflow of one request (decoupled steps)."""
        refused = self._refusal(data)
        if refused is not None:
            yield refused
            return
        run = _Run(self, data, priority)
        batch_size = self._request_batch(data)
        updated = [run.add(t.name(), t, batch_size) for t in data.inputs]
        given = {t.name() for t in data.inputs}
        updated.extend(run.add(n, None, batch_size) for n in self._optional_inputs
                       if n not in given)  # fmt: skip
        held: Reply | None = None
        for reply in Flow(run, self._steps, timeout, cancel).replies(updated):
            if self._decoupled:
                yield reply
            elif held is None:
                held = reply
        if run.error is not None:
            yield self._failed(run.error)
            return
        if held is not None:
            held.flags = FINAL
            yield held
            return
        if not self._decoupled:
            tag = f"[request id: {data.request_id or '<id_unknown>'}] "
            error = InferenceError(
                f"in ensemble '{self._name}', {tag}unexpected deadlock, at least one output is "
                "not set while no more ensemble steps can be made", TritonError.INVALID_ARG,
            )  # fmt: skip
            yield Reply(0, [], error, "{}", FINAL, False)
            return
        yield Reply(0, [], None, "{}", FINAL, False)

    # -- lifecycle ----------------------------------------------------------------------------
    def is_ready(self) -> bool:
        """Whether the ensemble is loaded with its composing models: as in Triton, an
        ensemble has no readiness check of its own (core's ``Model::IsReady``), and its
        composing models' checks are theirs."""
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        """None while :meth:`is_ready` says True, else why not."""
        if not self._live:
            return f"model '{self._name}' version {self._version} is not loaded"
        for model in self.composing_models:
            if not model.loaded:
                return f"composing model '{model.name}' version {model.version} is not loaded"
        return None

    def metrics(self) -> dict[str, Any]:
        """An ensemble records no custom metrics of its own: ``{}``."""
        return {}

    def unload(self, *, unload_dependents: bool = False) -> None:
        """Unload the ensemble; with ``unload_dependents`` its composing models too (as
        Triton's ``unload_dependents``). Idempotent."""
        live, self._live = self._live, False
        if not live:
            return
        self._repository.forget(self)
        if unload_dependents:
            for model in self.composing_models:
                if isinstance(model, EnsembleModel):
                    model.unload(unload_dependents=True)
                else:
                    model.unload()

    def __repr__(self) -> str:
        state = "loaded" if self._live else "unloaded"
        return f"<EnsembleModel {self._name!r} version {self._version}, {state}>"


# -- loading ------------------------------------------------------------------------------------
