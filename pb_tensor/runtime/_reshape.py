"""The configuration's ``reshape`` of outputs, applied to a model's responses as Triton core's
``InferenceResponse::AddOutput`` does (``Output::Reshape``): an output whose configuration has
``reshape { shape: [...] }`` reaches the caller with the configured ``dims`` (the batch
dimension kept, ``-1`` dims taken in order from the model's shape).

Triton checks nothing else about outputs: a dtype or a shape other than the configuration's
passes unchanged, an output that was not requested is dropped (the senders prune it), and a
requested output the model did not produce is just missing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from pb_tensor import Tensor, TritonDtype
from pb_tensor.errors import TritonModelException
from pb_tensor.runtime._seam import InferenceResponse, TritonError

__all__ = ["OutputReshapes", "output_reshapes", "renamed", "reshape_outputs"]

_Reshape = tuple[tuple[int, ...], tuple[int, ...]]
OutputReshapes = Mapping[str, _Reshape]
"""Output name -> (the model's shape ``reshape.shape``, the configured ``dims``)."""


def output_reshapes(config: Mapping[str, Any]) -> dict[str, _Reshape]:
    """The outputs of a configuration (``inference.ModelConfig`` as a dict) that have a
    ``reshape``."""
    found: dict[str, _Reshape] = {}
    for output in config.get("output", ()):
        reshape = output.get("reshape")
        if reshape:
            found[output["name"]] = (
                tuple(int(d) for d in reshape.get("shape", ())),
                tuple(int(d) for d in output.get("dims", ())),
            )
    return found


def _target_shape(
    shape: list[int], from_shape: tuple[int, ...], to_shape: tuple[int, ...], batched: bool
) -> list[int] | None:
    """Core's ``Output::Reshape``; None where it would read past the model's shape."""
    offset = 1 if batched else 0
    variable: list[int] = []
    for index, dim in enumerate(from_shape):
        if dim == -1:
            if index + offset >= len(shape):
                return None
            variable.append(shape[index + offset])
    target = [shape[0]] if batched and shape else []
    for dim in to_shape:
        if dim == -1:
            if not variable:
                return None
            target.append(variable.pop(0))
        else:
            target.append(dim)
    return target


def reshape_outputs(
    response: InferenceResponse, reshapes: OutputReshapes, batched: bool, model: str
) -> InferenceResponse:
    """``response`` with its reshaped outputs given the configured dims (the same response
    when none needs it). An output whose element count the configured dims cannot hold makes
    the response an error (Triton would send the dims over data of another size).

    Host tensors are reshaped as numpy views; GPU and BF16 outputs keep the model's shape (no
    host view to reshape here)."""
    tensors = response.output_tensors()
    if response.has_error() or not any(t.name() in reshapes for t in tensors):
        return response
    changed = False
    out: list[Tensor] = []
    for tensor in tensors:
        spec = reshapes.get(tensor.name())
        shape = list(tensor.shape())
        target = None if spec is None else _target_shape(shape, spec[0], spec[1], batched)
        if spec is None or target == shape:
            out.append(tensor)
            continue
        try:
            array = tensor.as_numpy()
        except TritonModelException:
            out.append(tensor)
            continue
        if target is None or array.size != _product(target):
            return InferenceResponse(
                error=TritonError(
                    f"output '{tensor.name()}' of model '{model}' has shape {shape}, which the "
                    f"configuration's reshape {list(spec[0])} -> dims {list(spec[1])} cannot "
                    "hold"
                )
            )
        out.append(Tensor(tensor.name(), array.reshape(target)))
        changed = True
    if not changed:
        return response
    parameters = json.loads(response.parameters() or "{}")
    return InferenceResponse(output_tensors=out, parameters=parameters or None)


def _product(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


# Data types whose CPU tensors are plain numpy arrays (BF16 is not: numpy has no bfloat16).
_VIEWABLE = frozenset(TritonDtype) - {TritonDtype.TYPE_BF16, TritonDtype.TYPE_BYTES,
                                      TritonDtype.TYPE_INVALID}


def renamed(tensor: Tensor, name: str, shape: tuple[int, ...] | None = None) -> Tensor:
    """``tensor`` named ``name`` (with ``shape``, same element count): itself when nothing
    changes, else a view of its data (BYTES is re-encoded: its wire form has no view).

    Raises:
        TritonModelException: ``shape`` does not fit, or the data cannot be viewed.
    """
    dtype = tensor.dtype
    if shape is None:
        if tensor.name() == name:
            return tensor
        if dtype in _VIEWABLE and tensor.is_cpu():
            # The same data under another name (a view: nothing copied or imported).
            return Tensor(name, tensor.as_numpy().view())
    have = tuple(tensor.shape())
    if shape is None:
        shape = have
    if tensor.name() == name and have == shape:
        return tensor
    try:
        if dtype is TritonDtype.TYPE_BYTES or (dtype in _VIEWABLE and tensor.is_cpu()):
            # Tensor() keeps a contiguous numpy view as it is (no copy).
            array = tensor.as_numpy()
            return Tensor(name, array.view() if have == shape else array.reshape(shape))
        if have == shape:
            return Tensor.from_dlpack(name, tensor)
        return Tensor.from_dlpack(name, np.asarray(tensor.as_numpy()).reshape(shape))
    except ValueError as exc:
        raise TritonModelException(
            f"cannot give tensor '{tensor.name()}' the name '{name}' and shape {list(shape)}: "
            f"{exc}"
        ) from None
