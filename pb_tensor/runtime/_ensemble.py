"""Ensembles (``platform: "ensemble"``): loading with Triton's checks, and the dataflow run.

A request to an ensemble runs as Triton's ``EnsembleContext`` runs it: each ensemble tensor
holds one value per *iteration* (a decoupled step adds one per response); a step runs for
iteration ``k`` as soon as every tensor it maps has a value for ``k`` (the order of the steps
in the file does not matter); a response goes out when every requested ensemble output has a
value for the same iteration. Tensors pass from step to step as the ``Tensor`` objects the
steps answered with: a step running in a stub process answers with tensors that live in the
repository's shared-memory pool, and handing one to the next stub adds a reference to the same
record (renamed or reshaped tensors are re-saved once, as Triton copies a tensor into the
next model's input buffer).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pb_tensor import Tensor
from pb_tensor.runtime import _schema
from pb_tensor.runtime._ensemble_validate import (
    ENSEMBLE_PLATFORM,
    EnsembleConfigError,
    check_against_models,
    check_scheduling,
    dependency_cycle,
    step_models,
)
from pb_tensor.runtime._errors import InferenceError, ModelLoadError
from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._model import LoadedModel
from pb_tensor.runtime._reshape import renamed
from pb_tensor.runtime._seam import TritonError
from pb_tensor.runtime._tracker import FINAL, Cancellation, Reply, cancelled_error
from pb_tensor.runtime._validate import ModelSpec, validate_request

if TYPE_CHECKING:
    from pb_tensor.runtime._repository import ModelRepository

__all__ = ["EnsembleModel", "is_ensemble", "load_ensemble"]

_WILDCARD = -1


def is_ensemble(config: Any) -> bool:
    """Whether a configuration asks for Triton's ensemble scheduler."""
    return bool(config.platform == ENSEMBLE_PLATFORM or config.HasField("ensemble_scheduling"))


@dataclass(frozen=True)
class _Step:
    model: LoadedModel
    batching: bool
    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]  # (model input, tensor, dims)
    outputs: dict[str, str]  # model output -> ensemble tensor
    requested: tuple[str, ...]
    pooled_inputs: bool  # the model runs in a stub: pooled tensors reach it as they are
    pooled_outputs: bool  # ... and answers with tensors in the pool


def _same_dims(config: Sequence[int], shape: Sequence[int]) -> bool:
    return len(config) == len(shape) and all(
        c in (_WILDCARD, s) for c, s in zip(config, shape)
    )


def _reshaped(
    dims: Sequence[int], batching: bool, batch_size: int, shape: tuple[int, ...]
) -> tuple[int, ...]:
    """Core's ``EnsembleContext::ReshapeTensorDims``: add or strip the batch dimension
    between batching and non-batching models."""
    if batching != (batch_size != 0):
        if batching:
            if _same_dims(dims, shape):
                return (1, *shape)
        elif not _same_dims(dims, shape) and batch_size == 1:
            return shape[1:]
    return shape


def _dataflow_order(steps: Sequence[_Step], inputs: Iterable[str]) -> list[int]:
    """Step indexes in an order where every step comes after the steps writing its inputs
    (validation made sure there is one, covering every step)."""
    have = set(inputs)
    order: list[int] = []
    left = list(range(len(steps)))
    while left:
        ready = [i for i in left if all(t in have for _, t, _ in steps[i].inputs)]
        if not ready:
            break  # unreachable after validation: the rest could never run
        for i in ready:
            order.append(i)
            left.remove(i)
            have.update(steps[i].outputs.values())
    return order


