"""More of the server's ``qa`` models (byte-for-byte under ``tests/upstream``), run in both
modes with the inputs and assertions of the upstream test that drives each:

* ``qa/L0_backend_python/lifecycle`` (``lifecycle_test.py``, ``test.sh``):
  ``execute_grpc_error``, ``decoupled_grpc_error`` (the runtime's side of the gRPC stream
  tests: which responses and errors the model produces) and ``execute_return_error``;
* ``qa/L0_backend_python/test.sh`` and ``python_test.py``: ``model_env`` (``MY_ENV``
  reaches the model), ``init_exit`` (the stub killed in ``initialize``; isolated mode only,
  in-process mode would kill the test's own process), ``pytorch_fp32_fp32``
  (``test_infer_pytorch``) and ``identity_fp32`` laid out as ``default_model_name``
  (``default_model_filename: "mymodel.py"``);
* ``qa/L0_backend_python/bls/test.sh``: ``bls_finalize_error`` (BLS in ``finalize`` is
  refused and logged);
* ``qa/L0_backend_python/decoupled`` (``decoupled_test.py``, its ``models``):
  ``decoupled_execute_error``, ``decoupled_raise_exception``,
  ``decoupled_return_response_error``, ``decoupled_send_after_close_error``;
* ``qa/L0_backend_python/io`` (``io_test.py``' ``test_requested_output_decoupled_prior_crash``,
  its ``requested_output_model`` laid out as ``llm``);
* ``qa/L0_string_io`` (``string_client_test.py``, ``test.sh``' ``sed`` of the dims):
  ``string_identity``, as the gRPC client and HTTP's binary clients send it;
* ``qa/L0_backend_python/request_rescheduling`` (``test.sh``; the assertion is
  ``bls_request_rescheduling``'s ``test_wrong_return_type``): ``wrong_return_type``;
* ``qa/L0_backend_python/model_readiness`` (``test_model_readiness.py``, ``test.sh``):
  ``readiness_model`` and ``readiness_coroutine_model`` laid out as ``test.sh`` does, and
  ``identity_fp32`` whose stub is killed;
* ``qa/L0_model_config`` (``test.sh``): the Python cases of ``autofill_noplatform`` (with
  ``qa/python_models/auto_complete``), each a load that fails with the expected text.

Where upstream's client sees a gRPC status, these tests see the ``InferenceError`` code of the
same name.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from upstream_models import (
    PYTHON_MODELS,
    QA_BACKEND_PYTHON,
    READINESS_MODELS,
    UPSTREAM,
    repository,
)

from pb_tensor.runtime import (
    InferenceError,
    LoadedModel,
    ModelLoadError,
    ModelRepository,
    ResponseSenderDropped,
)
from pb_tensor.utils import TritonError

DECOUPLED_MODELS = QA_BACKEND_PYTHON / "decoupled" / "models"
Loader = Callable[[str], LoadedModel]


def _string_dims(text: str) -> str:
    """L0_string_io/test.sh: ``sed -i "s/\\[ 1 \\]/\\[ 8 \\]/" config.pbtxt``"""
    return text.replace("[ 1 ]", "[ 8 ]")


def _sed_name(name: str) -> Callable[[str], str]:
    """test.sh's ``sed -i "s/^name:.*/name: \"<name>\"/" config.pbtxt``"""
    return lambda text: "\n".join(
        f'name: "{name}"' if line.startswith("name:") else line for line in text.splitlines()
    ) + "\n"


def _default_model_name(text: str) -> str:
    """L0_backend_python/test.sh's ``default_model_name``: identity_fp32 renamed, with
    ``echo "default_model_filename: \"mymodel.py\"" >> config.pbtxt``."""
    return _sed_name("default_model_name")(text) + 'default_model_filename: "mymodel.py"\n'


