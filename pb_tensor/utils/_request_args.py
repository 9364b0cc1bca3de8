"""Argument checks of the ``InferenceRequest`` constructor, with upstream's errors."""

from __future__ import annotations

from collections.abc import Sequence

from pb_tensor.errors import TritonModelException
from pb_tensor.tensor import Tensor
from pb_tensor.utils._types import UINT64_MAX, check_int

__all__ = ["check_correlation_id", "check_inputs", "check_requested_names"]


def check_inputs(inputs: object, request_id: str, model_name: str) -> list[Tensor]:
    """``inputs`` as a new list of ``Tensor``.

    Raises:
        TypeError: not a sequence of ``Tensor``.
        TritonModelException: an item is None (upstream's message).
    """
    if type(inputs) is list and all(type(t) is Tensor for t in inputs):
        return list(inputs)  # the common case, without the ABC checks
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise TypeError(
            f"InferenceRequest(): inputs must be a list of Tensor, got {type(inputs).__name__}"
        )
    checked = list(inputs)
    for item in checked:
        if item is None:
            raise TritonModelException(
                f"Input tensor for request with id '{request_id}' and model name "
                f"'{model_name}' should not be empty."
            )
        if not isinstance(item, Tensor):
            raise TypeError(
                f"InferenceRequest(): inputs must be a list of Tensor, found {type(item).__name__}"
            )
    return checked


def check_requested_names(names: object, request_id: str, model_name: str) -> set[str]:
    """``names`` as a set of output names.

    Raises:
        TypeError: not a sequence (or set) of ``str``.
        TritonModelException: an empty name (upstream's message).
    """
    if type(names) is list and all(type(n) is str and n for n in names):
        return set(names)  # the common case, without the ABC checks
    if isinstance(names, (str, bytes)) or not isinstance(names, (Sequence, set, frozenset)):
        raise TypeError(
            "InferenceRequest(): requested_output_names must be a list of str, got "
            f"{type(names).__name__}"
        )
    checked: set[str] = set()
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                "InferenceRequest(): requested_output_names must be a list of str, found "
                f"{type(name).__name__}"
            )
        if name == "":
            raise TritonModelException(
                f"Requested output name for request with id '{request_id}' and model name "
                f"'{model_name}' should not be empty."
            )
        checked.add(name)
    return checked


def check_correlation_id(value: object) -> int | str:
    """A correlation id: an int in the uint64 range or a str.

    Raises:
        TypeError: None, or an int out of range (pybind's refusals).
        TritonModelException: any other type (upstream's message).
    """
    if value is None:
        # pybind refuses None before upstream's own check runs.
        raise TypeError("InferenceRequest(): correlation_id must be an int or a str, got NoneType")
    if isinstance(value, str):
        return value
    if isinstance(value, int):  # bool included, as pybind's int check accepts it
        return check_int(int(value), "InferenceRequest(): correlation_id", 0, UINT64_MAX)
    raise TritonModelException("Correlation ID must be integer or string")
