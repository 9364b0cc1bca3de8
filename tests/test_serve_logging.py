"""The logging extension's refusals (tritonserver's texts and statuses over HTTP and gRPC),
and what the settings let through, in tritonserver's line format. The extension's accepted
updates run in upstream's own tests (``tests/test_upstream_logging.py``)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from serve_support import EXAMPLES, needs_serve, raw

pytestmark = needs_serve

_DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
             "log_verbose_level": 0, "log_format": "default"}  # fmt: skip


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from pb_tensor.serve import Options, Server

    options = Options([EXAMPLES], http_port=0, grpc_port=0, metrics_port=0,
                      model_control_mode="explicit", load_models=["add_sub"], in_process=True)
    with Server(options) as running:
        yield running


@pytest.fixture(autouse=True)
def _reset(server: Any) -> Iterator[None]:
    yield
    server.core.log_settings.update_json({k: v for k, v in _DEFAULTS.items() if k != "log_file"})


def _post(server: Any, body: bytes) -> tuple[int, Any]:
    status, _, data = raw(server.http_url, "POST", "/v2/logging", body)
    return status, json.loads(data)


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [(b'{"log_info": 1}', 500, "attempt to access JSON non-boolean as boolean"),
     (b'{"log_verbose_level": -1}', 500,
      "attempt to access JSON non-unsigned-integer as unsigned-integer"),
     (b'{"log_verbose_level": 1.5}', 500,
      "attempt to access JSON non-unsigned-integer as unsigned-integer"),
     (b'{"log_format": 7}', 500, "attempt to access JSON non-string as string"),
     (b'{"log_format": "json"}', 503, "invalid argument for --log_format, got: json"),
     (b'{"log_file": "x.log", "log_info": false}', 501,
      "log file location can not be updated through network protocol"),
     (b'{"log_info": ', 400,
      "failed to parse the request JSON buffer: Invalid value. at 13")],
)  # fmt: skip
def test_http_refusals(server: Any, body: bytes, status: int, error: str) -> None:
    assert _post(server, body) == (status, {"error": error})
    # (log_file is looked at first: log_info stayed as it was)
    assert raw(server.http_url, "GET", "/v2/logging")[2] == json.dumps(
        _DEFAULTS, separators=(",", ":")).encode()


def test_http_changes_apply_in_order(server: Any) -> None:
    # tritonserver applies the settings one by one: those before a refused one stay changed
    assert _post(server, b'{"log_info": false, "log_verbose_level": "1"}') == (
        500, {"error": "attempt to access JSON non-unsigned-integer as unsigned-integer"})
    assert json.loads(raw(server.http_url, "GET", "/v2/logging")[2])["log_info"] is False
    # an empty body is refused as tritonserver refuses it (it parses it), changing nothing
    assert _post(server, b"") == (400, {"error": "failed to parse the request JSON buffer: "
                                                 "The document is empty. at 0"})
    assert json.loads(raw(server.http_url, "GET", "/v2/logging")[2])["log_info"] is False
    assert raw(server.http_url, "PUT", "/v2/logging")[0] == 405


@pytest.mark.parametrize(
    ("settings", "error"),
    [({"log_info": 1}, "expect boolean for 'log_info'"),
     ({"log_verbose_level": True}, "expect int32 for 'log_verbose_level'"),
     ({"log_format": True}, "expect string for 'log_format'"),
     ({"log_format": "json"}, "invalid argument for log_format, got: json"),
     ({"log_file": ""}, "log file location can not be updated through network protocol")],
)  # fmt: skip
def test_grpc_refusals(server: Any, settings: dict[str, Any], error: str) -> None:
    # (tritonclient picks each value's kind by its name: the request is made here)
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.LogSettingsRequest()
    for name, value in settings.items():
        kind = ("bool_param" if isinstance(value, bool) else
                "uint32_param" if isinstance(value, int) else "string_param")  # fmt: skip
        setattr(request.settings[name], kind, value)
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.LogSettings(request, timeout=30)
    assert caught.value.details() == error  # type: ignore[attr-defined]
    expected = grpc.StatusCode.UNIMPLEMENTED if "log_file" in settings else (
        grpc.StatusCode.INVALID_ARGUMENT)
    assert caught.value.code() == expected  # type: ignore[attr-defined]


def _record(level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord("pb_tensor.runtime.model.m", level, "/models/m/1/model.py", 12,
                             message, None, None)  # fmt: skip


def test_what_the_settings_let_through_and_how_it_reads() -> None:
    from pb_tensor.serve._logging import LogSettings, TritonFormatter

    settings = LogSettings()
    levels = (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
    assert [settings.filter(_record(n, "x")) for n in levels] == [False, True, True, True, True]
    settings.update_json({"log_info": False, "log_error": False, "log_verbose_level": 2})
    assert [settings.filter(_record(n, "x")) for n in levels] == [True, False, True, False, False]
    formatter = TritonFormatter(settings)
    line = formatter.format(_record(logging.DEBUG, 'say "hi"\nnext'))
    assert re.fullmatch(r'I\d{4} \d{2}:\d{2}:\d{2}\.\d{6} \d+ model\.py:12\] "say \\"hi\\"\\nnext"',
                        line), line  # fmt: skip
    settings.update_json({"log_format": "ISO8601"})
    line = formatter.format(_record(logging.WARNING, "careful"))
    assert re.fullmatch(r'\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z W \d+ model\.py:12\] "careful"',
                        line), line  # fmt: skip


def test_unescaped_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    from pb_tensor.serve._logging import LogSettings, TritonFormatter

    monkeypatch.setenv("TRITON_SERVER_ESCAPE_LOG_MESSAGES", "0")
    line = TritonFormatter(LogSettings()).format(_record(logging.ERROR, 'as "it" is'))
    assert re.fullmatch(r'E\d{4} [\d:.]+ \d+ model\.py:12\] as "it" is', line), line


def test_an_embedded_server_leaves_the_applications_logging_alone(server: Any) -> None:
    logger = logging.getLogger("pb_tensor")
    before = logger.level
    logger.setLevel(logging.WARNING + 1)  # neither level the settings would set
    try:
        for level in (1, 0):
            assert _post(server, f'{{"log_verbose_level": {level}}}'.encode())[0] == 200
            assert logger.level == logging.WARNING + 1
    finally:
        logger.setLevel(before)
