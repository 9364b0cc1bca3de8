"""Values at the runtime's edges: what ``infer`` accepts as inputs (:func:`to_tensor`), the
arrays it returns (:func:`outputs_of`), and the responses BLS callers receive
(:func:`response_of`)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt

from pb_tensor import Tensor, TritonDtype
from pb_tensor.errors import TritonModelException
from pb_tensor.runtime._placement import place
from pb_tensor.runtime._seam import InferenceResponse, PreferredMemory, TritonError
from pb_tensor.runtime._tracker import Reply

__all__ = [
    "InputValue",
    "Outputs",
    "ParameterValue",
    "outputs_of",
    "response_of",
    "to_tensor",
]

InputValue = Any
"""An input value: a ``Tensor``, a numpy array, anything with ``__dlpack__`` (torch, JAX),
or what ``numpy.asarray`` accepts (lists of numbers, of ``str`` or ``bytes`` for BYTES)."""

ParameterValue = bool | int | str


class Outputs(dict[str, npt.NDArray[Any]]):
    """A response's outputs by name: numpy arrays (zero-copy views of the response's memory;
    BYTES outputs are ``object`` arrays of ``bytes``). ``parameters`` holds the response
    parameters the model set (``InferenceResponse(..., parameters={...})``): a dict of
    ``str`` to ``bool``/``int``/``str``, empty when it set none."""

    __slots__ = ("parameters",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parameters: dict[str, ParameterValue] = {}


def to_tensor(name: str, value: InputValue, dtype: Any = None) -> Tensor:
    """An input value as a ``Tensor`` named ``name`` (zero-copy where the value allows).

    Plain Python values (numbers, lists) take ``dtype`` (the configured numpy type), as a
    JSON request body does in Triton; arrays and tensors keep their own.

    Raises:
        TritonModelException: a dtype Triton has no type for.
    """
    if type(value) is np.ndarray and value.dtype.kind in "biuf":
        return Tensor(name, value)  # the common case, first
    if isinstance(value, Tensor):
        if value.name() == name:
            return value
        if value.triton_dtype() is TritonDtype.TYPE_BYTES:
            return Tensor(name, value.as_numpy())  # DLPack carries no strings
        # The same memory under the input's name: GPU and BF16 tensors have no numpy view.
        return Tensor.from_dlpack(name, value)
    if isinstance(value, np.ndarray):
        array = value
    elif hasattr(value, "__dlpack__") and not isinstance(value, (bytes, str)):
        return Tensor.from_dlpack(name, value)
    else:
        array = np.asarray(value)
        if (
            dtype is not None
            and array.dtype.kind in "biuf"
            and np.can_cast(array.dtype, dtype, casting="same_kind")
        ):
            array = array.astype(dtype)
    if array.dtype.kind == "U" or (
        array.dtype.kind == "O" and any(isinstance(x, str) for x in array.flat)
    ):
        # Text reaches models as Triton delivers BYTES: bytes objects (UTF-8).
        array = np.array(
            [x.encode("utf-8") if isinstance(x, str) else x for x in array.flat], dtype=object
        ).reshape(array.shape)
    return Tensor(name, array)


def outputs_of(reply: Reply) -> Outputs:
    """The numpy arrays of a reply's tensors, by name, with the response's parameters; GPU
    tensors are copied to the host (what a client of Triton receives).

    Raises:
        TritonModelException: a GPU tensor and no usable CUDA to copy it, or a BF16 tensor
            without ``ml_dtypes``.
    """
    try:
        out = Outputs({t.name(): t.as_numpy() for t in reply.tensors})
    except TritonModelException:
        out = Outputs({t.name(): t.to_host().as_numpy() for t in reply.tensors})
    if reply.parameters not in ("{}", ""):
        out.parameters = json.loads(reply.parameters)
    return out


def response_of(reply: Reply, preferred: PreferredMemory | None = None) -> InferenceResponse:
    """A reply as the ``InferenceResponse`` a BLS caller receives, its outputs placed as
    ``preferred`` asks (:func:`~pb_tensor.runtime._placement.place`); a failed copy makes it
    an error response."""
    error = None
    if reply.error is not None:
        error = TritonError(reply.error.message(), reply.error.code())
    params = json.loads(reply.parameters) if reply.parameters else None
    tensors = reply.tensors
    if preferred is not None and tensors:
        try:
            tensors = place(tensors, preferred)
        except TritonModelException as exc:
            return InferenceResponse(error=TritonError(str(exc)), parameters=params or None)
    return InferenceResponse(output_tensors=tensors, error=error, parameters=params or None)
