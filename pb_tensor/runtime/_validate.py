"""Request validation against the model configuration, with Triton core's messages.

Follows ``InferenceRequest::Normalize`` (requested outputs, input count, unknown inputs,
batch dimension, data type, shape with ``-1`` wildcards) in Triton's order, so that a request
fails here the way it fails in Triton.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pb_tensor import Tensor, TritonDtype, triton_to_numpy_type
from pb_tensor.runtime._errors import InferenceError, RequestRefused
from pb_tensor.runtime._seam import TritonError

__all__ = [
    "IOSpec",
    "ModelSpec",
    "array_tensors",
    "arrays_ok",
    "known_outputs",
    "validate_request",
]

_WILDCARD = -1
_from_dlpack = Tensor.from_dlpack


@dataclass(frozen=True)
class IOSpec:
    """One configured input or output."""

    name: str
    dtype: TritonDtype
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ModelSpec:
    """What request validation needs from a configuration."""

    name: str
    max_batch_size: int
    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]
    # Derived in __post_init__: what the success path of validate_request reads.
    table: dict[str, tuple[TritonDtype, tuple[int, ...]]] = field(
        init=False, repr=False, compare=False
    )
    all_required: bool = field(init=False, repr=False, compare=False)
    output_list: list[str] = field(init=False, repr=False, compare=False)
    output_set: frozenset[str] = field(init=False, repr=False, compare=False)
    # name -> (numpy dtype, rank, ((position, size), ...) of the fixed dims): what arrays_ok
    # reads; None when some input is optional or has no numpy type an array can carry as is.
    array_table: dict[str, tuple[np.dtype[Any], int, tuple[tuple[int, int], ...]]] | None = (
        field(init=False, repr=False, compare=False)
    )

    @classmethod
    def from_config(cls, config: Any) -> ModelSpec:
        """Build from an ``inference.ModelConfig`` message."""

        def io(m: Any, optional: bool) -> IOSpec:
            reshape = tuple(m.reshape.shape) if m.HasField("reshape") else None
            return IOSpec(m.name, TritonDtype(m.data_type), tuple(m.dims), optional, reshape)

        return cls(
            config.name,
            int(config.max_batch_size),
            tuple(io(m, bool(m.optional)) for m in config.input),
            tuple(io(m, False) for m in config.output),
        )

    def __post_init__(self) -> None:
        # The success path of validate_request reads only these.
        table = {i.name: (i.dtype, i.dims) for i in self.inputs}
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "all_required", not any(i.optional for i in self.inputs))
        object.__setattr__(self, "output_list", [o.name for o in self.outputs])
        object.__setattr__(self, "output_set", frozenset(self.output_list))
        object.__setattr__(self, "array_table", _array_table(self))

    @property
    def output_names(self) -> list[str]:
        """Configured output names, in order."""
        return list(self.output_list)


def _array_table(
    spec: ModelSpec,
) -> dict[str, tuple[np.dtype[Any], int, tuple[tuple[int, int], ...]]] | None:
    if not spec.all_required:
        return None
    table = {}
    for i in spec.inputs:
        if i.dtype in (TritonDtype.TYPE_BYTES, TritonDtype.TYPE_BF16):
            return None
        np_type = triton_to_numpy_type(i.dtype)
        if np_type is None:
            return None
        dtype = np.dtype(np_type)
        if dtype.kind not in "biuf":
            return None
        fixed = tuple((pos, d) for pos, d in enumerate(i.dims) if d != _WILDCARD)
        table[i.name] = (dtype, len(i.dims), fixed)
    return table


def array_tensors(
    spec: ModelSpec, inputs: Mapping[str, object], copy: bool = False
) -> list[Tensor] | None:
    """The inputs as tensors when they are numpy arrays that make a valid request, decided
    with a few lookups per input; None also when unsure (the caller then makes the tensors
    its general way and runs :func:`validate_request`, which finds the error or accepts).

    Only arrays of the configured dtype itself (numpy's own dtype object, native byte order)
    qualify: their tensors have exactly the configured data type and the arrays' shapes, so
    this accepts nothing :func:`validate_request` would refuse. A C-contiguous array is
    wrapped through ``Tensor.from_dlpack`` (the same zero-copy tensor ``Tensor()`` makes,
    with fewer checks); ``Tensor()`` copies any other, as upstream does. With ``copy``, each
    tensor holds a C-contiguous copy of its array instead (what an in-process model that
    copies its inputs receives), made in one step.
    """
    table = spec.array_table
    if table is None or len(inputs) != len(table):
        return None
    limit = spec.max_batch_size
    batch = 0  # as Triton: a batch size of 0 counts as not yet known
    tensors = []
    for name, value in inputs.items():
        entry = table.get(name)
        if entry is None or type(value) is not np.ndarray or value.dtype is not entry[0]:
            return None
        shape = value.shape
        if limit > 0:
            if not shape:
                return None
            if batch == 0:
                batch = shape[0]
            elif shape[0] != batch:
                return None
            shape = shape[1:]
        if len(shape) != entry[1]:
            return None
        for pos, size in entry[2]:
            if shape[pos] != size:
                return None
        if copy:
            tensors.append(Tensor(name, value.copy()))
        else:
            tensors.append(
                _from_dlpack(name, value) if value.flags.c_contiguous else Tensor(name, value)
            )
    return tensors if batch <= limit else None


def known_outputs(spec: ModelSpec, requested: Sequence[object]) -> list[str] | None:
    """The output names a request asking for ``requested`` gets (each once, in the order
    asked), when every one of them is a configured output's name; None otherwise (then
    :func:`validate_request` gives the error)."""
    names = spec.output_set
    wanted: dict[str, None] = {}
    for name in requested:
        if type(name) is not str or name not in names:
            return None
        wanted[name] = None
    return list(wanted)


def arrays_ok(spec: ModelSpec, inputs: Mapping[str, object]) -> bool:
    """Whether :func:`array_tensors` accepts ``inputs``."""
    return array_tensors(spec, inputs) is not None


def _quick_ok(spec: ModelSpec, inputs: Sequence[Tensor]) -> bool:
    """Whether the request is valid, decided cheaply; False also when unsure (the full check
    then finds the error, or accepts)."""
    table = spec.table
    if not spec.all_required or len(inputs) != len(table):
        return False
    batching = spec.max_batch_size > 0
    batch = -1
    seen = set()
    for t in inputs:
        name = t.name()
        entry = table.get(name)
        if entry is None or name in seen or t.dtype != entry[0]:
            return False
        seen.add(name)
        shape = t.shape()
        if batching:
            if not shape or (batch >= 0 and shape[0] != batch):
                return False
            batch = shape[0]
            shape = shape[1:]
        dims = entry[1]
        if len(shape) != len(dims):
            return False
        for want, have in zip(dims, shape):
            if want not in (_WILDCARD, have):
                return False
    return batch <= spec.max_batch_size


def _dims(dims: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def _fail(message: str, request_id: str, *, prefix: bool = True) -> InferenceError:
    tag = f"[request id: {request_id or '<id_unknown>'}] " if prefix else ""
    return RequestRefused(tag + message, TritonError.INVALID_ARG)


def validate_request(
    spec: ModelSpec,
    inputs: Sequence[Tensor],
    requested_outputs: Sequence[str] | None,
    request_id: str = "",
) -> list[str]:
    """Check one request; the output names it asks for (all configured ones by default).

    Raises:
        InferenceError: ``INVALID_ARG`` with Triton's message: an unknown requested output,
            too few or too many inputs, an unknown input, a missing batch dimension, batch
            sizes that differ or exceed ``max_batch_size``, a data type or shape that does
            not match the configuration.
    """
    model = spec.name
    if requested_outputs is None or len(requested_outputs) == 0:
        wanted = spec.output_names
    else:
        known = spec.output_list
        for name in requested_outputs:
            if name not in known:
                raise _fail(f"unexpected inference output '{name}' for model '{model}'",
                            request_id, prefix=False)
        wanted = list(dict.fromkeys(requested_outputs))
    if _quick_ok(spec, inputs):
        return wanted

    given = {t.name(): t for t in inputs}
    required = sum(1 for i in spec.inputs if not i.optional)
    if len(given) > len(spec.inputs) or len(given) < required:
        missing = [f"'{i.name}'" for i in spec.inputs if not i.optional and i.name not in given]
        got = "[" + ",".join(f"'{n}'" for n in given) + "]"
        need = "[" + ",".join(missing) + "]"
        if required == len(spec.inputs):
            head = f"expected {len(spec.inputs)} inputs"
        else:
            head = f"expected number of inputs between {required} and {len(spec.inputs)}"
        raise _fail(
            f"{head} but got {len(given)} inputs for model '{model}'. Got input(s) {got}, but "
            f"missing required input(s) {need}. Please provide all required input(s).",
            request_id,
        )
    by_name = {i.name: i for i in spec.inputs}
    for name in given:
        if name not in by_name:
            raise _fail(f"unexpected inference input '{name}' for model '{model}'", request_id,
                        prefix=False)

    batch = 0
    if spec.max_batch_size > 0:
        for name, t in given.items():
            shape = t.shape()
            if not shape:
                raise _fail(
                    f"input '{name}' has no shape but model requires batch dimension for "
                    f"'{model}'", request_id)
            if batch == 0:
                batch = shape[0]
            elif shape[0] != batch:
                raise _fail(
                    f"input '{name}' batch size does not match other inputs for '{model}'",
                    request_id)
    if batch > spec.max_batch_size:
        raise _fail(
            f"inference request batch-size must be <= {spec.max_batch_size} for '{model}'",
            request_id)

    for name, t in given.items():
        config = by_name[name]
        dtype = t.dtype
        if dtype != config.dtype:
            raise _fail(
                f"inference input '{name}' data-type is '{dtype.wire_name}', but model "
                f"'{model}' expects '{config.dtype.wire_name}'", request_id)
        full = t.shape()
        shape = full[1:] if spec.max_batch_size > 0 else full
        ok = len(shape) == len(config.dims)
        if ok:
            for want, have in zip(config.dims, shape):
                if want not in (_WILDCARD, have):
                    ok = False
                    break
        if not ok:
            expected = (_WILDCARD, *config.dims) if spec.max_batch_size > 0 else config.dims
            note = ""
            if spec.max_batch_size > 0:
                note = (
                    "NOTE: Setting a non-zero max_batch_size in the model config requires a "
                    "batch dimension to be prepended to each input shape. If you want to "
                    "specify the full shape including the batch dim in your input dims config, "
                    "try setting max_batch_size to zero. See the model configuration docs for "
                    "more info on max_batch_size."
                )
            raise _fail(
                f"unexpected shape for input '{name}' for model '{model}'. Expected "
                f"{_dims(expected)}, got {_dims(full)}. {note}", request_id)
    return wanted
