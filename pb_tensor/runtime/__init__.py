"""Run Triton Python models without a server: a model repository and a local runtime.

::

    from pb_tensor.runtime import ModelRepository

    with ModelRepository("path/to/model_repository") as repo:
        with repo.load("add_sub") as model:            # its own stub process, as in Triton
            out = model.infer({"INPUT0": a, "INPUT1": b})

``model.py`` files run unchanged: ``import triton_python_backend_utils as pb_utils`` gives
:mod:`pb_tensor.utils` inside loaded models. See ``docs/runtime.md``.

The names are imported on first use, so that the command line and the stub processes do not
pay for (or need) protobuf, which only reading ``config.pbtxt`` requires.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pb_tensor.runtime._calls import InferFuture, ResponseStream
    from pb_tensor.runtime._ensemble import EnsembleModel
    from pb_tensor.runtime._errors import (
        InferenceError,
        ModelLoadError,
        RequestRefused,
        ResponseSenderDropped,
    )
    from pb_tensor.runtime._model import LoadedModel
    from pb_tensor.runtime._repository import (
        ModelRepository,
        ServerModels,
        example_repository,
        parse_model_version,
    )
    from pb_tensor.runtime._unloads import BackgroundUnloads
    from pb_tensor.runtime._updates import (
        config_change_requires_reload,
        instance_groups,
        model_timestamp,
        model_timestamps,
        newest_time,
        version_modified,
    )
    from pb_tensor.runtime._values import Outputs

__all__ = [
    "BackgroundUnloads",
    "EnsembleModel",
    "InferFuture",
    "InferenceError",
    "LoadedModel",
    "ModelLoadError",
    "ModelRepository",
    "Outputs",
    "RequestRefused",
    "ResponseSenderDropped",
    "ResponseStream",
    "ServerModels",
    "config_change_requires_reload",
    "example_repository",
    "instance_groups",
    "model_timestamp",
    "model_timestamps",
    "newest_time",
    "parse_model_version",
    "version_modified",
]

# Library convention: the runtime's records reach only the handlers the application installs
# (the command line installs one); without any, Python's last-resort handler stays silent.
logging.getLogger("pb_tensor.runtime").addHandler(logging.NullHandler())

_WHERE = {
    "BackgroundUnloads": "pb_tensor.runtime._unloads",
    "EnsembleModel": "pb_tensor.runtime._ensemble",
    "InferenceError": "pb_tensor.runtime._errors",
    "ModelLoadError": "pb_tensor.runtime._errors",
    "RequestRefused": "pb_tensor.runtime._errors",
    "ResponseSenderDropped": "pb_tensor.runtime._errors",
    "LoadedModel": "pb_tensor.runtime._model",
    "ModelRepository": "pb_tensor.runtime._repository",
    "ServerModels": "pb_tensor.runtime._repository",
    "example_repository": "pb_tensor.runtime._repository",
    "parse_model_version": "pb_tensor.runtime._repository",
    "model_timestamp": "pb_tensor.runtime._updates",
    "newest_time": "pb_tensor.runtime._updates",
    "InferFuture": "pb_tensor.runtime._calls",
    "ResponseStream": "pb_tensor.runtime._calls",
    "Outputs": "pb_tensor.runtime._values",
    "config_change_requires_reload": "pb_tensor.runtime._updates",
    "instance_groups": "pb_tensor.runtime._updates",
    "model_timestamps": "pb_tensor.runtime._updates",
    "version_modified": "pb_tensor.runtime._updates",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pb_tensor.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
