"""Importing a ``model.py`` as Triton's stub does, finding its ``TritonPythonModel``,
``auto_complete_config``, and Triton's text for an exception a model raised."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import itertools
import os
import sys
import traceback
from types import ModuleType
from typing import Any

from pb_tensor.runtime._model_code import model_argv
from pb_tensor.runtime._seam import ModelConfig

__all__ = [
    "UserModelError",
    "format_exception",
    "install_pb_utils",
    "load_model_module",
    "model_class",
    "run_auto_complete",
]

_module_ids = itertools.count()


class UserModelError(Exception):
    """Loading the user's model failed; ``str()`` is Triton's message."""


# pb_tensor and dlpack_ctypes stand in for Triton's C++ (the stub, pb_utils): their frames
# would not be in Triton's traceback.
_OURS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                 package) + os.sep
    for package in ("pb_tensor", "dlpack_ctypes")
)  # fmt: skip


def format_exception(exc: BaseException) -> str:
    """An exception as pybind11's ``error_already_set.what()`` prints it (what Triton puts
    in its error messages): ``Type: message``, then the frames, innermost first; frames of
    pb-tensor itself are left out, as Triton's C++ has none."""
    text = f"{type(exc).__name__}: {exc}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(_OURS)]  # fmt: skip
    if frames:
        text += "\n\nAt:\n" + "".join(
            f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(frames)
        )
    return text


def install_pb_utils() -> None:
    """Make ``import triton_python_backend_utils`` give :mod:`pb_tensor.utils` (in-memory
    only; nothing is written to site-packages). A real module already imported is kept."""
    import pb_tensor.utils as pb_utils

    if pb_utils.MODULE_NAME not in sys.modules:
        pb_utils.install()


def load_model_module(model_path: str, model_name: str) -> ModuleType:
    """Import ``model.py`` as Triton's stub does: its version folder and the model's folder go
    on ``sys.path`` (``import file1`` of a sibling works) and the file is imported as a module
    of a package made of its version folder (``from . import file2`` works). The package gets
    a name of its own where Triton's is the version (``1.model``): several models and versions
    can live in one process.

    Raises:
        UserModelError: the file is missing (Triton's message) or importing it raised.
    """
    if not os.path.isfile(model_path):
        raise UserModelError(f"Python model file not found in '{model_path}'")
    install_pb_utils()
    directory = os.path.dirname(os.path.abspath(model_path))
    for entry in (directory, os.path.dirname(directory)):
        if entry not in sys.path:
            sys.path.append(entry)
    safe = "".join(c if c.isalnum() else "_" for c in model_name)
    package = f"_pb_tensor_model_{safe}_{next(_module_ids)}"
    package_spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
    package_spec.submodule_search_locations = [directory]
    sys.modules[package] = importlib.util.module_from_spec(package_spec)
    stem = os.path.splitext(os.path.basename(model_path))[0]
    module_name = f"{package}.{stem}"
    spec = importlib.util.spec_from_file_location(module_name, model_path)
    if spec is None or spec.loader is None:
        sys.modules.pop(package, None)
        raise UserModelError(f"Python model file not found in '{model_path}'")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        with model_argv():
            spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        sys.modules.pop(package, None)
        if not isinstance(exc, Exception | SystemExit):
            raise
        raise UserModelError(_load_error(exc)) from exc
    return module


def _load_error(exc: BaseException) -> str:
    """Triton's text for an import that raised; for a ``SyntaxError``, the file, line and
    caret as Python prints them for a script instead of importlib's frames."""
    if not isinstance(exc, SyntaxError):
        return format_exception(exc)
    where = traceback.format_exception_only(exc)[:-1]
    return f"{type(exc).__name__}: {exc}\n\n" + "".join(where).rstrip("\n")


def model_class(module: ModuleType) -> type:
    """``TritonPythonModel`` of a loaded ``model.py``.

    Raises:
        UserModelError: the module defines none (the ``AttributeError`` text Triton shows).
    """
    cls = getattr(module, "TritonPythonModel", None)
    if not isinstance(cls, type):
        raise UserModelError(
            "AttributeError: module 'model' has no attribute 'TritonPythonModel'"
            if cls is None
            else f"TypeError: 'TritonPythonModel' in model.py is a {type(cls).__name__}, "
            "not a class"
        )
    return cls


def run_auto_complete(cls: type, name: str, config: dict[str, Any]) -> dict[str, Any]:
    """Call ``cls.auto_complete_config`` when defined; the completed configuration.

    Raises:
        UserModelError: it raised or returned something else than a ``pb_utils.ModelConfig``
            (Triton's message).
    """
    fn = getattr(cls, "auto_complete_config", None)
    if fn is None:
        return config
    try:
        with model_argv():
            result = fn(ModelConfig(config))
    except Exception as exc:
        raise UserModelError(format_exception(exc)) from exc
    if not isinstance(result, ModelConfig):
        raise UserModelError(
            f"auto_complete_config function in model '{name}' must return a valid "
            "pb.ModelConfig object."
        )
    completed: dict[str, Any] = result.as_dict()
    return completed
