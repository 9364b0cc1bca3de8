"""The whole ``triton_python_backend_utils`` surface, typed, for running and testing Triton
Python models without a server.

Model code imports it under Triton's name::

    import triton_python_backend_utils as pb_utils

which works inside models loaded by :mod:`pb_tensor.runtime`, and anywhere after
:func:`install`. Typed code may import it directly (``from pb_tensor import utils as
pb_utils``). BLS (``InferenceRequest.exec``), model control and ``get_model_dir`` need a model
served by the runtime; everything else works standalone.
"""

from __future__ import annotations

import sys
import types

from pb_tensor.bytes_codec import deserialize_bytes_tensor, serialize_byte_tensor
from pb_tensor.dtypes import (
    TRITON_STRING_TO_NUMPY,
    numpy_to_triton_type,
    triton_string_to_numpy,
    triton_to_numpy_type,
)
from pb_tensor.errors import TritonModelException
from pb_tensor.tensor import Tensor
from pb_tensor.utils._config import (
    ModelConfig,
    get_input_config_by_name,
    get_output_config_by_name,
    using_decoupled_model_transaction_policy,
)
from pb_tensor.utils._errors import TritonError, TritonErrorCode
from pb_tensor.utils._helpers import (
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
    get_input_tensor_by_name,
    get_model_dir,
    get_output_tensor_by_name,
    is_model_ready,
    load_model,
    unload_model,
)
from pb_tensor.utils._logger import Logger, LogLevel
from pb_tensor.utils._metrics import Metric, MetricFamily, MetricKind
from pb_tensor.utils._params import ParameterValue
from pb_tensor.utils._request import (
    TRITONSERVER_REQUEST_RELEASE_ALL,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
    InferenceRequest,
)
from pb_tensor.utils._response import (
    TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    InferenceResponse,
    InferenceResponseSender,
    ResponseIterator,
)
from pb_tensor.utils._types import (
    TRITONSERVER_MEMORY_CPU,
    TRITONSERVER_MEMORY_GPU,
    InferenceTrace,
    MemoryType,
    PreferredMemory,
)

__all__ = [
    "MODULE_NAME",
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITON_STRING_TO_NUMPY",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "InferenceTrace",
    "LogLevel",
    "Logger",
    "MemoryType",
    "Metric",
    "MetricFamily",
    "MetricKind",
    "ModelConfig",
    "ParameterValue",
    "PreferredMemory",
    "ResponseIterator",
    "Tensor",
    "TritonError",
    "TritonErrorCode",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_model_dir",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "install",
    "is_model_ready",
    "load_model",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "unload_model",
    "using_decoupled_model_transaction_policy",
]

MODULE_NAME = "triton_python_backend_utils"
"""The name Triton's models import this module under."""


def install(*, replace: bool = False) -> types.ModuleType:
    """Make ``import triton_python_backend_utils`` give this module, by registering it in
    ``sys.modules`` (nothing is written to disk). Idempotent; returns the module.

    Raises:
        RuntimeError: another module is already registered under that name (inside Triton,
            the real one) and ``replace`` is false.
    """
    this = sys.modules[__name__]
    current = sys.modules.get(MODULE_NAME)
    if current is not None and current is not this and not replace:
        raise RuntimeError(
            f"install(): sys.modules[{MODULE_NAME!r}] is already {current!r}; "
            "pass replace=True to replace it"
        )
    sys.modules[MODULE_NAME] = this
    return this
