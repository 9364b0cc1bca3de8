"""Load-time validation of ensemble configurations, with Triton core's messages.

Three stages, in Triton's order:

* :func:`check_scheduling`: the ensemble's own configuration (``ValidateModelConfig`` and
  ``ValidateEnsembleSchedulingConfig`` / ``BuildEnsembleGraph`` in core's
  ``model_config_utils.cc``): platform and backend, steps with a model, an input map and an
  output map, every ensemble input used, every output written, no unused tensor.
* :func:`dependency_cycle`: ensembles that contain each other (the model repository
  manager's ``CircularDependencyCheck``).
* :func:`check_against_models`: the ensemble against the completed configurations of its
  composing models (``ValidateEnsembleConfig`` in core's ``ensemble_utils.cc``): inputs
  mapped exactly once, data type and shape agreement, ``max_batch_size`` limits, steps fed by
  different decoupled models. Returns whether the ensemble is decoupled (a decoupled step
  makes it so, as Triton sets it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pb_tensor.runtime._schema import ConfigError, validate_io

__all__ = [
    "ENSEMBLE_PLATFORM",
    "EnsembleConfigError",
    "check_against_models",
    "check_scheduling",
    "dependency_cycle",
    "step_models",
]

ENSEMBLE_PLATFORM = "ensemble"
_WILDCARD = -1


class EnsembleConfigError(Exception):
    """An ensemble configuration Triton refuses; ``str()`` is Triton's message."""


def step_models(config: Any) -> list[tuple[str, int]]:
    """The ``(model_name, model_version)`` of each step of an ensemble configuration."""
    return [(s.model_name, int(s.model_version)) for s in config.ensemble_scheduling.step]


# -- the ensemble's own configuration -----------------------------------------------------------
@dataclass(eq=False)
class _GraphTensor:
    name: str
    is_output: bool
    ready: bool = False
    prev: list[_GraphTensor] = field(default_factory=list)
    next: list[_GraphTensor] = field(default_factory=list)


def _build_graph(config: Any) -> dict[str, _GraphTensor]:
    graph: dict[str, _GraphTensor] = {}
    name = config.name
    for idx, step in enumerate(config.ensemble_scheduling.step):
        if not step.model_name:
            raise EnsembleConfigError(
                f"must specify 'model_name' in step {idx} of ensemble '{name}'")
        if len(step.input_map) == 0:
            raise EnsembleConfigError(
                f"must specify 'input_map' in step {idx} of ensemble '{name}'")
        if len(step.output_map) == 0:
            raise EnsembleConfigError(
                f"must specify 'output_map' in step {idx} of ensemble '{name}'")
        as_output = []
        for tensor in step.output_map.values():
            node = graph.get(tensor)
            if node is not None:
                if node.is_output:
                    raise EnsembleConfigError(
                        f"ensemble tensor '{tensor}' can appear in an output map only once "
                        f"for ensemble '{name}' step {idx}")
                node.is_output = True
            else:
                node = graph[tensor] = _GraphTensor(tensor, True)
            as_output.append(node)
        for tensor in step.input_map.values():
            node = graph.get(tensor)
            if node is None:
                node = graph[tensor] = _GraphTensor(tensor, False)
            for out in as_output:
                out.prev.append(node)
                node.next.append(out)
    return graph


def _check_io(ios: Sequence[Any], prefix: str, model: str) -> None:
    try:
        validate_io(ios, prefix, model)  # the same rules and texts as any model's
    except ConfigError as exc:
        raise EnsembleConfigError(str(exc)) from None


