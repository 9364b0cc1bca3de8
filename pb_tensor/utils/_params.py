"""Request and response parameters: upstream's ``PyParametersToJSON`` checks and encoding."""

from __future__ import annotations

import json
from collections.abc import Mapping

from pb_tensor.errors import TritonModelException

__all__ = ["ParameterValue", "parameters_to_json"]

ParameterValue = bool | int | str
"""What a parameter value may be (Triton's bool / int64 / string parameters)."""


def parameters_to_json(parameters: Mapping[str, ParameterValue] | None) -> str:
    """Check ``parameters`` as upstream does and return the JSON text ``parameters()`` gives.

    Raises:
        TritonModelException: ``parameters`` is neither None nor a dict, a key is not a
            ``str``, or a value is not a ``bool``, ``int`` or ``str`` (upstream's messages).
    """
    if parameters is None:
        return "{}"
    if not isinstance(parameters, dict):
        # Upstream prints the mangled C++ type name of py::dict here; "dict" is what it means.
        raise TritonModelException(f"Expect dict, got {type(parameters)!s}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(
                f"Expect parameters keys to have type str, found type {type(key)!s}"
            )
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(value)!s}"
            )
    return json.dumps(parameters)
