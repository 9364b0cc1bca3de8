"""The system shared-memory extension over HTTP and gRPC, driven by tritonclient's own
shared-memory helpers: inputs read from registered regions, outputs written into them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from serve_support import EXAMPLES, needs_serve

pytestmark = needs_serve


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from pb_tensor.serve import Options, Server

    options = Options([EXAMPLES], http_port=0, grpc_port=0, metrics_port=0,
                      allow_metrics=False, model_control_mode="explicit",
                      load_models=["add_sub"])
    with Server(options) as running:
        yield running


@pytest.fixture
def regions() -> Iterator[tuple[Any, Any]]:
    """An input region holding two (4,) FP32 arrays and an output region of 32 bytes."""
    import tritonclient.utils.shared_memory as shm

    key = f"/pbt_serve_test_{os.getpid()}"
    inputs = shm.create_shared_memory_region("in", key + "_in", 32)
    outputs = shm.create_shared_memory_region("out", key + "_out", 32)
    shm.set_shared_memory_region(inputs, [np.arange(4, dtype=np.float32),
                                          np.full(4, 10, dtype=np.float32)])
    yield inputs, outputs
    shm.destroy_shared_memory_region(inputs)
    shm.destroy_shared_memory_region(outputs)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_in_shared_memory(server: Any, regions: tuple[Any, Any],
                                             protocol: str) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    module = httpclient if protocol == "http" else grpcclient
    url = server.http_url if protocol == "http" else server.grpc_url
    key = f"/pbt_serve_test_{os.getpid()}"
    with module.InferenceServerClient(url) as client:
        client.register_system_shared_memory("in", key + "_in", 32)
        client.register_system_shared_memory("out", key + "_out", 32)
        try:
            status = client.get_system_shared_memory_status(
                **({"as_json": True} if protocol == "grpc" else {}))
            names = ([s["name"] for s in status] if protocol == "http"
                     else sorted(status["regions"]))
            assert names == ["in", "out"]
            with pytest.raises(InferenceServerException) as caught:
                client.register_system_shared_memory("in", key + "_in", 32)
            assert caught.value.message() == "shared memory region 'in' already in manager"
            inputs = [module.InferInput("INPUT0", [4], "FP32"),
                      module.InferInput("INPUT1", [4], "FP32")]
            inputs[0].set_shared_memory("in", 16)
            inputs[1].set_shared_memory("in", 16, offset=16)
            outputs = [module.InferRequestedOutput("OUTPUT0"),
                       module.InferRequestedOutput("OUTPUT1")]
            outputs[0].set_shared_memory("out", 16)
            outputs[1].set_shared_memory("out", 16, offset=16)
            client.infer("add_sub", inputs, outputs=outputs)
            out = regions[1]
            assert shm.get_contents_as_numpy(out, np.float32, [4]).tolist() == [
                10.0, 11.0, 12.0, 13.0]
            assert shm.get_contents_as_numpy(out, np.float32, [4], offset=16).tolist() == [
                -10.0, -9.0, -8.0, -7.0]
            # An output region too small, and a region that is not registered.
            outputs[0].set_shared_memory("out", 8)
            with pytest.raises(InferenceServerException) as caught:
                client.infer("add_sub", inputs, outputs=outputs)
            assert caught.value.message() == (
                "shared memory size specified with the request for output 'OUTPUT0' (8 bytes) "
                "should be at least 16 bytes to hold the results")
            inputs[0].set_shared_memory("nowhere", 16)
            with pytest.raises(InferenceServerException) as caught:
                client.infer("add_sub", inputs)
            assert caught.value.message() == "Unable to find shared memory region: 'nowhere'"
        finally:
            client.unregister_system_shared_memory()
        status = client.get_system_shared_memory_status(
            **({"as_json": True} if protocol == "grpc" else {}))
        assert status == ([] if protocol == "http" else {})
