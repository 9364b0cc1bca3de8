"""Error paths of the runtime with Triton's texts, in both modes: model errors, bad returns,
load failures; initialize args, logging, metrics, BLS, model control."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest
from runtime_models import build_repository

from pb_tensor.runtime import InferenceError, LoadedModel, ModelLoadError, ModelRepository
from pb_tensor.utils import TritonError


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_repository(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "isolated"])
def repo(request: pytest.FixtureRequest, repo_dir: Path) -> Iterator[tuple[ModelRepository, bool]]:
    with ModelRepository(repo_dir) as r:
        yield r, request.param


def _load(repo: tuple[ModelRepository, bool], name: str, **kwargs: object) -> LoadedModel:
    r, isolated = repo
    kwargs.setdefault("timeout", 60)  # no test waits forever on a model
    return r.load(name, isolated=isolated, **kwargs)  # type: ignore[arg-type]


IN = {"IN": np.array([0, 5], dtype=np.int32)}


def _error(model: LoadedModel, inputs: Mapping[str, object] = IN) -> InferenceError:
    with pytest.raises(InferenceError) as info:
        model.infer(inputs)
    return info.value


def test_execute_raises(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "raises") as model:
        err = _error(model)
        assert err.code() == TritonError.INTERNAL
        assert err.message().startswith(
            "Failed to process the request(s) for model 'raises_0', message: ValueError: boom"
            "\n\nAt:\n  "
        )
        assert "model.py(" in err.message()
        assert "): execute\n" in err.message()
        # The model stays usable after an error.
        assert _error(model).message() == err.message()


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("wrong_count",
         "Number of InferenceResponse objects do not match the number of InferenceRequest "
         "objects. InferenceRequest(s) size is:1, and InferenceResponse(s) size is:0\n"),
        ("not_list", "Expected a list in the execute return, found type '<class 'tuple'>'."),
        ("not_response",
         "Expected an 'InferenceResponse' object in the execute function return list, found "
         "type '<class 'str'>'."),
        ("decoupled_returns",
         "Python model 'decoupled_returns_0' is using the decoupled mode and the execute "
         "function must return None."),
    ],
)  # fmt: skip
def test_bad_execute_returns(repo: tuple[ModelRepository, bool], name: str, text: str) -> None:
    with _load(repo, name) as model:
        if model.decoupled:
            with pytest.raises(InferenceError) as info:
                list(model.stream(IN))
            err = info.value
        else:
            err = _error(model)
        prefix = f"Failed to process the request(s) for model '{name}_0', message: "
        assert err.message() == prefix + text


def test_second_response_after_send_is_logged(
    repo: tuple[ModelRepository, bool], caplog: pytest.LogCaptureFixture
) -> None:
    # As in Triton: the response sent through the sender reached the client; the error of
    # returning another one goes to the log only.
    caplog.set_level(logging.ERROR, logger="pb_tensor.runtime")
    with _load(repo, "send_twice") as model:
        assert model.infer(IN)["OUT"].tolist() == [0, 5]
    assert any(
        r.getMessage() == "Failed to process the request(s) for model 'send_twice_0', message: "
        "Unable to send response. Non-decoupled model cannot send more than one response."
        for r in caplog.records
    )


def test_initialize_args(repo: tuple[ModelRepository, bool], repo_dir: Path) -> None:
    with _load(repo, "args_echo") as model:
        args = json.loads(model.infer(IN)["OUT"][0])
        assert sorted(args) == sorted([
            "model_config", "model_instance_kind", "model_instance_name",
            "model_instance_device_id", "model_repository", "model_version", "model_name",
        ])  # fmt: skip
        assert all(isinstance(v, str) for v in args.values())
        assert args["model_instance_kind"] == "CPU"
        assert args["model_instance_name"] == "args_echo_0"
        assert args["model_instance_device_id"] == "0"
        assert args["model_repository"] == str(repo_dir / "args_echo")
        assert args["model_version"] == "1"
        assert args["model_name"] == "args_echo"
        config = json.loads(args["model_config"])
        assert config == model.config
        assert config["name"] == "args_echo"
        assert config["input"][0]["dims"] == [-1]
        assert config["instance_group"] == [{
            "name": "args_echo", "kind": "KIND_CPU", "count": 1, "gpus": [],
            "secondary_devices": [], "profile": [], "passive": False, "host_policy": "",
        }]  # fmt: skip
        assert config["optimization"]["input_pinned_memory"] == {"enable": True}
        assert config["version_policy"] == {"latest": {"num_versions": 1}}
        assert config["default_model_filename"] == "model.py"
        # Compact JSON, keys in schema order, as Triton writes it.
        assert args["model_config"].startswith('{"name":"args_echo","platform":"","backend":')


def test_logs_reach_caller_logging(
    repo: tuple[ModelRepository, bool], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pb_tensor.runtime")
    with _load(repo, "logs") as model:
        model.infer(IN)
        records = [r for r in caplog.records if r.name == "pb_tensor.runtime.model.logs"]
        assert [(r.levelno, r.getMessage()) for r in records] == [
            (logging.INFO, "info from the model"),
            (logging.WARNING, "warning from the model"),
            (logging.ERROR, "error from the model"),
        ]
        assert all(r.pathname.endswith("model.py") for r in records)


def test_error_is_logged(repo: tuple[ModelRepository, bool],
                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="pb_tensor.runtime")
    with _load(repo, "raises") as model:
        _error(model)
    assert any("ValueError: boom" in r.getMessage() for r in caplog.records)


def test_metrics(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "metrics") as model:
        model.infer(IN)
        model.infer_many([IN, IN])
        snapshot = model.metrics()
        family = snapshot["requests_total"]
        values = [m["value"] for m in family["metrics"] if m["labels"] == {"model": "metrics"}]
        assert values == [3.0]


def test_bls_unknown_model(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "bls_unknown") as model:
        text = model.infer(IN)["OUT"][0].decode()
        assert text == (
            "Model no_such_model - Error when running inference: Request for unknown model: "
            "'no_such_model' is not found|INTERNAL"
        )


def test_bls_decoupled_target_needs_decoupled_exec(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "bls_wrong_mode") as model:
        assert model.infer(IN)["OUT"][0].decode() == (
            "Model decoupled_repeat - Error when running inference: Model decoupled_repeat is "
            "using the decoupled. The current BLS request call doesn't support models using "
            "the decoupled transaction policy. Please use 'decoupled=True' argument to the "
            "'exec' or 'async_exec' calls for decoupled models."
        )


def test_bls_decoupled_target(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "bls_stream") as model:
        out = model.infer({"IN": np.array([4], dtype=np.int32)})
        assert out["OUT"].tolist() == [0, 1, 2, 3]


def test_bls_async_exec_and_model_ready(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "bls_async") as model:
        out = model.infer({"IN": np.array([3, 4], dtype=np.int32)})
        assert out["OUT"].tolist() == [3, 4, 1]


def test_is_ready(repo: tuple[ModelRepository, bool], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="pb_tensor.runtime")
    with _load(repo, "readiness") as model:
        assert model.is_ready() is True
        model.infer({"IN": np.array([0], np.int32)})
        assert model.is_ready() is False
        # core's verbose line, with python_backend's error for a False answer
        assert caplog.records[-1].getMessage() == (
            "Model 'readiness' version 1 is not ready: Model 'readiness_0' is not ready "
            "(user-defined check failed)."
        )
        model.infer({"IN": np.array([1], np.int32)})
        assert model.is_ready() is True
        model.infer({"IN": np.array([2], np.int32)})
        assert model.is_ready() is False
        assert caplog.records[-1].getMessage() == (
            "Model 'readiness' version 1 is not ready: is_ready() must return a boolean value"
        )
    assert model.is_ready() is False  # unloaded
    with _load(repo, "raises") as other:
        assert other.is_ready() is True  # no is_ready(): ready once loaded


def test_finalize_called_on_unload(repo: tuple[ModelRepository, bool], repo_dir: Path) -> None:
    marker = repo_dir / "finalize_marker" / "finalized"
    marker.unlink(missing_ok=True)
    model = _load(repo, "finalize_marker")
    model.infer(IN)
    assert not marker.exists()
    model.unload()
    assert marker.read_text() == "yes"
    assert not model.loaded
    with pytest.raises(InferenceError, match="Request for unknown model: 'finalize_marker'"):
        model.infer(IN)
    model.unload()  # idempotent


# -- load failures ------------------------------------------------------------------------------


def test_initialize_raises(repo: tuple[ModelRepository, bool], repo_dir: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        _load(repo, "init_raises")
    text = str(info.value)
    path = repo_dir / "init_raises" / "1" / "model.py"
    assert text.startswith(f"failed to load model 'init_raises' version 1 ({path}): ")
    assert "RuntimeError: bad init\n\nAt:\n" in text


def test_no_model_class(repo: tuple[ModelRepository, bool]) -> None:
    with pytest.raises(ModelLoadError, match="has no attribute 'TritonPythonModel'"):
        _load(repo, "no_class")


def test_auto_complete_must_return_config(repo: tuple[ModelRepository, bool]) -> None:
    with pytest.raises(ModelLoadError) as info:
        _load(repo, "auto_bad")
    assert str(info.value).endswith(
        "auto_complete_config function in model 'auto_bad' must return a valid pb.ModelConfig "
        "object."
    )


def test_missing_model_py(repo: tuple[ModelRepository, bool], repo_dir: Path) -> None:
    path = repo_dir / "no_model_py" / "1" / "model.py"
    with pytest.raises(ModelLoadError) as info:
        _load(repo, "no_model_py")
    assert str(info.value).endswith(f"Python model file not found in '{path}'")


def test_malformed_config(repo: tuple[ModelRepository, bool], repo_dir: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        _load(repo, "bad_config")
    path = repo_dir / "bad_config" / "config.pbtxt"
    # protobuf's C++ parser's words, as Triton reports them
    assert str(info.value) == (
        f"failed to load model 'bad_config': failed to read text proto from {path}: "
        'Error parsing text-format inference.ModelConfig: 2:17: Expected integer, got: "x"'
    )


def test_invalid_config(repo: tuple[ModelRepository, bool]) -> None:
    with pytest.raises(ModelLoadError) as info:
        _load(repo, "no_dims")
    assert str(info.value).endswith("model input 'IN' must specify 'dims' for no_dims")


def test_unknown_model_and_version(repo: tuple[ModelRepository, bool]) -> None:
    with pytest.raises(ModelLoadError, match="failed to load model 'nope': no model directory"):
        _load(repo, "nope")
    with pytest.raises(ModelLoadError, match=r"version 7: no directory .* \(versions: \[1\]\)"):
        _load(repo, "raises", version=7)
    with pytest.raises(TypeError, match="version must be an int"):
        _load(repo, "raises", version="1")


def test_repository_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="is not a directory"):
        ModelRepository(tmp_path / "missing")