def _step_request(
    step: _Step,
    value: Callable[[str], tuple[Tensor | None, int]],
    pooled_ids: set[int],
    data: RequestData,
) -> tuple[RequestData, int]:
    """Core's ``InitStep``: the request of ``step`` (``value(tensor)``: the tensor and its
    batch size), and its batch size."""
    inputs = []
    batch_size = 0
    # A stub's outputs are in the pool already: the next stub gets the same records and
    # names them itself (nothing copied); a reshape needs a new record.
    pooled: list[Tensor] | None = [] if step.pooled_inputs else None
    renaming = False
    for model_input, tensor_name, dims in step.inputs:
        tensor, tensor_batch = value(tensor_name)
        if tensor is None:
            continue  # an optional input the request left out
        if step.batching == (tensor_batch != 0):  # no batch dimension to add or strip
            same_shape = True
            if step.batching and not batch_size:
                batch_size = tensor_batch
            view = tensor if tensor.name() == model_input else renamed(tensor, model_input)
        else:
            have = tuple(tensor.shape())
            shape = _reshaped(dims, step.batching, tensor_batch, have)
            same_shape = shape == have
            if step.batching and shape and not batch_size:
                batch_size = shape[0]
            view = renamed(tensor, model_input, shape)
        inputs.append(view)
        if pooled is not None:
            if view is tensor:
                pooled.append(tensor)
            elif same_shape and id(tensor) in pooled_ids:
                pooled.append(tensor)
                renaming = True
            else:
                pooled = None
    request = RequestData(inputs, list(step.requested), data.request_id, data.correlation_id,
                          data.flags, data.parameters, data.timeout_us,
                          pooled=pooled if renaming else None)  # fmt: skip
    return request, batch_size


