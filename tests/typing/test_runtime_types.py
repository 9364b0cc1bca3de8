"""Static types of pb_tensor.runtime (checked by ``mypy --strict``; also runs under pytest).

``assert_type`` fails type checking when an inferred type differs; the ``type: ignore[...]``
lines fail it (warn_unused_ignores) when a call that must be rejected is accepted.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from typing_extensions import assert_type

from pb_tensor.errors import TritonModelException
from pb_tensor.runtime import (
    InferenceError,
    InferFuture,
    LoadedModel,
    ModelLoadError,
    ModelRepository,
    Outputs,
    ResponseStream,
    example_repository,
)
from pb_tensor.runtime.pytest_plugin import triton_repository

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples" / "model_repository"


def _static_only(model: LoadedModel) -> None:
    model.infer([1, 2])  # type: ignore[arg-type]
    model.infer({"A": 1}, timeout="1")  # type: ignore[arg-type]
    model.infer_many({"A": 1})  # type: ignore[arg-type]
    ModelRepository(EXAMPLES).load("add_sub", version="1")  # type: ignore[arg-type]


def test_runtime_types() -> None:
    a = np.arange(4, dtype=np.float32)
    with ModelRepository(EXAMPLES) as repo:
        assert_type(repo, ModelRepository)
        assert_type(repo.path, str)
        assert_type(repo.models(), list[str])
        assert_type(repo.versions("add_sub"), list[int])
        with repo.load("add_sub", version=1, isolated=False, timeout=5.0) as model:
            assert_type(model, LoadedModel)
            assert_type(model.name, str)
            assert_type(model.version, int)
            assert_type(model.config, dict[str, Any])
            assert_type(model.decoupled, bool)
            assert_type(model.isolated, bool)
            assert_type(model.pid, int | None)
            out = model.infer({"INPUT0": a, "INPUT1": a}, requested_outputs=["OUTPUT0"],
                              parameters={"k": 1, "s": "v", "b": True}, timeout=1.0)
            assert_type(out, Outputs)
            assert isinstance(out, dict)
            assert_type(out["OUTPUT0"], npt.NDArray[Any])
            assert_type(out.parameters, dict[str, bool | int | str])
            many = model.infer_many([{"INPUT0": a, "INPUT1": a}])
            assert_type(many, list[Outputs | InferenceError])
            assert_type(model.stream({"INPUT0": a, "INPUT1": a}), ResponseStream)
            future = model.infer_async({"INPUT0": a, "INPUT1": a})
            assert_type(future, InferFuture)
            assert_type(future.result(timeout=60), Outputs)
            assert_type(model.metrics(), dict[str, Any])
            assert_type(model.is_ready(), bool)
            assert_type(model.loaded, bool)
            assert_type(model.instance_name, str)
            np.testing.assert_array_equal(out["OUTPUT0"], a * 2)
    err = InferenceError("x", 3)
    assert_type(err.message(), str)
    assert_type(err.code(), int)
    assert isinstance(err, TritonModelException)
    assert issubclass(ModelLoadError, TritonModelException)


def test_example_repository_type() -> None:
    assert_type(example_repository(), str)
    assert Path(example_repository()) == EXAMPLES


def test_plugin_fixture_type() -> None:
    fixture: Callable[..., Any] = triton_repository
    assert callable(fixture)
    assert os.path.isdir(EXAMPLES)