def check_scheduling(config: Any, dir_name: str) -> None:
    """Triton's checks of an ensemble's own configuration (no composing model needed).

    Raises:
        EnsembleConfigError: Triton's message for the first rule the configuration breaks.
    """
    name = config.name
    if config.backend and config.platform == ENSEMBLE_PLATFORM:
        raise EnsembleConfigError(
            f"Ensemble model '{name}' must have platform type '{config.platform}' and empty "
            "backend type")
    if config.max_batch_size < 0:
        raise EnsembleConfigError(f"'max_batch_size' must be non-negative value for {name}")
    _check_io(config.input, "model input ", name)
    _check_io(config.output, "model output ", name)
    if config.platform != ENSEMBLE_PLATFORM:
        raise EnsembleConfigError(
            f"ensemble scheduling cannot be set for model '{name}' whose platform is not "
            f"{ENSEMBLE_PLATFORM}")
    if not config.HasField("ensemble_scheduling"):
        raise EnsembleConfigError(
            f"ensemble scheduling must be set for ensemble {name} whose platform is "
            f"{ENSEMBLE_PLATFORM}")
    if len(config.instance_group) != 0:
        raise EnsembleConfigError(
            f"instance group should not be specified for ensemble '{name}'")
    if config.HasField("optimization"):
        raise EnsembleConfigError(f"optimization should not be specified for ensemble '{name}'")
    if len(config.model_warmup) != 0:
        raise EnsembleConfigError(f"model_warmup can not be specified for ensemble '{name}'")
    if len(config.ensemble_scheduling.step) == 0:
        raise EnsembleConfigError(f"must specify 'step' for ensemble '{name}'")
    graph = _build_graph(config)
    ready: deque[_GraphTensor] = deque()
    for io in config.input:
        node = graph.get(io.name)
        if node is None:
            raise EnsembleConfigError(
                f"ensemble input '{io.name}' for ensemble {name}' is not used")
        node.ready = True
        ready.append(node)
    while ready:
        current = ready.popleft()
        for nxt in current.next:
            if nxt.ready:
                continue
            nxt.ready = all(p.ready for p in nxt.prev)
            if nxt.ready:
                ready.append(nxt)
    outputs = set()
    for io in config.output:
        node = graph.get(io.name)
        if node is None:
            raise EnsembleConfigError(
                f"ensemble output '{io.name}' for ensemble {name}' is not used")
        if not node.ready:
            message = f"output '{io.name}' for ensemble '{name}' is not written"
            prev: list[_GraphTensor] | None = node.prev
            last = node
            seen: set[str] = set()
            while prev:
                nodes, prev = prev, None
                for p in nodes:
                    if not p.ready and p.name not in seen:
                        seen.add(p.name)
                        last = p
                        prev = p.prev
                        break
            if last is not node:
                message += (
                    f": at least one of its depending tensors, '{last.name}', is not connected")
            raise EnsembleConfigError(message)
        outputs.add(io.name)
    for tensor_name, node in graph.items():
        if tensor_name in outputs:
            continue
        if not node.ready or not node.next:
            raise EnsembleConfigError(
                f"ensemble tensor '{tensor_name}' is unused in ensemble '{name}'")
    if config.name != dir_name:
        raise EnsembleConfigError(
            f"unexpected directory name '{dir_name}' for model '{config.name}', directory "
            "name must equal model name")


def dependency_cycle(
    start: str, steps_of: Callable[[str], list[str] | None]
) -> EnsembleConfigError | None:
    """Triton's error when ensemble ``start`` depends on itself through its steps
    (``steps_of(name)``: the step model names of ensemble ``name``, None for other models),
    else None."""

    def visit(current: str, seen: set[str]) -> EnsembleConfigError | None:
        for upstream in dict.fromkeys(steps_of(current) or ()):
            if upstream == start:
                return EnsembleConfigError(
                    f"circular dependency between ensembles: {start} -> ... -> {current} -> "
                    f"{start}")
            if upstream in seen:
                continue
            seen.add(upstream)
            found = visit(upstream, seen)
            if found is not None:
                return found
        return None

    return visit(start, {start})


# -- the ensemble against its composing models ---------------------------------------------------
@dataclass(eq=False)
class _Node:
    model: str
    type: int
    dims: tuple[int, ...]
    full_dims: tuple[int, ...]
    decoupled: bool = False
    label: int = 0
    visited: bool = False
    prev: list[_Node] = field(default_factory=list)
    next: list[_Node] = field(default_factory=list)
    sibling: _Node | None = None


def _node(model: str, batching: bool, data_type: int, dims: Sequence[int]) -> _Node:
    d = tuple(int(x) for x in dims)
    return _Node(model, data_type, d, ((_WILDCARD,) if batching else ()) + d)


def _symbolic(model: str) -> _Node:
    return _Node(model, 0, (), ())


def _same_dims(a: Sequence[int], b: Sequence[int]) -> bool:
    return len(a) == len(b) and all(
        _WILDCARD in (x, y) or x == y for x, y in zip(a, b)
    )


