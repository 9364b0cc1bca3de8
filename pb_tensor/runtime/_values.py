"""Values at the runtime's edges: what ``infer`` accepts as inputs (:func:`to_tensor`), the
arrays it returns (:func:`outputs_of`), and the responses BLS callers receive
(:func:`response_of`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

import dlpack_ctypes
from pb_tensor import Tensor, TritonDtype, bytes_codec
from pb_tensor.errors import TritonModelException
from pb_tensor.runtime._placement import place
from pb_tensor.runtime._seam import InferenceResponse, PreferredMemory, TritonError
from pb_tensor.runtime._tracker import Reply

__all__ = [
    "InputValue",
    "as_delivered",
    "first_response",
    "Outputs",
    "ParameterValue",
    "RequestParameterValue",
    "outputs_of",
    "response_of",
    "to_tensor",
]

# Enum members read through their class cost ~0.1 us each on Python 3.11: once, here.
_BF16 = TritonDtype.TYPE_BF16
_BYTES = TritonDtype.TYPE_BYTES
_BF16_DL = dlpack_ctypes.DataType(dlpack_ctypes.DLDataTypeCode.kDLBfloat, 16, 1)

InputValue = Any
"""An input value: a ``Tensor``, a numpy array, anything with ``__dlpack__`` (torch, JAX),
or what ``numpy.asarray`` accepts (lists of numbers, of ``str`` or ``bytes`` for BYTES)."""

ParameterValue = bool | int | str
"""A response parameter (what a model's ``InferenceResponse`` may carry)."""

RequestParameterValue = bool | int | float | str
"""A request parameter: Triton's bool, int64, double and string parameters (a model's
``request.parameters()`` gives them as JSON)."""


class Outputs(dict[str, npt.NDArray[Any]]):
    """A response's outputs by name: numpy arrays (zero-copy views of the response's memory;
    BYTES outputs are ``object`` arrays of ``bytes``). ``parameters`` holds the response
    parameters the model set (``InferenceResponse(..., parameters={...})``): a dict of
    ``str`` to ``bool``/``int``/``str``, empty when it set none. ``final`` says whether this
    response carried the final flag (``TRITONSERVER_RESPONSE_COMPLETE_FINAL``): always True
    for a non-decoupled model's response; for a decoupled model's responses, True only on the
    one sent as ``response_sender.send(response, flags=FINAL)`` (a model that ends with a
    flags-only ``send(flags=FINAL)`` gives no response carrying it). Triton's gRPC front end
    reports it as the ``triton_final_response`` parameter."""

    __slots__ = ("final", "parameters")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parameters: dict[str, ParameterValue] = {}
        self.final = True


def to_tensor(name: str, value: InputValue, dtype: Any = None) -> Tensor:
    """An input value as a ``Tensor`` named ``name`` (zero-copy where the value allows).

    Plain Python values (numbers, lists) take ``dtype`` (the configured numpy type), as a
    JSON request body does in Triton; arrays and tensors keep their own. An
    ``ml_dtypes.bfloat16`` array becomes a BF16 tensor, as a Triton client sends it.

    Raises:
        TritonModelException: a dtype Triton has no type for.
    """
    if type(value) is np.ndarray and value.dtype.kind in "biuf":
        return Tensor(name, value)  # the common case, first
    if isinstance(value, Tensor):
        if value.name() == name:
            return value
        if value.dtype is _BYTES:
            return Tensor(name, value.as_numpy())  # DLPack carries no strings
        # The same memory under the input's name: GPU and BF16 tensors have no numpy view.
        return Tensor.from_dlpack(name, value)
    if isinstance(value, np.ndarray):
        if value.dtype.name == "bfloat16":
            # ml_dtypes' bfloat16, what a Triton client sends as BF16.
            return _bf16_tensor(name, value)
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


def as_delivered(tensors: list[Tensor], *, copy: bool = False) -> list[Tensor]:
    """``tensors`` as Triton delivers them across processes (what isolated mode does by
    itself): a BYTES tensor holding anything but ``bytes`` objects (``str``, ``np.bytes_``,
    an ``S`` array, numbers) becomes the object array of ``bytes`` its wire format gives.
    With ``copy``, every host tensor is also copied, as Triton copies a request's inputs into
    shared memory: a model writing into its inputs does not change the caller's arrays. GPU
    tensors pass as they are. The list is returned as is when nothing changes."""
    out = tensors
    for i, tensor in enumerate(tensors):
        dtype = tensor.dtype
        if dtype is _BYTES:
            array = tensor.as_numpy()
            if array.dtype.kind == "O" and all(type(x) is bytes for x in array.flat):
                if not copy:
                    continue
                new = Tensor(tensor.name(), array.copy())
            else:
                wire = bytes_codec.deserialize(bytes_codec.serialize(array), array.size)
                new = Tensor(tensor.name(), wire.reshape(array.shape))
        elif copy and tensor.is_cpu():
            try:
                array = tensor.as_numpy().copy()  # C-contiguous, as every tensor's array
            except TritonModelException:  # BF16 without ml_dtypes: nothing to copy it with
                continue
            new = _bf16_tensor(tensor.name(), array) if dtype is _BF16 else Tensor(
                tensor.name(), array
            )
        else:
            continue
        if out is tensors:
            out = list(tensors)
        out[i] = new
    return out


def _bf16_tensor(name: str, array: npt.NDArray[Any]) -> Tensor:
    """A BF16 tensor over an ``ml_dtypes.bfloat16`` array (zero-copy; numpy cannot export that
    dtype through DLPack, so the memory is exported as such here)."""
    array = np.ascontiguousarray(array)
    capsule = dlpack_ctypes.export_buffer(
        array, array.ctypes.data, array.shape, None, _BF16_DL, readonly=not array.flags.writeable
    )
    return Tensor.from_dlpack(name, capsule)


def outputs_of(reply: Reply) -> Outputs:
    """The numpy arrays of a reply's tensors, by name, with the response's parameters; GPU
    tensors are copied to the host (what a client of Triton receives).

    Raises:
        TritonModelException: a GPU tensor and no usable CUDA to copy it, or a BF16 tensor
            without ``ml_dtypes``.
    """
    out = Outputs()
    try:
        for t in reply.tensors:
            out[t.name()] = t.as_numpy()
    except TritonModelException:
        out = Outputs({t.name(): t.to_host().as_numpy() for t in reply.tensors})
    if reply.parameters not in ("{}", ""):
        out.parameters = json.loads(reply.parameters)
    return out


def first_response(responses: Iterable[InferenceResponse]) -> InferenceResponse:
    """A non-decoupled BLS request's answer: the first of its responses (the others are
    read to the end, so the request completes), or an empty response when none came."""
    first: InferenceResponse | None = None
    for response in responses:
        if first is None:
            first = response
    return first if first is not None else InferenceResponse()


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