class _Run:
    """The state of one request to an ensemble (core's ``EnsembleContext``)."""

    def __init__(self, model: EnsembleModel, data: RequestData) -> None:
        self.model = model
        self.data = data
        self.requested = list(data.requested_outputs)
        # tensor name -> iteration -> (tensor or None for a missing optional one, batch size)
        self.values: dict[str, dict[int, tuple[Tensor | None, int]]] = {}
        self.counts: dict[str, int] = {}
        # (tensor name, iteration) -> the steps that still have to read it
        self.remaining: dict[tuple[str, int], int] = {}
        self.launched: set[tuple[int, int]] = set()
        self.error: InferenceError | None = None
        self.responses = 0
        # ids of the stored tensors that a stub sent (their data is in the pool)
        self.pooled: set[int] = set()

    def add(self, name: str, tensor: Tensor | None, batch_size: int) -> tuple[str, int]:
        iteration = self.counts.get(name, 0)
        self.counts[name] = iteration + 1
        self.values.setdefault(name, {})[iteration] = (tensor, batch_size)
        self.remaining[(name, iteration)] = len(self.model.consumers.get(name, ()))
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
            for index in self.model.consumers.get(name, ()):
                key = (index, iteration)
                if key in self.launched:
                    continue
                step = self.model.steps[index]
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
            found.append((name, *value))
        tensors = self.model.outputs(self.data, found)
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
        steps: list[_Step],
        optional_inputs: list[str],
        output_dims: dict[str, tuple[int, ...]],
    ) -> None:
        super().__init__(
            repository, name=name, version=version, config=config, spec=spec,
            isolated=isolated, decoupled=decoupled, instance_name="", timeout=timeout,
        )  # fmt: skip
        self.steps = steps
        self.optional_inputs = optional_inputs
        self.output_dims = output_dims
        self.consumers: dict[str, list[int]] = {}
        for index, step in enumerate(steps):
            for tensor in dict.fromkeys(t for _, t, _ in step.inputs):
                self.consumers.setdefault(tensor, []).append(index)
        self._live = True
        self.ordered = [steps[i] for i in _dataflow_order(steps, [i.name for i in spec.inputs])]

    @property
    def composing_models(self) -> list[LoadedModel]:
        """The models the steps run, in step order (one entry per distinct model)."""
        return list(dict.fromkeys(s.model for s in self.steps))

    @property
    def loaded(self) -> bool:
        """False once :meth:`unload` ran."""
        return self._live

    @property
    def pid(self) -> int | None:
        """None: an ensemble has no process of its own."""
        return None

    def request_batch(self, data: RequestData) -> int:
        """The batch size of a request to the ensemble (0 without batching)."""
        if self._spec.max_batch_size <= 0:
            return 0
        for t in data.inputs:
            shape = t.shape()
            if shape:
                return int(shape[0])
        return 0

    def outputs(
        self, data: RequestData, values: Iterable[tuple[str, Tensor | None, int]]
    ) -> list[Tensor]:
        """The response tensors of ``values`` (ensemble output, tensor, its batch size):
        named and shaped as the ensemble's outputs (a missing optional one left out)."""
        batching = self.request_batch(data) != 0
        tensors = []
        for name, tensor, batch_size in values:
            if tensor is not None:
                shape = _reshaped(self.output_dims[name], batching, batch_size,
                                  tuple(tensor.shape()))  # fmt: skip
                tensors.append(renamed(tensor, name, shape))
        return tensors

    # -- running ------------------------------------------------------------------------------
    def _replies(
        self, batch: list[RequestData], timeout: float | None, cancel: Cancellation | None = None
    ) -> Iterable[Reply]:
        if self._decoupled:
            return self._run_batch(batch, timeout, cancel)
        replies = []
        for index, data in enumerate(batch):
            reply = self._run_static(data, timeout, cancel)
            reply.index = index
            replies.append(reply)
        return replies

    def _refusal(self, data: RequestData) -> Reply | None:
        """The error reply of a request that cannot run (validated here otherwise)."""
        if not self._live:
            error = InferenceError(
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
        self, data: RequestData, timeout: float | None, cancel: Cancellation | None
    ) -> Reply:
        """A request to an ensemble without decoupled steps: every step runs once, in an
        order where each step's inputs exist before it runs (any such order gives the
        dataflow's result)."""
        refused = self._refusal(data)
        if refused is not None:
            return refused
        batch_size = self.request_batch(data)
        values: dict[str, tuple[Tensor | None, int]] = {
            t.name(): (t, batch_size) for t in data.inputs
        }
        for name in self.optional_inputs:
            values.setdefault(name, (None, batch_size))
        pooled_ids: set[int] = set()
        for step in self.ordered:
            if cancel is not None and cancel.cancelled:
                return self._failed(cancelled_error())
            request, step_batch = _step_request(step, values.__getitem__, pooled_ids, data)
            got: Reply | None = None
            for reply in step.model._replies([request], timeout, cancel):
                if got is None and (reply.has_response or reply.error is not None):
                    got = reply
            if got is not None and got.error is not None:
                return self._failed(got.error)
            produced = {} if got is None else {t.name(): t for t in got.tensors}
            if step.pooled_outputs:
                pooled_ids.update(id(t) for t in produced.values())
            for output, tensor_name in step.outputs.items():
                values[tensor_name] = (produced.get(output), step_batch)
        found = [(name, *values[name]) for name in data.requested_outputs]
        return Reply(0, self.outputs(data, found), None, "{}", FINAL, True)

    def _run_batch(
        self, batch: list[RequestData], timeout: float | None, cancel: Cancellation | None
    ) -> Iterator[Reply]:
        for index, data in enumerate(batch):
            for reply in self._run_one(data, timeout, cancel):
                reply.index = index
                yield reply

    def _run_one(
        self, data: RequestData, timeout: float | None, cancel: Cancellation | None
    ) -> Iterator[Reply]:
        refused = self._refusal(data)
        if refused is not None:
            yield refused
            return
        run = _Run(self, data)
        batch_size = self.request_batch(data)
        updated = [run.add(t.name(), t, batch_size) for t in data.inputs]
        given = {t.name() for t in data.inputs}
        updated.extend(run.add(n, None, batch_size) for n in self.optional_inputs
                       if n not in given)  # fmt: skip
        held: Reply | None = None
        for reply in self._advance(run, updated, timeout, cancel):
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

    def _advance(
        self, run: _Run, updated: list[tuple[str, int]], timeout: float | None,
        cancel: Cancellation | None,
    ) -> Iterator[Reply]:
        response = run.response(updated)
        if response is not None:
            yield response
        for index, iteration in run.ready_steps(updated):
            if run.error is not None:
                return
            yield from self._run_step(run, index, iteration, timeout, cancel)

    def _run_step(
        self, run: _Run, index: int, iteration: int, timeout: float | None,
        cancel: Cancellation | None,
    ) -> Iterator[Reply]:
        if cancel is not None and cancel.cancelled:
            run.error = cancelled_error()
            return
        step = self.steps[index]
        values = run.values
        request, batch_size = _step_request(
            step, lambda name: values[name][iteration], run.pooled, run.data
        )
        run.release((t for _, t, _ in step.inputs), iteration)
        replies = step.model._replies([request], timeout, cancel)
        try:
            for reply in replies:
                if reply.error is not None:
                    run.error = reply.error
                    return
                if not reply.has_response:
                    continue
                produced = {t.name(): t for t in reply.tensors}
                if step.pooled_outputs:
                    run.pooled.update(id(t) for t in reply.tensors)
                updated = [
                    run.add(tensor_name, produced.get(output), batch_size)
                    for output, tensor_name in step.outputs.items()
                ]
                yield from self._advance(run, updated, timeout, cancel)
                if run.error is not None:
                    return
        finally:
            close = getattr(replies, "close", None)
            if close is not None:
                close()

    # -- lifecycle ----------------------------------------------------------------------------
    def is_ready(self) -> bool:
        """Whether the ensemble and every composing model are ready."""
        return self._live and all(m.is_ready() for m in self.composing_models)

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
def _steps_of(repository: ModelRepository, name: str) -> list[str] | None:
    path = os.path.join(repository.path, name, "config.pbtxt")
    if not os.path.isfile(path):
        return None
    try:
        config = _schema.parse_config_file(path)
    except _schema.ConfigError:
        return None
    if not is_ensemble(config):
        return None
    return [n for n, _ in step_models(config)]


