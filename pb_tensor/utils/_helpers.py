"""Small ``triton_python_backend_utils`` helpers: tensor lookup by name, model control and
the ``TRITONSERVER_*`` flag constants."""

from __future__ import annotations

from typing import Final

from pb_tensor.tensor import Tensor
from pb_tensor.utils._backend import get_backend
from pb_tensor.utils._request import InferenceRequest
from pb_tensor.utils._response import InferenceResponse

__all__ = [
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "get_input_tensor_by_name",
    "get_model_dir",
    "get_output_tensor_by_name",
    "is_model_ready",
    "load_model",
    "unload_model",
]

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START: Final = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END: Final = 2


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    """The input tensor of ``inference_request`` called ``name``, or None."""
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    """The output tensor of ``inference_response`` called ``name``, or None."""
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_model_dir() -> str:
    """The folder of the served model's ``model.py``: ``<repository>/<model>/<version>``, as
    Triton gives it.

    Raises:
        TritonModelException: no runtime serves a model here.
    """
    return get_backend().model_dir()


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) ``model_name`` from the repository of the model being served;
    ``config`` is a JSON model configuration overriding ``config.pbtxt``; ``files`` maps
    ``"file:<version>/<name>"`` paths to their content (Triton's override files).

    Raises:
        TypeError: ``model_name`` or ``config`` is not a str, or ``files`` not a dict.
        TritonModelException: no runtime serves a model here, or the runtime's load error.
    """
    if not isinstance(model_name, str):
        raise TypeError(f"load_model(): model_name must be a str, got {type(model_name).__name__}")
    if not isinstance(config, str):
        raise TypeError(f"load_model(): config must be a str, got {type(config).__name__}")
    if files is not None and not isinstance(files, dict):
        raise TypeError(f"load_model(): files must be a dict or None, got {type(files).__name__}")
    get_backend().load_model(model_name, config, files)


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload ``model_name``.

    Raises:
        TypeError: ``model_name`` is not a str or ``unload_dependents`` not a bool.
        TritonModelException: no runtime serves a model here, or the runtime's error.
    """
    if not isinstance(model_name, str):
        raise TypeError(
            f"unload_model(): model_name must be a str, got {type(model_name).__name__}"
        )
    if not isinstance(unload_dependents, bool):
        raise TypeError(
            "unload_model(): unload_dependents must be a bool, got "
            f"{type(unload_dependents).__name__}"
        )
    get_backend().unload_model(model_name, unload_dependents)


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether ``model_name`` (``model_version``; "" for the latest) is loaded and ready.

    Raises:
        TypeError: ``model_name`` or ``model_version`` is not a str.
        TritonModelException: no runtime serves a model here.
    """
    if not isinstance(model_name, str):
        raise TypeError(
            f"is_model_ready(): model_name must be a str, got {type(model_name).__name__}"
        )
    if not isinstance(model_version, str):
        raise TypeError(
            f"is_model_ready(): model_version must be a str, got {type(model_version).__name__}"
        )
    return get_backend().is_model_ready(model_name, model_version)
