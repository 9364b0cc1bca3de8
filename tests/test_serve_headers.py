"""Request headers forwarded as request parameters, as tritonserver's
``--http-header-forward-pattern`` and ``--grpc-header-forward-pattern`` forward them: the
headers whose names the pattern matches (anywhere, ignoring case unless it starts with
``(?-i)``) reach the model as string parameters; a matching name Triton reserves is refused
with its message; other requests (generate) forward none; ``--exit-timeout-secs`` is taken."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from serve_support import needs_serve, params_echo, raw

pytestmark = needs_serve


def _ask(module: Any, url: str, headers: dict[str, str]) -> dict[str, Any]:
    with module.InferenceServerClient(url) as client:
        tensor = module.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([1], np.int32))
        # (a copy: tritonclient.http adds its own entries to the dict it is given)
        result = client.infer("echo", [tensor], parameters={"p": 1}, headers=dict(headers))
        parameters: dict[str, Any] = json.loads(result.as_numpy("OUT")[0])
        return parameters


@pytest.mark.parametrize("in_process", [False, True], ids=["stubs", "in_process"])
def test_matching_headers_become_parameters(triton_server: Any, tmp_path: Path,
                                            in_process: bool) -> None:  # fmt: skip
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    params_echo(tmp_path)
    server = triton_server(str(tmp_path), in_process=in_process, allow_metrics=False,
                           http_header_forward_pattern="MY_HEADER.*",
                           grpc_header_forward_pattern="MY_HEADER.*")  # fmt: skip
    headers = {"my_header_1": "one", "x_my_header_2": "two", "other": "no"}
    expected = {"p": 1, "my_header_1": "one", "x_my_header_2": "two"}  # (partial match)
    assert _ask(httpclient, server.http_url, headers) == expected
    assert _ask(grpcclient, server.grpc_url, headers) == expected
    # A stream's headers go with each of its requests.
    results: list[Any] = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.append(error or result),
                            headers={"my_header_s": "s"})  # fmt: skip
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([1], np.int32))
        client.async_stream_infer("echo", [tensor])
        client.async_stream_infer("echo", [tensor])
        client.stop_stream()
    assert [json.loads(r.as_numpy("OUT")[0]) for r in results] == [{"my_header_s": "s"}] * 2


def test_case_and_reserved_names(triton_server: Any, tmp_path: Path) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    params_echo(tmp_path)
    server = triton_server(str(tmp_path), in_process=True, allow_metrics=False,
                           http_header_forward_pattern=".*",
                           grpc_header_forward_pattern="(?-i)MY_HEADER.*")  # fmt: skip
    # gRPC metadata names are lower case: a case-minding upper-case pattern forwards none.
    assert _ask(grpcclient, server.grpc_url, {"my_header_1": "one"}) == {"p": 1}
    body = json.dumps({"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1],
                                   "data": [1]}]}).encode()  # fmt: skip
    for name in ("sequence_id", "timeout", "triton_anything"):
        status, _, data = raw(server.http_url, "POST", "/v2/models/echo/infer", body,
                              {name: "1"})  # fmt: skip
        assert (status, json.loads(data)) == (400, {
            "error": f"Header '{name}' is reserved for Triton usage and cannot be forwarded."})
    server = triton_server(str(tmp_path), in_process=True, allow_metrics=False,
                           allow_http=False, grpc_header_forward_pattern="time")  # fmt: skip
    with pytest.raises(InferenceServerException) as info:
        _ask(grpcclient, server.grpc_url, {"timeout": "x"})
    assert str(info.value) == ("[StatusCode.INVALID_ARGUMENT] Header 'timeout' is reserved for "
                               "Triton usage and cannot be forwarded.")


def test_an_invalid_pattern_is_refused_at_start() -> None:
    from pb_tensor.serve import Options, ServeError, Server

    options = Options(["."], http_port=0, grpc_port=0, metrics_port=0,
                      http_header_forward_pattern="MY_(")
    with pytest.raises(ServeError, match=r"^invalid --http-header-forward-pattern 'MY_\(': "):
        Server(options)
    options.http_header_forward_pattern = "MY_(?=X)"  # Python's, not RE2's
    with pytest.raises(ServeError, match="lookarounds, backreferences and conditionals are "
                                         "not RE2 syntax"):  # fmt: skip
        Server(options)


def test_the_flags_are_tritonservers() -> None:
    import argparse

    from pb_tensor.serve._cli import add_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = options_from_args(parser.parse_args([
        "--model-repository=.", "--exit-timeout-secs=120",
        "--grpc-header-forward-pattern", "(?-i)MY_HEADER.*",
        "--http-header-forward-pattern", "MY_HEADER.*"]))  # fmt: skip
    assert options.exit_timeout_secs == 120
    assert options.grpc_header_forward_pattern == "(?-i)MY_HEADER.*"
    assert options.http_header_forward_pattern == "MY_HEADER.*"
