"""Statistics over HTTP and gRPC and Triton's ``nv_inference_*`` metrics, from what the runtime
records (``LoadedModel.statistics()``)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from serve_support import EXAMPLES, add_sub_json, needs_serve, raw

pytestmark = needs_serve


def test_statistics(triton_server: Any) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    server = triton_server(EXAMPLES, model_control_mode="explicit", load_models=["add_sub"])
    for values in ([1.0], [1.0, 2.0], [3.0]):
        status, _, _ = raw(server.http_url, "POST", "/v2/models/add_sub/infer",
                           json.dumps(add_sub_json(values)).encode())
        assert status == 200
    invalid = {"inputs": add_sub_json()["inputs"][:1]}  # a request Triton refuses
    status, _, _ = raw(server.http_url, "POST", "/v2/models/add_sub/infer",
                       json.dumps(invalid).encode())
    assert status == 400
    with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
        metrics = response.read().decode()
    assert 'nv_inference_pending_request_count{model="add_sub",version="1"} 0' in metrics
    with httpclient.InferenceServerClient(server.http_url) as client:
        assert "statistics" in client.get_server_metadata()["extensions"]
        stats = client.get_inference_statistics("add_sub")["model_stats"]
        every = client.get_inference_statistics()["model_stats"]
        with pytest.raises(InferenceServerException) as caught:
            client.get_inference_statistics("nope")
        assert caught.value.message() == "Request for unknown model: 'nope' is not found"
    assert every == stats
    [entry] = stats
    assert (entry["name"], entry["version"]) == ("add_sub", "1")
    assert entry["inference_count"] == 3
    assert entry["execution_count"] == 3
    assert entry["inference_stats"]["success"]["count"] == 3
    assert entry["inference_stats"]["fail"]["count"] == 1
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        grpc_stats = client.get_inference_statistics("add_sub", as_json=True)
    [grpc_entry] = grpc_stats["model_stats"]
    assert grpc_entry["inference_stats"]["success"]["count"] == "3"  # int64 as JSON strings
    with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
        metrics = response.read().decode()
    assert "# TYPE nv_inference_request_success counter" in metrics
    assert 'nv_inference_request_success{model="add_sub",version="1"} 3' in metrics
    assert 'nv_inference_count{model="add_sub",version="1"} 3' in metrics
    assert 'nv_inference_exec_count{model="add_sub",version="1"} 3' in metrics
    assert ('nv_inference_request_failure{model="add_sub",reason="BACKEND",version="1"} 1'
            in metrics)
