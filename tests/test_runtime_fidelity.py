"""Where the runtime must behave as Triton's stub does, in both modes: the command line a model
sees, BLS refused outside ``execute``, relative imports in the model's folder, BYTES outputs as
``bytes``, outputs checked against the configuration, BF16 ``as_numpy`` only on request.

Each case is a small model written here; Triton's own models for the same rules run in
``test_upstream_models.py``.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pb_tensor.runtime import InferenceError, ModelLoadError, ModelRepository

CONFIG = """
name: "{name}"
backend: "python"
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_STRING dims: [ -1 ] }} ]
"""

HEADER = """
import json, sys, unittest
import numpy as np
import triton_python_backend_utils as pb_utils

def bls():
    request = pb_utils.InferenceRequest(
        model_name="argv", inputs=[pb_utils.Tensor("IN", np.array([1], np.int32))],
        requested_output_names=["OUT"])
    return request.exec()
"""

MODELS: dict[str, str] = {
    # As qa bls / custom_metrics do: unittest.main("model") inside execute parses sys.argv.
    "argv": """
        class ArgvTest(unittest.TestCase):
            def test_runs(self):
                self.assertTrue(True)

        class TritonPythonModel:
            def initialize(self, args):
                self.at_init = list(sys.argv)

            def execute(self, requests):
                test = unittest.main("model", exit=False)
                seen = json.dumps([self.at_init, list(sys.argv), test.result.wasSuccessful()])
                return [pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array([seen], dtype=object))]) for _ in requests]
    """,
    "bls_in_initialize": """
        class TritonPythonModel:
            def initialize(self, args):
                bls()

            def execute(self, requests):
                return None
    """,
    "bls_in_auto_complete": """
        class TritonPythonModel:
            @staticmethod
            def auto_complete_config(config):
                bls()
                return config

            def execute(self, requests):
                return None
    """,
    "bls_in_finalize": """
        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUT", np.array([bls().has_error()], dtype=object))]) for _ in requests]

            def finalize(self):
                bls()
    """,
}

CONFIGS = {
    "outputs": """
name: "outputs"
backend: "python"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [
  { name: "SAME" data_type: TYPE_FP32 dims: [ 2 ] },
  { name: "R" data_type: TYPE_INT32 dims: [ -1, 2 ] reshape: { shape: [ 2, -1 ] } },
  { name: "NEVER" data_type: TYPE_FP32 dims: [ 1 ] }
]
""",
}
MODELS["outputs"] = """
    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                responses.append(pb_utils.InferenceResponse([
                    # another dtype and shape than configured: Triton passes them as they are
                    pb_utils.Tensor("SAME", np.arange(3, dtype=np.float64)),
                    pb_utils.Tensor("R", x.reshape(len(x), 2, -1) if x.shape[1] == 6 else x),
                    pb_utils.Tensor("UNLISTED", x),  # not in the configuration: dropped
                ]))
            return responses
"""
CONFIGS["bf16"] = """
name: "bf16"
backend: "python"
input [ { name: "IN" data_type: TYPE_BF16 dims: [ -1 ] } ]
output [
  { name: "OUT" data_type: TYPE_BF16 dims: [ -1 ] },
  { name: "NUMPY" data_type: TYPE_STRING dims: [ 1 ] }
]
"""
MODELS["bf16"] = """
    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                tensor = pb_utils.get_input_tensor_by_name(request, "IN")
                try:
                    seen = str(tensor.as_numpy().dtype)
                except pb_utils.TritonModelException as exc:
                    seen = str(exc)
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor.from_dlpack("OUT", tensor.to_dlpack()),
                    pb_utils.Tensor("NUMPY", np.array([seen], dtype=object)),
                ]))
            return responses
"""
MODELS["writes_input"] = """
    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                x += 100  # allowed in Triton: the model's input is its own copy
                responses.append(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array([str(x.tolist())], dtype=object))]))
            return responses
