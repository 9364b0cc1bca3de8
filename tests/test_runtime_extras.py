"""pb-tensor's additions to Triton's API are off inside models unless the repository opts in.

Outside models, ``triton_dtype()`` returns a ``TritonDtype``, ``__dlpack__`` takes DLPack 1.x
keywords, tensors pickle, ``TritonError`` takes plain ``int`` codes and every C-contiguous
empty DLPack tensor imports. Triton's ``pb_utils`` does none of these (``TypeError`` for the
first four, "not contiguous" for some empty tensors), so a model that relied on them would pass
here and fail in Triton. Inside a model served by the runtime (isolated or in-process) they fail
as in Triton; ``ModelRepository(..., pb_tensor_extras=True)`` turns them on.
"""

from __future__ import annotations

import json
import pickle
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dlpack_ctypes as dl
from pb_tensor import Tensor, TritonDtype
from pb_tensor.errors import TritonModelException
from pb_tensor.extras_policy import allow_extras, extras_allowed
from pb_tensor.runtime import ModelRepository
from pb_tensor.utils import TritonError

CONFIG = """
name: "extras"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
"""

MODEL = """
import json, pickle
import numpy as np
import triton_python_backend_utils as pb_utils


def _Producer():
    # An empty (2, 0) int32 tensor exported with strides (1, 2), which Triton's check refuses
    # (numpy's own exporter normalises an empty array's strides in some versions).
    import dlpack_ctypes as dl
    owner = np.zeros(4, np.int32)
    return dl.BufferExporter(owner, owner.ctypes.data, (2, 0), (1, 2), dl.DataType(0, 32, 1),
                             (1, 0))


def attempt(fn):
    try:
        return ["ok", repr(fn())]
    except Exception as exc:
        return [type(exc).__name__, str(exc)]


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            t = pb_utils.get_input_tensor_by_name(request, "IN")
            seen = {
                "triton_dtype": attempt(lambda: t.triton_dtype()),
                "dlpack_max_version": attempt(lambda: type(t.__dlpack__(max_version=(1, 0)))),
                "dlpack_stream": attempt(lambda: type(t.__dlpack__(stream=None))),
                "numpy_from_dlpack": attempt(lambda: np.from_dlpack(t).tolist()),
                "pickle": attempt(lambda: len(pickle.dumps(t))),
                "int_code": attempt(lambda: pb_utils.TritonError("x", 3).code()),
                "enum_code": attempt(
                    lambda: pb_utils.TritonError("x", pb_utils.TritonError.NOT_FOUND).code()
                ),
                "empty_dlpack": attempt(
                    lambda: pb_utils.Tensor.from_dlpack("E", _Producer()).shape()
                ),
            }
            out = pb_utils.Tensor("OUT", np.array([json.dumps(seen)], dtype=object))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
"""

STRICT = {
    "triton_dtype": [
        "TypeError",
        "Unable to convert function return value to a Python type! The signature was\n"
        "\t(self: c_python_backend_utils.Tensor) -> TRITONSERVER_datatype_enum",
    ],
    "dlpack_stream": ["ok", "<class 'PyCapsule'>"],
    "numpy_from_dlpack": ["ok", "[1, 2]"],  # numpy falls back to Triton's legacy export
    "pickle": ["TypeError", "cannot pickle 'c_python_backend_utils.Tensor' object"],
    "enum_code": ["ok", "<TritonErrorCode.NOT_FOUND: 2>"],
    "empty_dlpack": [
        "TritonModelException",
        "DLPack tensor is not contiguous. Only contiguous DLPack tensors that are stored in "
        "C-Order are supported.",
    ],
}


def _empty_producer() -> dl.BufferExporter:
    """The model's ``_Producer``, here."""
    owner = np.zeros(4, np.int32)
    return dl.BufferExporter(owner, owner.ctypes.data, (2, 0), (1, 2), dl.DataType(0, 32, 1),
                             (1, 0))


@pytest.fixture(scope="module")
def repo_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("extras_repo")
    (root / "extras" / "1").mkdir(parents=True)
    (root / "extras" / "config.pbtxt").write_text(CONFIG)
    (root / "extras" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    return root


@pytest.fixture(params=[True, False], ids=["isolated", "in_process"])
def isolated(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _seen(repo_path: Path, isolated: bool, **options: bool) -> dict[str, list[str]]:
    with (
        ModelRepository(repo_path, **options) as repository,
        repository.load("extras", isolated=isolated, timeout=60) as model,
    ):
        out = model.infer({"IN": np.array([1, 2], np.int32)})["OUT"]
    seen: dict[str, list[str]] = json.loads(out[0])
    return seen


def test_models_see_tritons_api_by_default(repo_path: Path, isolated: bool) -> None:
    seen = _seen(repo_path, isolated)
    for key, expected in STRICT.items():
        assert seen[key] == expected, key
    kind, message = seen["dlpack_max_version"]
    assert kind == "TypeError"
    assert message.startswith(
        "__dlpack__(): incompatible function arguments. The following argument types are "
        "supported:\n    1. (self: c_python_backend_utils.Tensor, stream: object = None) -> "
        "capsule\n\nInvoked with kwargs: max_version=(1, 0)"
    )
    assert "pb_tensor_extras=True" in message
    kind, message = seen["int_code"]
    assert kind == "TypeError"
    assert "got int 3" in message
    assert "pb_tensor_extras=True" in message


def test_the_repository_opts_in(repo_path: Path, isolated: bool) -> None:
    seen = _seen(repo_path, isolated, pb_tensor_extras=True)
    assert seen["triton_dtype"] == ["ok", "<TritonDtype.TYPE_INT32: 8>"]
    assert seen["dlpack_max_version"] == ["ok", "<class 'PyCapsule'>"]
    assert seen["numpy_from_dlpack"] == ["ok", "[1, 2]"]
    assert seen["pickle"][0] == "ok"
    assert seen["int_code"] == ["ok", "<TritonErrorCode.INVALID_ARG: 3>"]
    assert seen["empty_dlpack"] == ["ok", "[2, 0]"]


def test_outside_models_everything_works() -> None:
    assert extras_allowed()
    t = Tensor("t", np.array([1, 2], np.int32))
    assert t.triton_dtype() is TritonDtype.TYPE_INT32
    assert pickle.loads(pickle.dumps(t)).as_numpy().tolist() == [1, 2]
    assert TritonError("x", 3).code() == TritonError.INVALID_ARG
    assert Tensor.from_dlpack("e", _empty_producer()).shape() == [2, 0]


def test_the_policy_is_per_context() -> None:
    t = Tensor("t", np.array([1, 2], np.int32))
    with allow_extras(False):
        assert not extras_allowed()
        with pytest.raises(TypeError, match="Unable to convert function return value"):
            t.triton_dtype()
        assert t.dtype is TritonDtype.TYPE_INT32  # the typed property always works
        with pytest.raises(TypeError, match="cannot pickle"):
            pickle.dumps(t)
        with pytest.raises(TritonModelException, match="not contiguous"):
            Tensor.from_dlpack("e", _empty_producer())
    assert extras_allowed()
    assert t.triton_dtype() is TritonDtype.TYPE_INT32