@pytest.fixture(scope="module")
def qa_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = repository(
        tmp_path_factory.mktemp("qa"),
        {
            **{name: PYTHON_MODELS / name for name in (
                "execute_grpc_error", "decoupled_grpc_error", "execute_return_error",
                "model_env", "init_exit", "bls_finalize_error", "string_identity",
                "wrong_return_type",
            )},
            **{name: DECOUPLED_MODELS / name for name in (
                "decoupled_execute_error", "decoupled_raise_exception",
                "decoupled_return_response_error", "decoupled_send_after_close_error",
            )},
            "llm": QA_BACKEND_PYTHON / "io" / "requested_output_model",
            "pytorch_fp32_fp32": PYTHON_MODELS / "pytorch_fp32_fp32",
            "default_model_name": PYTHON_MODELS / "identity_fp32",
        },
        config_edit={
            "string_identity": _string_dims,
            "pytorch_fp32_fp32": _sed_name("pytorch_fp32_fp32"),
            "default_model_name": _default_model_name,
        },
    )  # fmt: skip
    # L0_backend_python/test.sh: mv ./models/default_model_name/1/model.py .../mymodel.py
    version = dest / "default_model_name" / "1"
    (version / "model.py").rename(version / "mymodel.py")
    return dest


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "isolated"])
def load(request: pytest.FixtureRequest, qa_repo: Path) -> Iterator[Loader]:
    """``load(name)``: the model in this module's mode, loaded once per mode."""
    isolated: bool = request.param
    cache: dict[str, LoadedModel] = {}
    with ModelRepository(qa_repo) as repo:

        def get(name: str) -> LoadedModel:
            if name not in cache:
                cache[name] = repo.load(name, isolated=isolated, timeout=60)
            return cache[name]

        yield get


