"""The steps of an ensemble and the requests they get (core's ``EnsembleContext::InitStep``,
``ReshapeTensorDims`` and the sequence parameters of ``ConsumeResponse``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pb_tensor import Tensor, TritonDtype
from pb_tensor.runtime._errors import InferenceError
from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._reshape import renamed
from pb_tensor.runtime._seam import TritonError

if TYPE_CHECKING:
    from pb_tensor.runtime._model import LoadedModel
    from pb_tensor.runtime._validate import ModelSpec

__all__ = ["Override", "Step", "Value", "dataflow_order", "plain_request", "proven_outputs",
           "reshaped", "sequence_override", "step_request"]  # fmt: skip

log = logging.getLogger("pb_tensor.runtime")

_WILDCARD = -1
_SEQUENCE_START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
_SEQUENCE_END = 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
# Data types whose host tensors are plain numpy arrays an in-process engine takes as they are
# (BYTES needs the wire form's conversion, BF16 has no numpy type): a step's copies of these
# are made here, already named for the step.
_PLAIN = frozenset(TritonDtype) - {TritonDtype.TYPE_BF16, TritonDtype.TYPE_BYTES,
                                   TritonDtype.TYPE_INVALID}
_BYTES = TritonDtype.TYPE_BYTES

Override = tuple[int | str, int] | None
"""The correlation id and flags a step's response parameters set for the steps its outputs
feed (``sequence_id``, ``sequence_start``, ``sequence_end``), or None."""

Value = tuple[Tensor | None, int, Override]
"""An ensemble tensor's value: the tensor (None for an optional one left out), the batch size
of the request that made it (0: no batching), and its override."""


@dataclass(frozen=True)
class Step:
    """One step of an ensemble, resolved against its model."""

    model: LoadedModel
    batching: bool
    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]  # (model input, tensor, dims)
    outputs: dict[str, str]  # model output -> ensemble tensor
    requested: tuple[str, ...]
    pooled_inputs: bool  # the model runs in a stub: pooled tensors reach it as they are
    pooled_outputs: bool  # ... and answers with tensors in the pool
    # The requested outputs as the step model's validation gives them, when every request
    # the ensemble accepts gives this step a valid request (see proven_outputs); else None
    # and the step model validates each request as Triton does.
    proven: tuple[str, ...] | None = None
    # The requested outputs the step model's validation gives (None: some name is no output
    # of it, and the full validation gives Triton's error).
    checked: tuple[str, ...] | None = None
    # The model runs in this process (an in-process engine, not a nested ensemble): the
    # step's request can be made as that engine delivers inputs; ``copies``: it copies them
    # (``share_inputs`` off), as Triton copies every step's inputs into shared memory.
    in_process: bool = False
    copies: bool = False
    # The step model's data type for each of ``inputs`` when the load proved what else its
    # validation needs (it has no optional input, the step maps each of its inputs once and
    # the requested outputs are its own): a request whose inputs have these types, the same
    # batch size within ``max_batch_size`` and shapes that fit ``dims`` is valid. Else None.
    checks: tuple[TritonDtype, ...] | None = None
    max_batch_size: int = 0
    # Derived at load (__post_init__), for step_request's direct path: per input (model
    # input, ensemble tensor, data type, rank, (position, size) of each fixed dim) when the
    # step is an in-process, input-copying, non-batching model whose requests can be proven
    # valid (``checks``) and whose inputs are all of plain numeric types; else None.
    plain: tuple[tuple[str, str, TritonDtype, int, tuple[tuple[int, int], ...]], ...] | None = (
        field(init=False, repr=False, compare=False)
    )
    # The requested outputs of a request the direct path made (valid by construction).
    plain_requested: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        checks = self.checks
        requested = self.proven if self.proven is not None else self.checked
        plain = None
        if (
            self.in_process and self.copies and not self.batching and not self.pooled_inputs
            and checks is not None and requested is not None
            and all(dtype in _PLAIN for dtype in checks)
        ):  # fmt: skip
            plain = tuple(
                (model_input, tensor, dtype, len(dims),
                 tuple((pos, d) for pos, d in enumerate(dims) if d != _WILDCARD))
                for (model_input, tensor, dims), dtype in zip(self.inputs, checks)
            )  # fmt: skip
        object.__setattr__(self, "plain", plain)
        object.__setattr__(self, "plain_requested", requested or ())


def _same_dims(config: Sequence[int], shape: Sequence[int]) -> bool:
    return len(config) == len(shape) and all(
        c in (_WILDCARD, s) for c, s in zip(config, shape)
    )


def reshaped(
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


def proven_outputs(
    ensemble: ModelSpec, model: ModelSpec, batching: bool,
    inputs: Sequence[tuple[str, str, tuple[int, ...]]], requested: Sequence[str],
) -> tuple[str, ...] | None:
    """The requested outputs validation of a step's requests would give, when the ensemble's
    own validation proves every such request valid; None when it does not (the step model
    then validates each request).

    Proven only where each of the step's model inputs is mapped from a required ensemble
    input (no reshape) of the same data type whose dims fix every dim the model's fix, the
    model has no optional input and gets all its inputs, batching agrees and the ensemble's
    ``max_batch_size`` is within the model's: a tensor another step made is never proven
    (Triton checks no model's outputs), so its consumer validates it."""
    if not requested or not model.all_required or len(inputs) != len(model.table):
        return None
    if batching != (ensemble.max_batch_size > 0) or ensemble.max_batch_size > max(
        model.max_batch_size, 0
    ):
        return None
    given = {i.name: i for i in ensemble.inputs}
    for model_input, tensor, _ in inputs:
        source = given.get(tensor)
        entry = model.table.get(model_input)
        if source is None or entry is None or source.optional or source.reshape is not None:
            return None
        dtype, dims = entry
        if source.dtype != dtype or len(source.dims) != len(dims):
            return None
        if not all(want in (_WILDCARD, have) for want, have in zip(dims, source.dims)):
            return None
    known = model.output_list
    if any(name not in known for name in requested):
        return None
    return tuple(dict.fromkeys(requested))


def dataflow_order(steps: Sequence[Step], inputs: Iterable[str]) -> list[int]:
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


def sequence_override(parameters: str, correlation_id: int | str) -> Override:
    """The override a step response's parameters make (core's ``ConsumeResponse``).

    Raises:
        InferenceError: ``INVALID_ARG``, core's message, for a ``sequence_id`` that is no int
            or string, or a ``sequence_start`` / ``sequence_end`` that is no bool.
    """
    if parameters in ("{}", ""):
        return None
    found = json.loads(parameters)
    override = False
    flags = 0
    for name, value in found.items():
        if name == "sequence_id":
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise InferenceError(
                    "expected parameter 'sequence_id' to be TRITONSERVER_PARAMETER_INT or "
                    "TRITONSERVER_PARAMETER_STRING", TritonError.INVALID_ARG)
            correlation_id = value
            override = True
        elif name in ("sequence_start", "sequence_end"):
            if not isinstance(value, bool):
                raise InferenceError(
                    f"expect parameter '{name}' to be TRITONSERVER_PARAMETER_BOOL",
                    TritonError.INVALID_ARG)
            if value:
                flags |= _SEQUENCE_START if name == "sequence_start" else _SEQUENCE_END
            override = True
    return (correlation_id, flags) if override else None


def plain_request(
    step: Step, value: Callable[[str], Value], data: RequestData, owned: Set[str]
) -> RequestData | None:
    """``step_request``'s result for a step with a ``plain`` plan (its batch size is 0),
    when each input is present, unoverridden, without a batch dimension, on the host and of
    the data type and shape the step's model configures; None when any is not (the general
    path then makes the request, and the step model's validation its error).

    What the general path does for such inputs, without its per-input decisions: each
    tensor copied once under the step's input name, except the ones in ``owned``, which go
    as they are (renamed by a view when the names differ).
    """
    plan = step.plain
    if plan is None:
        return None
    # An ensemble input in ``owned`` is the ensemble request's own validated copy (no
    # override, no batch dimension: the step does not batch); for a step whose requests
    # the ensemble's validation proves valid it needs no check either.
    proven = step.proven is not None
    inputs = []
    for model_input, tensor_name, dtype, rank, fixed in plan:
        tensor, tensor_batch, override = value(tensor_name)
        if proven and tensor_name in owned and tensor is not None:
            inputs.append(
                tensor if tensor.name() == model_input else renamed(tensor, model_input)
            )
            continue
        if (
            tensor is None or override is not None or tensor_batch
            or tensor.dtype is not dtype or not tensor.is_cpu()
        ):  # fmt: skip
            return None
        array = tensor.as_numpy()
        shape = array.shape
        if len(shape) != rank:
            return None
        for pos, size in fixed:
            if shape[pos] != size:
                return None
        if tensor_name in owned:
            inputs.append(
                tensor if tensor.name() == model_input else renamed(tensor, model_input)
            )
        else:
            inputs.append(Tensor(model_input, array.copy()))
    return RequestData(inputs, list(step.plain_requested), data.request_id,
                       data.correlation_id, data.flags, data.parameters, data.timeout_us,
                       True, None, True)  # fmt: skip


def step_request(
    step: Step,
    value: Callable[[str], Value],
    pooled_ids: set[int],
    data: RequestData,
    owned: Set[str] = frozenset(),
    *,
    plain: bool = True,
) -> tuple[RequestData, int]:
    """Core's ``InitStep``: the request of ``step`` (``value(tensor)``: an ensemble tensor's
    value), and its batch size.

    For a model in this process the request is made as its engine delivers inputs: each host
    tensor of a plain numeric type is copied here, once, under the step's input name (what
    the engine would otherwise do after a renaming view), except the ensemble tensors in
    ``owned``: copies the ensemble request made of the caller's arrays that this step alone
    reads (see ``EnsembleModel``), which need no second copy. A BYTES, BF16 or device tensor
    leaves the request to the engine's own delivery, as before. The step's request is marked
    validated when the ensemble's validation proved it (``Step.proven``) or its inputs pass
    the quick check of the step model's configuration; anything else is validated in full by
    the step model, with Triton's messages. A step with a ``plain`` plan takes
    :func:`plain_request` first (``plain=False``: the caller tried it already).

    Raises:
        TritonModelException: a tensor cannot be given the step's name or shape.
    """
    if plain and step.plain is not None:
        direct = plain_request(step, value, data, owned)
        if direct is not None:
            return direct, 0
    inputs = []
    batch_size = 0
    correlation_id = data.correlation_id
    flags = data.flags
    overridden = False
    # A stub's outputs are in the pool already: the next stub gets the same records and
    # names them itself (nothing copied); a reshape needs a new record.
    pooled: list[Tensor] | None = [] if step.pooled_inputs else None
    renaming = False
    delivered = step.in_process
    copies = step.copies
    checks = step.checks
    valid = checks is not None
    batch = -1
    for index, (model_input, tensor_name, dims) in enumerate(step.inputs):
        tensor, tensor_batch, override = value(tensor_name)
        if override is not None:
            if overridden and override != (correlation_id, flags):
                log.error(
                    "[request id: %s] Different set of response parameters are set for '%s'. "
                    "Parameter correlation ID %s, flags %s is used.",
                    data.request_id or "<id_unknown>", step.model.name, correlation_id, flags)
            else:
                correlation_id, flags = override
                overridden = True
        if tensor is None:
            valid = False  # the step model validates a request missing an input
            continue  # an optional input the request left out
        if step.batching == (tensor_batch != 0):  # no batch dimension to add or strip
            shape = None
            if step.batching and not batch_size:
                batch_size = tensor_batch
        else:
            have = tuple(tensor.shape())
            shape = reshaped(dims, step.batching, tensor_batch, have)
            if shape == have:
                shape = None
            if step.batching and not batch_size:
                reached = have if shape is None else shape
                if reached:
                    batch_size = reached[0]
        dtype = tensor.dtype
        if (
            delivered and copies and tensor_name not in owned
            and dtype in _PLAIN and tensor.is_cpu()
        ):  # fmt: skip
            # The step's own copy, named (and shaped) for it: one tensor, where a renaming
            # view and the engine's copy of it made two.
            array = tensor.as_numpy()
            if shape is not None:
                array = array.reshape(shape)
            view = Tensor(model_input, array.copy())
            got: Sequence[int] = array.shape
        else:
            if delivered and (
                dtype is _BYTES or (copies and tensor_name not in owned)
            ):  # fmt: skip
                # The engine delivers this request (a BYTES tensor's wire form; a copy of
                # a BF16 or device tensor), as it delivers any other.
                delivered = False
            if shape is None:
                view = tensor if tensor.name() == model_input else renamed(tensor, model_input)
            else:
                view = renamed(tensor, model_input, shape)
            if not copies and dtype in _PLAIN and view.is_cpu():
                # Shared as it is (share_inputs): Triton hands each step a buffer of its
                # own, which the model may write into and export through DLPack; data a
                # step cannot write (a read-only output of the step before) goes as a copy.
                array = view.as_numpy()
                if not array.flags.writeable:
                    view = Tensor(model_input, array.copy())
            got = view.shape() if valid else ()
        inputs.append(view)
        if valid and checks is not None:
            # What validate_request's success path checks (its quick check), with the data
            # type and shape at hand: a failure leaves the request to the full validation.
            if dtype is not checks[index]:
                valid = False
            else:
                if step.batching:
                    if not got or (batch >= 0 and got[0] != batch):
                        valid = False
                    else:
                        batch = got[0]
                        got = got[1:]
                if len(got) != len(dims):
                    valid = False
                else:
                    for need, size in zip(dims, got):
                        if need not in (_WILDCARD, size):
                            valid = False
                            break
        if pooled is not None:
            if view is tensor:
                pooled.append(tensor)
            elif shape is None and id(tensor) in pooled_ids:
                pooled.append(tensor)
                renaming = True
            else:
                pooled = None
    requested: Sequence[str]
    if step.proven is not None:
        requested, validated = step.proven, True
    elif valid and step.checked is not None and batch <= step.max_batch_size:
        requested, validated = step.checked, True
    else:
        requested, validated = step.requested, False
    request = RequestData(inputs, list(requested), data.request_id, correlation_id, flags,
                          data.parameters, data.timeout_us, validated,
                          pooled=pooled if renaming else None,
                          delivered=delivered)  # fmt: skip
    return request, batch_size