def load_ensemble(
    repository: ModelRepository,
    config: Any,
    *,
    name: str,
    version: int,
    model_dir: str,
    isolated: bool,
    timeout: float | None,
) -> EnsembleModel:
    """Validate ensemble ``config`` and load its composing models (as Triton's explicit
    mode does); the loaded ensemble.

    Raises:
        ModelLoadError: Triton's message: the ensemble's configuration is invalid, a
            composing model is missing, fails to load or does not fit the ensemble, or
            ensembles contain each other.
    """
    where = f"model '{name}' version {version}"
    try:
        check_scheduling(config, os.path.basename(os.path.normpath(model_dir)))
        known = set(repository.models())
        missing = sorted({n for n, _ in step_models(config)} - known)
        if missing:
            raise EnsembleConfigError(
                f"ensemble {name} contains models that are not available or ambiguous: "
                + ", ".join(missing))
        cycle = dependency_cycle(name, lambda n: _steps_of(repository, n))
        if cycle is not None:
            raise cycle
        models: dict[str, LoadedModel] = {}
        for step_name, step_version in step_models(config):
            if step_name in models:
                continue
            if step_version > 0 and step_version not in repository.versions(step_name):
                raise EnsembleConfigError(
                    f"ensemble '{name}' depends on '{step_name}' whose required version "
                    f"{step_version} is not loaded.")
            try:
                models[step_name] = repository.shared_model(
                    step_name, step_version, isolated, timeout)
            except ModelLoadError as exc:
                nested = _steps_of(repository, step_name) is not None
                if nested:
                    raise EnsembleConfigError(
                        f"ensemble '{name}' depends on '{step_name}' which is not valid. "
                        f"Model '{step_name}' failed with error: {exc}") from None
                raise EnsembleConfigError(
                    f"ensemble '{name}' depends on '{step_name}' which has no loaded "
                    f"version. Model '{step_name}' loading failed with error: {exc}") from None
        completed = {
            n: _schema.config_from_dict(m.config, where=f"model '{n}'")
            for n, m in models.items()
        }
        decoupled = check_against_models(config, completed)
    except EnsembleConfigError as exc:
        raise ModelLoadError(f"failed to load {where}: {exc}") from None
    config.model_transaction_policy.decoupled = decoupled
    steps = []
    for step in config.ensemble_scheduling.step:
        model_config = completed[step.model_name]
        model = models[step.model_name]
        dims = {i.name: tuple(i.dims) for i in model_config.input}
        steps.append(_Step(
            model,
            model_config.max_batch_size > 0,
            tuple((k, v, dims[k]) for k, v in step.input_map.items()),
            dict(step.output_map),
            tuple(step.output_map),
            model.isolated,
            model.isolated and not isinstance(model, EnsembleModel),
        ))  # fmt: skip
    output_dims = {
        o.name: tuple(o.reshape.shape if o.HasField("reshape") else o.dims)
        for o in config.output
    }
    return EnsembleModel(
        repository, name=name, version=version, config=_schema.config_to_dict(config),
        spec=ModelSpec.from_config(config), isolated=isolated, decoupled=decoupled,
        timeout=timeout, steps=steps,
        optional_inputs=[i.name for i in config.input if i.optional],
        output_dims=output_dims,
    )  # fmt: skip