def _fp32(*shape: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


# -- qa/L0_backend_python/lifecycle ---------------------------------------------------------------


def test_execute_grpc_error(load: Loader) -> None:
    # lifecycle_test.py test_triton_grpc_error_error_on / _error_off: every odd request
    # passes, every even one fails with StatusCode.INTERNAL (the model's own error).
    model = load("execute_grpc_error")
    for i in range(4):
        input_data = _fp32(2, 2)
        if i % 2 == 0:
            assert np.array_equal(model.infer({"IN": input_data})["OUT"], input_data)
            continue
        with pytest.raises(InferenceError) as e:
            model.infer({"IN": input_data})
        assert e.value.code() is TritonError.INTERNAL
        assert e.value.message() == "An error occurred during execution"


@pytest.mark.parametrize("mode", ["MODE_ERROR_ONLY", "MODE_ERROR_FINAL",
                                  "MODE_ERROR_WITH_DELAYED_FINAL"])
def test_decoupled_grpc_error(load: Loader, mode: str) -> None:
    # lifecycle_test.py test_triton_grpc_error_decoupled_delayed_final: the first response
    # is the input, the second an INTERNAL error, then nothing more. MODE_ERROR_ONLY's
    # sender goes without the final flag (Triton's client then waits for nothing more): the
    # request ends with ResponseSenderDropped, at once, and the stub serves on.
    input_data = _fp32(2)
    stream = load("decoupled_grpc_error").stream(
        {"IN": input_data, "MODE": np.array([bytes(mode, "utf-8")], dtype=object)}
    )
    assert np.array_equal(next(stream)["OUT"], input_data)
    with pytest.raises(InferenceError) as e:
        next(stream)
    assert e.value.code() is TritonError.INTERNAL
    assert e.value.message() == "An error occurred during execution"
    if mode == "MODE_ERROR_ONLY":
        with pytest.raises(ResponseSenderDropped):
            next(stream)
    else:
        with pytest.raises(StopIteration):
            next(stream)


def test_execute_return_error(load: Loader) -> None:
    # lifecycle/test.sh loads execute_return_error; its execute returns None, then
    # [None] * len(requests), without sending anything. Triton leaves such a request
    # without a response (the client waits until its own timeout); the runtime fails it
    # at once (stricter here).
    model = load("execute_return_error")
    for _ in range(2):
        with pytest.raises(InferenceError) as e:
            model.infer({"INPUT": _fp32(1, 4)})
        assert e.value.code() is TritonError.INTERNAL
        assert e.value.message() == (
            "Failed to process the request(s) for model 'execute_return_error_0_0', "
            "message: the model neither returned nor sent a response for the request"
        )


# -- qa/L0_backend_python/test.sh and bls/test.sh -------------------------------------------------


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_model_env(qa_repo: Path, isolated: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # test.sh: export MY_ENV="MY_ENV"; the server starts (initialize raises otherwise).
    with ModelRepository(qa_repo) as repo:
        monkeypatch.delenv("MY_ENV", raising=False)
        with pytest.raises(ModelLoadError) as e:
            repo.load("model_env", isolated=isolated, timeout=60)
        assert "MY_ENV doesn't exists or contains incorrect value" in str(e.value)
        monkeypatch.setenv("MY_ENV", "MY_ENV")
        assert repo.load("model_env", isolated=isolated, timeout=60).loaded


def test_init_exit(qa_repo: Path) -> None:
    # test.sh: the stub is SIGKILLed in initialize; the server does not start and logs
    # "Stub process 'init_exit_0_0' is not healthy.". Isolated mode only: in-process, the
    # model's os.kill(os.getpid(), SIGKILL) is this process.
    with ModelRepository(qa_repo) as repo, pytest.raises(ModelLoadError) as e:
        repo.load("init_exit", isolated=True, timeout=60)
    assert "Stub process 'init_exit_0_0' is not healthy." in str(e.value)


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
def test_bls_finalize_error(
    qa_repo: Path, isolated: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # bls/test.sh: the server starts with bls_finalize_error alone; once it is stopped, its
    # log holds "BLS is only supported during the 'execute' function." (finalize's BLS).
    with ModelRepository(qa_repo) as repo:
        model = repo.load("bls_finalize_error", isolated=isolated, timeout=60)
        with caplog.at_level("ERROR", logger="pb_tensor.runtime"):
            model.unload()
    assert any("BLS is only supported during the 'execute' function." in r.getMessage()
               for r in caplog.records)  # fmt: skip


# The model's Dropout2d warns on its 2-D input; in-process models share this process's
# warning filters, which this suite turns into errors.
@pytest.mark.filterwarnings("ignore:dropout2d:UserWarning")
def test_infer_pytorch(load: Loader) -> None:
    # python_test.py test_infer_pytorch: a seeded MNIST network on a zero tensor.
    pytest.importorskip("torch")
    input_data = np.zeros([1, 1, 28, 28], dtype=np.float32)
    output_data = load("pytorch_fp32_fp32").infer({"IN": input_data})["OUT"]
    assert output_data is not None, "error: expected 'OUT'"
    # expected inference response from a zero tensor
    expected_result = [
        -2.2377274, -2.3976364, -2.2464046, -2.2790744, -2.3828976,
        -2.2940576, -2.2928185, -2.340665, -2.275219, -2.292135,
    ]  # fmt: skip
    assert np.allclose(output_data[0], expected_result), "Inference result is not correct"


def test_default_model_filename(load: Loader) -> None:
    # test.sh starts the server with default_model_name (its model file is mymodel.py);
    # python_test.py's _infer_help on it.
    input_data_0 = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    output0 = load("default_model_name").infer({"INPUT0": input_data_0})["OUTPUT0"]
    assert np.all(input_data_0 == output0)


# -- qa/L0_backend_python/decoupled (decoupled_test.py) -------------------------------------------


def test_decoupled_execute_error(load: Loader) -> None:
    # Two requests in one batch (the config's dynamic batcher gathers them): the first
    # gets the model's error response, the second its input back.
    input_datas = [_fp32(2, 2), _fp32(2, 2) + 1]
    results = load("decoupled_execute_error").infer_many([{"IN": x} for x in input_datas])
    assert isinstance(results[0], InferenceError)
    assert not isinstance(results[1], InferenceError)
    assert np.array_equal(results[1]["OUT"], input_datas[1])


def test_decoupled_raise_exception(load: Loader) -> None:
    # Ten requests, each answered with the model's exception; the model stays ready.
    model = load("decoupled_raise_exception")
    for _ in range(10):
        with pytest.raises(InferenceError) as e:
            list(model.stream({"IN": _fp32(2, 2)}))
        assert "Intentional Error" in e.value.message()
    assert model.is_ready()


def _input01() -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    return {"INPUT0": rng.random(16).astype(np.float32),
            "INPUT1": rng.random(16).astype(np.float32)}  # fmt: skip


def test_decoupled_return_response_error(load: Loader) -> None:
    with pytest.raises(InferenceError) as e:
        list(load("decoupled_return_response_error").stream(_input01()))
    assert (
        "Python model 'decoupled_return_response_error_0_0' is using "
        "the decoupled mode and the execute function must return "
        "None."
    ) in e.value.message()


def test_decoupled_send_after_close_error(load: Loader) -> None:
    # The model closes its sender, then sends: the error cannot reach the client, which
    # gets no response at all.
    assert list(load("decoupled_send_after_close_error").stream(_input01())) == []


# -- qa/L0_backend_python/io (io_test.py) ---------------------------------------------------------


def test_requested_output_decoupled_prior_crash(load: Loader) -> None:
    text_input_data = np.array([["test"]]).astype(object)
    outputs = ""
    for result in load("llm").stream(
        {"text_input": text_input_data}, requested_outputs=["text_output"]
    ):
        outputs += str(result["text_output"][0], encoding="utf-8")
    assert len(outputs) > 0, "text_output is empty"


# -- qa/L0_string_io (string_client_test.py) ------------------------------------------------------

_UNICODE_BYTES = [
    b"\nF\n'\n\x01a\x12\"\x1a \n\x1e\xfa\x03\x94\x01\x0f\xd7\x02\xf1\x05\xdf\x01\x82\x03\xb5\x05\xc1\x07\xba\x06\xff\x06\xc7\x07L\xf5\x03\xe2\x07\xa9\x03\n\x0c\n\x01b\x12\x07\x1a\x05\n\x03\x89\xcc=\n\r\n\x01c\x12\x08\x12\x06\n\x04\xdf\\\xcb\xbf",  # noqa: E501
    b"\n:\n\x1a\n\x01a\x12\x15\x1a\x13\n\x11*\xe3\x05\xc5\x06\xda\x07\xcb\x06~\xb1\x05\xb3\x01\xa9\x02\x15\n\r\n\x01b\x12\x08\x1a\x06\n\x04\xf6\xa2\xc5\x01\n\r\n\x01c\x12\x08\x12\x06\n\x04\xbb[\n\xbf",
    b"\nL\n-\n\x01a\x12(\x1a&\n$\x87\x07\xce\x01\xe7\x06\xee\x04\xe1\x03\xf1\x03\xd7\x07\xbe\x02\xb8\x05\xe0\x05\xe4\x01\x88\x06\xb6\x03\xb9\x05\x83\x06\xf8\x04\xe2\x04\xf4\x06\n\x0c\n\x01b\x12\x07\x1a\x05\n\x03\x89\xcc=\n\r\n\x01c\x12\x08\x12\x06\n\x04\xbc\x99+@",
    b"\n2\n\x12\n\x01a\x12\r\x1a\x0b\n\t\x99\x02\xde\x04\x9f\x04\xc5\x053\n\r\n\x01b\x12\x08\x1a\x06\n\x04\xf6\xa2\xc5\x01\n\r\n\x01c\x12\x08\x12\x06\n\x04\x12\x07\x83\xbe",
    b"\nJ\n\r\n\x01b\x12\x08\x1a\x06\n\x04\x9b\x94\xad\x04\n\r\n\x01c\x12\x08\x12\x06\n\x04\xc3\x8a\x08\xbf\n*\n\x01a\x12%\x1a#\n!\x9c\x02\xb2\x02\xcd\x02\x9d\x07\x8d\x01\xb6\x05a\xf1\x01\xf0\x05\xdb\x02\xac\x04\xbd\x05\xe0\x04\xd2\x06\xaf\x02\xa8\x01\x8b\x04",
    b"\n3\n\x13\n\x01a\x12\x0e\x1a\x0c\n\n<\xe2\x05\x8a\x01\xb3\x07?\xfd\x01\n\r\n\x01b\x12\x08\x1a\x06\n\x04\xf6\xa2\xc5\x01\n\r\n\x01c\x12\x08\x12\x06\n\x04\x1b\x931\xbf\x00\x00",
    b"\n&\n\x07\n\x01a\x12\x02\x1a\x00\n\x0c\n\x01b\x12\x07\x1a\x05\n\x03\x89\xcc=\n\r\n\x01c\x12\x08\x12\x06\n\x04{\xbc\x0e>\x00\x00\x00",
    b"\nF\n'\n\x01a\x12\"\x1a \n\x1e\x97\x01\x93\x02\x9e\x01\xac\x06\xff\x01\xd8\x05\xe1\x07\xd8\x04g]\x9a\x05\xff\x06\xde\x07\x8f\x04\x97\x04\xda\x03\n\x0c\n\x01b\x12\x07\x1a\x05\n\x03\x9a\xb7I\n\r\n\x01c\x12\x08\x12\x06\n\x04\xfb\x87\x83\xbf",  # noqa: E501
]


def test_string_identity(load: Loader) -> None:
    # _test_bytes("string_identity") for the clients that send binary data (gRPC, HTTP
    # binary); HTTP's JSON clients refusing non-UTF-8 data is the front end's concern.
    model = load("string_identity")

    def infer(input_: np.ndarray[Any, Any]) -> Any:
        return model.infer({"INPUT0": input_}, requested_outputs=["OUTPUT0"])["OUTPUT0"]

    for dtype in (np.object_, np.object_, np.bytes_):  # _test_str_dtype: default, dtypes
        in0_bytes = np.array([str(i) for i in range(10000, 10008)], dtype=dtype)
        assert np.array_equal(in0_bytes.astype(np.bytes_), infer(in0_bytes))
        in0_bytes = np.array([i for i in range(10000, 10008)], dtype=dtype)
        assert np.array_equal(in0_bytes.astype(np.bytes_), infer(in0_bytes))
    for dtype in ("|S78", np.object_, np.bytes_):  # _test_unicode_bytes_dtype
        in0 = np.array([[b] for b in _UNICODE_BYTES], dtype=dtype).flatten()
        assert np.array_equal(in0, infer(in0))


# -- qa/L0_backend_python/request_rescheduling --------------------------------------------------


def test_wrong_return_type(load: Loader) -> None:
    # bls_request_rescheduling's test_wrong_return_type: a response returned for a request
    # the model marked for rescheduling is an error.
    input0 = np.random.default_rng(0).standard_normal(4).astype(np.float32)
    with pytest.raises(InferenceError) as e:
        load("wrong_return_type").infer({"INPUT0": input0}, requested_outputs=["OUTPUT0"])
    assert (
        "Expected a None object in the execute function return list for reschduled request"
    ) in e.value.message()



# -- qa/L0_backend_python/model_readiness (test_model_readiness.py, test.sh) ----------------------

READINESS = QA_BACKEND_PYTHON / "model_readiness" / "test_models"
# test.sh's models but is_ready_fn_timeout (its eight seconds run against the server, in
# tests/test_upstream_model_readiness.py)
_READINESS = {n: v for n, v in READINESS_MODELS.items() if n != "is_ready_fn_timeout"}


def _readiness_config(name: str, return_value: str, delay_secs: str) -> Callable[[str], str]:
    """identity_fp32's configuration renamed, with test.sh's two parameters appended."""
    params = (
        'parameters: {\n  key: "READINESS_FN_RETURN_VALUE"\n'
        f'  value: {{ string_value: "{return_value}" }}\n}}\n'
        'parameters: {\n  key: "READINESS_FN_DELAY_SECS"\n'
        f'  value: {{ string_value: "{delay_secs}" }}\n}}\n'
    )
    return lambda text: _sed_name(name)(text) + params


@pytest.fixture(scope="module")
def readiness_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    identity = PYTHON_MODELS / "identity_fp32"
    files: dict[str, tuple[Path, Path | None]] = {
        name: (READINESS / ("readiness_coroutine_model.py" if value == "coroutine"
                            else "readiness_model.py"), identity / "config.pbtxt")
        for name, (value, _) in _READINESS.items()
    }  # fmt: skip
    return repository(
        tmp_path_factory.mktemp("readiness"),
        {"identity_fp32": identity},
        files=files,
        config_edit={n: _readiness_config(n, *v) for n, v in _READINESS.items()},
    )


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "isolated"])
def ready_load(request: pytest.FixtureRequest, readiness_repo: Path) -> Iterator[Loader]:
    isolated: bool = request.param
    cache: dict[str, LoadedModel] = {}
    with ModelRepository(readiness_repo) as repo:

        def get(name: str) -> LoadedModel:
            if name not in cache:
                cache[name] = repo.load(name, isolated=isolated, timeout=60)
            return cache[name]

        yield get


def _call_inference_identity_model(model: LoadedModel) -> None:
    input_data = np.ones((1, 8), dtype=np.float32)
    output_data = model.infer({"INPUT0": input_data})["OUTPUT0"]
    np.testing.assert_array_almost_equal(
        input_data, output_data, err_msg=f"Inference output mismatch for {model.name}"
    )


@pytest.mark.parametrize("signum", [11, 9])
def test_model_not_ready_after_stub_killed(
    readiness_repo: Path, signum: int, caplog: pytest.LogCaptureFixture
) -> None:
    # test.sh: the model is ready and answers; its stub killed with SIGSEGV / SIGKILL, the
    # model is not ready and the log names the unhealthy stub. Isolated mode only (the
    # in-process model has no stub to kill).
    with ModelRepository(readiness_repo) as repo:
        model = repo.load("identity_fp32", isolated=True, timeout=60)
        assert model.is_ready()
        _call_inference_identity_model(model)
        assert model.pid is not None
        os.kill(model.pid, signum)
        time.sleep(1)  # (test.sh: sleep 1)
        with caplog.at_level(logging.DEBUG, logger="pb_tensor.runtime"):
            assert not model.is_ready()
    # test.sh greps the server's verbose log for core's line
    expected = ("Model 'identity_fp32' version 1 is not ready: Stub process "
                "'identity_fp32_0_0' is not healthy.")  # fmt: skip
    assert any(expected in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("name", "ready"),
    [("is_ready_fn_returns_true", True), ("is_ready_fn_returns_false", False),
     ("is_ready_fn_raises_error", False), ("is_ready_fn_returns_non_boolean", False)],
)  # fmt: skip
def test_user_defined_is_ready(ready_load: Loader, name: str, ready: bool) -> None:
    # test_is_ready_returns_true / _false / _raises_exception / _returns_non_boolean: ten
    # checks in a row (upstream asks over HTTP and gRPC: here one check stands for both),
    # inference unaffected by them.
    model = ready_load(name)
    for _ in range(10):
        assert model.is_ready() is ready
        _call_inference_identity_model(model)


def test_is_ready_coroutine_returns_true(ready_load: Loader) -> None:
    model = ready_load("is_ready_fn_coroutine_returns_true")
    for _ in range(5):
        assert model.is_ready(), "Model (coroutine) should be READY"
    _call_inference_identity_model(model)


# -- qa/L0_model_config (test.sh): Python models' auto_complete_config errors ------------------

AUTOFILL = UPSTREAM / "server" / "qa" / "L0_model_config" / "autofill_noplatform" / "python"
AUTOFILL_CASES = sorted(p.name for p in AUTOFILL.iterdir() if p.is_dir())


@pytest.mark.parametrize("isolated", [False, True], ids=["in_process", "isolated"])
@pytest.mark.parametrize("case", AUTOFILL_CASES)
def test_autofill_noplatform_python(tmp_path: Path, case: str, isolated: bool) -> None:
    # test.sh copies each case as a model (cases without a model.py of their own get
    # qa/python_models/auto_complete's) and expects the server not to start, its log
    # matching one of the case's expected* patterns (grep).
    source = AUTOFILL / case
    model = shutil.copytree(source, tmp_path / case)
    (model / "1").mkdir()
    own = source / "model.py"
    shutil.copy(own if own.is_file() else PYTHON_MODELS / "auto_complete" / "model.py",
                model / "1" / "model.py")  # fmt: skip
    expecteds = [p.read_text().strip() for p in sorted(source.glob("expected*"))]
    assert expecteds
    with ModelRepository(tmp_path) as repo, pytest.raises(ModelLoadError) as e:
        repo.load(case, isolated=isolated, timeout=60)
    assert any(re.search(ex, str(e.value)) for ex in expecteds), str(e.value)
