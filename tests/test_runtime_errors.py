"""Error paths of the runtime with Triton's texts: model errors, bad returns, crashes, hangs,
load failures; initialize args, logging, metrics, cleanup of processes and shared memory."""

from __future__ import annotations

import json
import logging
import os
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pb_tensor.runtime import InferenceError, LoadedModel, ModelLoadError, ModelRepository
from pb_tensor.shm import SHM_DIR
from pb_tensor.utils import TritonError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "model_repository"

IDENTITY_CONFIG = """
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""

HEADER = """
import json, os, signal, sys, time
import numpy as np
import triton_python_backend_utils as pb_utils

def value(request):
    return pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()

def ok(request, array=None):
    array = value(request) if array is None else array
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", array)])
"""

MODELS: dict[str, str] = {
    "raises": """
        class TritonPythonModel:
            def execute(self, requests):
                raise ValueError("boom")
    """,
    "wrong_count": """
        class TritonPythonModel:
            def execute(self, requests):
                return []
    """,
    "not_list": """
        class TritonPythonModel:
            def execute(self, requests):
                return tuple(ok(r) for r in requests)
    """,
    "not_response": """
        class TritonPythonModel:
            def execute(self, requests):
                return ["nope" for r in requests]
    """,
    "send_twice": """
        class TritonPythonModel:
            def execute(self, requests):
                for r in requests:
                    r.get_response_sender().send(
                        ok(r), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return [ok(r) for r in requests]
    """,
    "crash": """
        class TritonPythonModel:
            def execute(self, requests):
                v = int(value(requests[0])[0])
                if v == 1:
                    os._exit(3)
                if v == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                if v == 3:
                    time.sleep(60)
                return [ok(r) for r in requests]
    """,
    "args_echo": """
        class TritonPythonModel:
            def initialize(self, args):
                self.args = args
            def execute(self, requests):
                text = np.array([json.dumps(self.args).encode()], dtype=object)
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", text)])
                        for r in requests]
    """,
    "logs": """
        class TritonPythonModel:
            def execute(self, requests):
                pb_utils.Logger.log_info("info from the model")
                pb_utils.Logger.log_warn("warning from the model")
                pb_utils.Logger.log_error("error from the model")
                return [ok(r) for r in requests]
    """,
    "metrics": """
        class TritonPythonModel:
            def initialize(self, args):
                family = pb_utils.MetricFamily(
                    name="requests_total", description="requests seen",
                    kind=pb_utils.MetricFamily.COUNTER)
                self.counter = family.Metric(labels={"model": args["model_name"]})
            def execute(self, requests):
                self.counter.increment(len(requests))
                return [ok(r) for r in requests]
    """,
    "bls_unknown": """
        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    response = pb_utils.InferenceRequest(
                        model_name="no_such_model", requested_output_names=["OUT"],
                        inputs=[pb_utils.get_input_tensor_by_name(r, "IN")]).exec()
                    text = response.error().message() + "|" + str(response.error().code())
                    out.append(pb_utils.InferenceResponse(
                        [pb_utils.Tensor("OUT", np.array([text.encode()], dtype=object))]))
                return out
    """,
    "bls_stream": """
        class TritonPythonModel:
            def execute(self, requests):
                out = []
                for r in requests:
                    n = pb_utils.Tensor("N", value(r).astype(np.int32)[:1])
                    responses = pb_utils.InferenceRequest(
                        model_name="decoupled_repeat", requested_output_names=["OUT"],
                        inputs=[n]).exec(decoupled=True)
                    got = [int(pb_utils.get_output_tensor_by_name(x, "OUT").as_numpy()[0])
                           for x in responses if x.output_tensors()]
                    out.append(ok(r, np.array(got, dtype=np.int32)))
                return out
    """,
    "identity": """
        class TritonPythonModel:
            def execute(self, requests):
                return [ok(r) for r in requests]
    """,
    "bls_async": """
        class TritonPythonModel:
            async def execute(self, requests):
                out = []
                for r in requests:
                    response = await pb_utils.InferenceRequest(
                        model_name="identity", requested_output_names=["OUT"],
                        inputs=[pb_utils.get_input_tensor_by_name(r, "IN")]).async_exec()
                    ready = pb_utils.is_model_ready("identity")
                    extra = np.array([int(ready)], dtype=np.int32)
                    out.append(ok(r, np.concatenate([
                        pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy(), extra])))
                return out
    """,
    "finalize_marker": """
        class TritonPythonModel:
            def initialize(self, args):
                self.path = os.path.join(args["model_repository"], "finalized")
            def execute(self, requests):
                return [ok(r) for r in requests]
            def finalize(self):
                with open(self.path, "w") as f:
                    f.write("yes")
    """,
    "init_raises": """
        class TritonPythonModel:
            def initialize(self, args):
                raise RuntimeError("bad init")
            def execute(self, requests):
                return []
    """,
    "no_class": """
        class SomethingElse:
            pass
    """,
    "auto_bad": """
        class TritonPythonModel:
            @staticmethod
            def auto_complete_config(config):
                return None
            def execute(self, requests):
                return []
    """,
}

DECOUPLED_CONFIG = IDENTITY_CONFIG + "model_transaction_policy { decoupled: true }\n"


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    for name, code in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(HEADER + textwrap.dedent(code))
        config = IDENTITY_CONFIG
        if name in ("args_echo", "bls_unknown"):
            config = config.replace('"OUT" data_type: TYPE_INT32', '"OUT" data_type: TYPE_STRING')
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n' + config)
    (root / "decoupled_returns" / "1").mkdir(parents=True)
    (root / "decoupled_returns" / "1" / "model.py").write_text(
        HEADER + "class TritonPythonModel:\n    def execute(self, requests):\n"
        "        return [ok(r) for r in requests]\n"
    )
    (root / "decoupled_returns" / "config.pbtxt").write_text(DECOUPLED_CONFIG)
    (root / "bad_config" / "1").mkdir(parents=True)
    (root / "bad_config" / "1" / "model.py").write_text("")
    (root / "bad_config" / "config.pbtxt").write_text('name: "bad_config"\nmax_batch_size: "x"\n')
    (root / "no_model_py" / "1").mkdir(parents=True)
    (root / "no_model_py" / "config.pbtxt").write_text(IDENTITY_CONFIG)
    (root / "no_dims" / "1").mkdir(parents=True)
    (root / "no_dims" / "1" / "model.py").write_text(HEADER + textwrap.dedent(MODELS["raises"]))
    (root / "no_dims" / "config.pbtxt").write_text(
        'input [ { name: "IN" data_type: TYPE_INT32 } ]\n'
    )
    shutil.copytree(EXAMPLES / "decoupled_repeat", root / "decoupled_repeat")
    return root


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "isolated"])
def repo(request: pytest.FixtureRequest, repo_dir: Path) -> Iterator[tuple[ModelRepository, bool]]:
    with ModelRepository(repo_dir) as r:
        yield r, request.param


def _load(repo: tuple[ModelRepository, bool], name: str, **kwargs: object) -> LoadedModel:
    r, isolated = repo
    return r.load(name, isolated=isolated, **kwargs)  # type: ignore[arg-type]


IN = {"IN": np.array([0, 5], dtype=np.int32)}


def _error(model: LoadedModel, inputs: dict[str, object] = IN) -> InferenceError:
    with pytest.raises(InferenceError) as info:
        model.infer(inputs)
    return info.value


def test_execute_raises(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "raises") as model:
        err = _error(model)
        assert err.code() == TritonError.INTERNAL
        assert err.message().startswith(
            "Failed to process the request(s) for model 'raises_0_0', message: ValueError: boom"
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
         "Python model 'decoupled_returns_0_0' is using the decoupled mode and the execute "
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
        prefix = f"Failed to process the request(s) for model '{name}_0_0', message: "
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
        r.getMessage() == "Failed to process the request(s) for model 'send_twice_0_0', message: "
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
        assert args["model_instance_name"] == "args_echo_0_0"
        assert args["model_instance_device_id"] == "0"
        assert args["model_repository"] == str(repo_dir / "args_echo")
        assert args["model_version"] == "1"
        assert args["model_name"] == "args_echo"
        config = json.loads(args["model_config"])
        assert config == model.config
        assert config["name"] == "args_echo"
        assert config["input"][0]["dims"] == [-1]
        assert config["instance_group"] == [{
            "name": "args_echo_0", "kind": "KIND_CPU", "count": 1, "gpus": [],
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
            "Request for unknown model: 'no_such_model' is not found|INVALID_ARG"
        )


def test_bls_decoupled_target(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "bls_stream") as model:
        out = model.infer({"IN": np.array([4], dtype=np.int32)})
        assert out["OUT"].tolist() == [0, 1, 2, 3]


def test_bls_async_exec_and_model_ready(repo: tuple[ModelRepository, bool]) -> None:
    with _load(repo, "bls_async") as model:
        out = model.infer({"IN": np.array([3, 4], dtype=np.int32)})
        assert out["OUT"].tolist() == [3, 4, 1]


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
    assert str(info.value).startswith(
        f"failed to load model 'bad_config': failed to read text proto from {path}: 2:"
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


# -- isolated only: crashes, hangs, cleanup -----------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize(("trigger", "what"), [(1, "os._exit"), (2, "SIGKILL")])
def test_stub_crash_is_reported_and_restarted(repo_dir: Path, trigger: int, what: str) -> None:
    with ModelRepository(repo_dir) as r, r.load("crash") as model:
        first = model.pid
        assert first is not None
        err = _error(model, {"IN": np.array([trigger], dtype=np.int32)})
        assert err.message() == (
            "Failed to process the request(s) for model instance 'crash_0_0', message: Stub "
            "process 'crash_0_0' is not healthy."
        ), what
        assert err.code() == TritonError.INTERNAL
        assert model.pid is None
        assert _gone(first)
        # The next call starts a new stub (initialize runs again).
        assert model.infer({"IN": np.array([7], np.int32)})["OUT"].tolist() == [7]
        assert model.pid not in (None, first)


def test_stub_timeout_kills_and_restarts(repo_dir: Path) -> None:
    with ModelRepository(repo_dir) as r, r.load("crash", timeout=30) as model:
        first = model.pid
        assert first is not None
        with pytest.raises(InferenceError) as info:
            model.infer({"IN": np.array([3], np.int32)}, timeout=0.5)
        assert info.value.message() == (
            "Failed to process the request(s) for model instance 'crash_0_0', message: Stub "
            "process 'crash_0_0' did not respond within the timeout of 0.5 s and was killed."
        )
        assert info.value.code() == TritonError.UNAVAILABLE
        assert _gone(first)
        assert model.infer({"IN": np.array([9], np.int32)})["OUT"].tolist() == [9]


def test_no_leftover_processes_or_shared_memory(repo_dir: Path) -> None:
    with ModelRepository(repo_dir) as r:
        pool_path = os.path.join(SHM_DIR, r.pool.name)
        models = [r.load("raises"), r.load("bls_stream")]
        models[1].infer({"IN": np.array([2], np.int32)})  # loads decoupled_repeat for BLS
        pids = [m.pid for m in models]
        assert all(p is not None for p in pids)
        assert os.path.exists(pool_path)
    assert all(_gone(p) for p in pids if p is not None)
    assert not os.path.exists(pool_path)
    assert not models[0].loaded
    assert not models[1].loaded


def test_pool_records_are_released(repo_dir: Path) -> None:
    """Records of finished requests (inputs, outputs, BLS traffic) go back to the pool."""
    with ModelRepository(repo_dir) as r, r.load("bls_stream") as model:
        x = {"IN": np.array([3], dtype=np.int32)}
        model.infer(x)
        model.infer(x)  # the stubs hold the previous replies until their next command
        baseline = r.pool.stats().allocations
        for _ in range(20):
            out = model.infer(x)
            assert out["OUT"].tolist() == [0, 1, 2]
            del out
        assert r.pool.stats().allocations == baseline


def test_model_control_from_a_model(tmp_path: Path, repo_dir: Path) -> None:
    root = tmp_path / "repo"
    shutil.copytree(repo_dir / "identity", root / "identity")
    (root / "control" / "1").mkdir(parents=True)
    (root / "control" / "config.pbtxt").write_text(IDENTITY_CONFIG)
    (root / "control" / "1" / "model.py").write_text(HEADER + textwrap.dedent("""
        class TritonPythonModel:
            def execute(self, requests):
                states = [pb_utils.is_model_ready("identity")]
                pb_utils.load_model("identity")
                states.append(pb_utils.is_model_ready("identity"))
                pb_utils.unload_model("identity")
                states.append(pb_utils.is_model_ready("identity"))
                return [ok(r, np.array(states, dtype=np.int32)) for r in requests]
    """))
    for isolated in (False, True):
        with ModelRepository(root) as r, r.load("control", isolated=isolated) as model:
            assert model.infer(IN)["OUT"].tolist() == [0, 1, 0]


def test_stub_exits_when_parent_dies(run_python: object) -> None:
    code = f"""
import os, sys
from pb_tensor.runtime import ModelRepository
repo = ModelRepository({str(EXAMPLES)!r})
model = repo.load("add_sub")
print(model.pid, repo.pool.name, flush=True)
os._exit(0)
"""
    result = run_python(code, timeout=60)  # type: ignore[operator]
    assert result.returncode == 0, result.stderr
    pid_text, pool_name = result.stdout.split()
    pid = int(pid_text)
    import time

    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)
    # The creator died without closing the pool: its segment is left for the OS to reclaim
    # only by name, so remove it here to keep /dev/shm clean.
    path = os.path.join(SHM_DIR, pool_name)
    if os.path.exists(path):
        os.unlink(path)