"""

SIBLINGS = {
    "relative": {
        "model.py": """
            import helper_abs
            import triton_python_backend_utils as pb_utils
            import numpy as np
            from . import helper_rel
            from .helper_rel import WORD

            class TritonPythonModel:
                def execute(self, requests):
                    words = [helper_abs.WORD, helper_rel.WORD, WORD, __package__ != ""]
                    return [pb_utils.InferenceResponse([pb_utils.Tensor(
                        "OUT", np.array([str(words)], dtype=object))]) for _ in requests]
        """,
        "helper_abs.py": 'WORD = "absolute"\n',
        "helper_rel.py": 'WORD = "relative"\n',
    },
}

BLS_REFUSED = "BLS is only supported during the 'execute' function."


@pytest.fixture(scope="module")
def repo_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fidelity")
    for name, code in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(HEADER + textwrap.dedent(code))
        (root / name / "config.pbtxt").write_text(CONFIGS.get(name) or CONFIG.format(name=name))
    for name, files in SIBLINGS.items():
        (root / name / "1").mkdir(parents=True)
        for file, text in files.items():
            (root / name / "1" / file).write_text(textwrap.dedent(text))
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    return root


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "isolated"])
def repo(request: pytest.FixtureRequest, repo_path: Path) -> Iterator[tuple[ModelRepository, bool]]:
    with ModelRepository(repo_path) as repository:
        yield repository, request.param


def _one(repo: tuple[ModelRepository, bool], name: str) -> str:
    repository, isolated = repo
    model = repository.load(name, isolated=isolated, timeout=60)
    try:
        out = model.infer({"IN": np.array([1], dtype=np.int32)})["OUT"]
    finally:
        model.unload()
    assert out.dtype == object
    assert type(out[0]) is bytes
    return out[0].decode()


def test_models_see_triton_stubs_argv(repo: tuple[ModelRepository, bool]) -> None:
    before = list(sys.argv)
    at_init, at_execute, passed = json.loads(_one(repo, "argv"))
    assert at_init == at_execute == [""]
    assert passed is True
    assert sys.argv == before  # in-process: the host's argv comes back


def test_bls_refused_in_initialize_fails_the_load(repo: tuple[ModelRepository, bool]) -> None:
    repository, isolated = repo
    with pytest.raises(ModelLoadError) as e:
        repository.load("bls_in_initialize", isolated=isolated, timeout=60)
    assert f"TritonModelException: {BLS_REFUSED}" in str(e.value)


def test_bls_refused_in_auto_complete_config(repo: tuple[ModelRepository, bool]) -> None:
    repository, isolated = repo
    with pytest.raises(ModelLoadError) as e:
        repository.load("bls_in_auto_complete", isolated=isolated, timeout=60)
    assert f"TritonModelException: {BLS_REFUSED}" in str(e.value)


def test_bls_works_in_execute_and_is_refused_in_finalize(
    repo: tuple[ModelRepository, bool], caplog: pytest.LogCaptureFixture
) -> None:
    repository, isolated = repo
    model = repository.load("bls_in_finalize", isolated=isolated, timeout=60)
    assert model.infer({"IN": np.array([1], dtype=np.int32)})["OUT"].tolist() == [b"False"]
    with caplog.at_level("ERROR", logger="pb_tensor.runtime"):
        model.unload()
    assert any(BLS_REFUSED in r.getMessage() for r in caplog.records)


def test_relative_imports_in_the_model_folder(repo: tuple[ModelRepository, bool]) -> None:
    # python_backend README "Using relative imports"; qa multi_file runs in test_upstream_models.
    assert _one(repo, "relative") == "['absolute', 'relative', 'relative', True]"


def test_outputs_as_triton_passes_them(repo: tuple[ModelRepository, bool]) -> None:
    # core's InferenceResponse::AddOutput: only `reshape` is applied; python_backend prunes the
    # outputs that were not requested.
    repository, isolated = repo
    model = repository.load("outputs", isolated=isolated, timeout=60)
    try:
        out = model.infer({"IN": np.arange(12, dtype=np.int32).reshape(2, 6)})
        assert sorted(out) == ["R", "SAME"]
        assert out["SAME"].dtype == np.float64
        assert out["SAME"].tolist() == [0.0, 1.0, 2.0]
        # batch 2, the model's [2, 3] per item as [-1, 2]: -1 is the model's 3
        assert out["R"].shape == (2, 3, 2)
        assert out["R"].ravel().tolist() == list(range(12))
        only = model.infer({"IN": np.zeros((1, 2), np.int32)}, requested_outputs=["SAME"])
        assert list(only) == ["SAME"]
        # The model's [1, 3] has no dim for reshape's -1 (Triton would read past its shape).
        with pytest.raises(InferenceError) as e:
            model.infer({"IN": np.zeros((1, 3), np.int32)})
        assert e.value.message() == (
            "output 'R' of model 'outputs' has shape [1, 3], which the configuration's "
            "reshape [2, -1] -> dims [-1, 2] cannot hold"
        )
    finally:
        model.unload()


def test_bf16_as_numpy_refused_in_models_unless_opted_in(
    repo: tuple[ModelRepository, bool], repo_path: Path
) -> None:
    # qa identity_bf16: as_numpy() of a BF16 tensor raises inside a model in Triton.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    repository, isolated = repo
    values = np.array([1.5, -2.0, 3.0], dtype=ml_dtypes.bfloat16)  # accepted as BF16
    with repository.load("bf16", isolated=isolated, timeout=60) as model:
        out = model.infer({"IN": values})
    assert out["NUMPY"].tolist() == [
        b"Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and "
        b"from_dlpack() instead."
    ]
    assert out["OUT"].dtype == ml_dtypes.bfloat16  # the caller's side converts, as a client
    assert out["OUT"].tolist() == values.tolist()
    with (
        ModelRepository(repo_path, bf16_as_numpy=True) as relaxed,
        relaxed.load("bf16", isolated=isolated, timeout=60) as model,
    ):
        assert model.infer({"IN": values})["NUMPY"].tolist() == [b"bfloat16"]


def test_inputs_are_the_models_own_unless_shared(
    repo: tuple[ModelRepository, bool], repo_path: Path
) -> None:
    repository, isolated = repo
    caller = np.array([1, 2], dtype=np.int32)
    with repository.load("writes_input", isolated=isolated, timeout=60) as model:
        assert model.infer({"IN": caller})["OUT"].tolist() == [b"[101, 102]"]
    assert caller.tolist() == [1, 2]
    with (
        ModelRepository(repo_path, share_inputs=True) as sharing,
        sharing.load("writes_input", isolated=isolated, timeout=60) as model,
    ):
        model.infer({"IN": caller})
    # Opted in: in-process models get the caller's array itself; stubs always get a copy.
    assert caller.tolist() == ([1, 2] if isolated else [101, 102])
