"""Run Triton Python models without a server: a model repository and a local runtime.

::

    from pb_tensor.runtime import ModelRepository

    with ModelRepository("path/to/model_repository") as repo:
        with repo.load("add_sub") as model:            # its own stub process, as in Triton
            out = model.infer({"INPUT0": a, "INPUT1": b})

``model.py`` files run unchanged: ``import triton_python_backend_utils as pb_utils`` gives
:mod:`pb_tensor.utils` inside loaded models. See ``docs/runtime.md``.
"""

from __future__ import annotations

from pb_tensor.runtime._errors import InferenceError, ModelLoadError
from pb_tensor.runtime._model import LoadedModel
from pb_tensor.runtime._repository import ModelRepository, example_repository

__all__ = [
    "InferenceError",
    "LoadedModel",
    "ModelLoadError",
    "ModelRepository",
    "example_repository",
]