def _dims(dims: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def _consistent(lhs: _Node, rhs: _Node, message: str, type_name: Callable[[int], str]) -> None:
    if lhs.type != rhs.type:
        raise EnsembleConfigError(
            f"{message}inconsistent data type: {type_name(lhs.type)} is inferred from model "
            f"{lhs.model} while {type_name(rhs.type)} is inferred from model {rhs.model}")
    if not _same_dims(lhs.dims, rhs.dims) and not _same_dims(lhs.full_dims, rhs.full_dims):
        raise EnsembleConfigError(
            f"{message}inconsistent shape: {_dims(lhs.full_dims)} is inferred from model "
            f"{lhs.model} while {_dims(rhs.full_dims)} is inferred from model {rhs.model}")


def _map_step(
    ensemble: str, step: Any, model: Any, tensors: dict[str, _Node],
    type_name: Callable[[int], str],
) -> None:
    step_id = step.model_name
    batching = model.max_batch_size > 0
    input_names = {i.name for i in model.input}
    for key, tensor in step.input_map.items():
        if key not in input_names:
            raise EnsembleConfigError(
                f"in ensemble {ensemble}, ensemble tensor {tensor} is mapping to non-existing "
                f"input {key} in model {step_id}")
    for model_input in model.input:
        mapped = 0
        for key, tensor in step.input_map.items():
            if key != model_input.name:
                continue
            mine = _node(step_id, batching, model_input.data_type, model_input.dims)
            found = tensors.get(tensor)
            if found is not None:
                _consistent(found, mine, f"in ensemble {ensemble}, ensemble tensor {tensor}: ",
                            type_name)
            else:
                tensors[tensor] = mine
            mapped += 1
        if mapped == 0 and not model_input.optional:
            raise EnsembleConfigError(
                f"in ensemble {ensemble}, input {model_input.name} in model {step_id} is not "
                "mapped to any ensemble tensors")
        if mapped > 1:
            raise EnsembleConfigError(
                f"in ensemble {ensemble}, input {model_input.name} in model {step_id} is "
                "mapped to multiple ensemble tensors")
    output_names = {o.name for o in model.output}
    for key, tensor in step.output_map.items():
        if key not in output_names:
            raise EnsembleConfigError(
                f"in ensemble {ensemble}, ensemble tensor {tensor} is mapped from non-existing "
                f"output {key} in model {step.model_name}")
    sibling = _symbolic(step_id)
    for key, tensor in step.output_map.items():
        for model_output in model.output:
            if model_output.name != key:
                continue
            mine = _node(step_id, batching, model_output.data_type, model_output.dims)
            found = tensors.get(tensor)
            if found is not None:
                _consistent(found, mine, f"in ensemble {ensemble}, ensemble tensor {tensor}: ",
                            type_name)
            else:
                found = tensors[tensor] = mine
            found.sibling = sibling
    decoupled = bool(model.model_transaction_policy.decoupled)
    for tensor in step.output_map.values():
        node = tensors[tensor]
        node.decoupled = decoupled
        for source in step.input_map.values():
            prev = tensors[source]
            node.prev.append(prev)
            prev.next.append(node)


def check_against_models(config: Any, models: dict[str, Any]) -> bool:
    """Validate ensemble ``config`` against the completed configurations of its composing
    models (``models``: step model name -> ``inference.ModelConfig``); whether the ensemble
    is decoupled (some step is).

    Raises:
        EnsembleConfigError: Triton's message for the first rule broken.
    """
    ensemble = config.name
    batching = config.max_batch_size > 0
    enum = config.input[0].DESCRIPTOR.fields_by_name["data_type"].enum_type if config.input \
        else config.output[0].DESCRIPTOR.fields_by_name["data_type"].enum_type

    def type_name(value: int) -> str:
        found = enum.values_by_number.get(value)
        return str(found.name) if found is not None else str(value)

    tensors: dict[str, _Node] = {}
    for io in config.input:
        dims = io.reshape.shape if io.HasField("reshape") else io.dims
        tensors.setdefault(io.name, _node(ensemble, batching, io.data_type, dims))
    sink = _symbolic(ensemble)
    for io in config.output:
        dims = io.reshape.shape if io.HasField("reshape") else io.dims
        node = tensors.setdefault(io.name, _node(ensemble, batching, io.data_type, dims))
        sink.prev.append(node)
        node.next.append(sink)
    for step in config.ensemble_scheduling.step:
        model = models[step.model_name]
        if 0 < model.max_batch_size < config.max_batch_size:
            raise EnsembleConfigError(
                f"ensemble {ensemble} allows maximum batch size {config.max_batch_size}, but "
                f"it contains model {step.model_name} which only allows maximum batch size to "
                f"be {model.max_batch_size}")
        _map_step(ensemble, step, model, tensors, type_name)
    label = 0
    current: deque[_Node] = deque()
    for io in config.input:
        node = tensors[io.name]
        node.visited = True
        current.append(node)
    while current:
        node = current[0]
        for nxt in node.next:
            if nxt.visited or not all(p.visited for p in nxt.prev):
                continue
            prev_label = nxt.prev[0].label
            for p in nxt.prev:
                if p.label != prev_label:
                    raise EnsembleConfigError(
                        f"in ensemble {ensemble}, step of model '{nxt.model}' receives inputs "
                        "originated from different decoupled models")
            sibling = nxt.sibling
            if sibling is not None:
                if sibling.visited:
                    nxt.label = sibling.label
                else:
                    if nxt.decoupled:
                        label += 1
                        nxt.label = label
                    else:
                        nxt.label = prev_label
                    sibling.label = nxt.label
                    sibling.visited = True
            elif nxt.decoupled:
                label += 1
                nxt.label = label
            else:
                nxt.label = prev_label
            nxt.visited = True
            current.append(nxt)
        current.popleft()
    return label != 0
