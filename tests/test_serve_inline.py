"""With ``--in-process --inline-quick-models`` (an opt-in; by default every request runs on a
worker thread, as Triton's stub runs ``execute`` where no asyncio loop is running), a model
that has shown it is quick runs on the event loop's thread (no hand-over to a worker
thread); one that turns slow there goes back to the workers, for
good after the second time; models whose scheduler waits for other requests never run
there. The model tells which thread ran it."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from serve_support import needs_serve, raw

pytestmark = needs_serve

_MODEL = textwrap.dedent("""
    import asyncio
    import json
    import threading
    import time

    import numpy as np
    import triton_python_backend_utils as pb_utils


    async def _suffix():
        await asyncio.sleep(0)
        return b" asyncio.run"


    class TritonPythonModel:
        def execute(self, requests):
            responses = []
            for request in requests:
                parameters = json.loads(request.parameters())
                pause = parameters.get("sleep_ms", 0)
                if pause:
                    time.sleep(pause / 1000)
                x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
                name = threading.current_thread().name.encode()
                if parameters.get("asyncio_run"):  # as in Triton's stub: no loop is running
                    name += asyncio.run(_suffix())
                thread = np.array([name] * x.size, dtype=object).reshape(x.shape)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("THREAD", thread)]))
            return responses
""")
_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: {batch}
{extra}
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "THREAD" data_type: TYPE_STRING dims: [ 1 ] }} ]
"""
_LOOP = "pb-tensor-serve-http"  # the HTTP service's event-loop thread
_WORKER = "pb-tensor-serve-infer"


def _repository(tmp_path_factory: Any) -> str:
    root = tmp_path_factory.mktemp("inline")
    for name, batch, extra in (("quick", 0, ""), ("batched", 4, "dynamic_batching { }")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(
            _CONFIG.format(name=name, batch=batch, extra=extra))
        (root / name / "1" / "model.py").write_text(_MODEL)
    return str(root)


@pytest.fixture(scope="module")
def server(tmp_path_factory: Any) -> Iterator[Any]:
    from pb_tensor.serve import Options, Server

    options = Options([_repository(tmp_path_factory)], http_port=0, grpc_port=0, metrics_port=0,
                      allow_metrics=False, allow_grpc=False, in_process=True,
                      inline_quick_models=True)
    with Server(options) as running:
        yield running


def _thread(server: Any, model: str, sleep_ms: int = 0, asyncio_run: bool = False) -> str:
    shape = [1, 1] if model == "batched" else [1]
    body: dict[str, Any] = {"inputs": [{"name": "X", "datatype": "INT32", "shape": shape,
                                        "data": [0]}]}
    if sleep_ms or asyncio_run:
        body["parameters"] = {"sleep_ms": sleep_ms, "asyncio_run": asyncio_run}
    status, _, data = raw(server.http_url, "POST", f"/v2/models/{model}/infer",
                          json.dumps(body).encode())
    assert status == 200, data
    name: str = json.loads(data)["outputs"][0]["data"][0]
    return name


def _until_loop(server: Any, model: str) -> int:
    """Requests sent until one ran on the loop's thread (the ones before ran on workers)."""
    from pb_tensor.serve._inline import WARMUP

    for count in range(1, 20 * WARMUP):
        thread = _thread(server, model)
        if thread == _LOOP:
            return count
        assert thread.startswith(_WORKER), thread
    raise AssertionError(f"no request of {model} ran on the event loop's thread")


def test_quick_model_moves_to_the_loop_and_back_when_slow(server: Any) -> None:
    from pb_tensor.serve._inline import SLOW_NS, STRIKES, WARMUP

    slow_ms = SLOW_NS // 1_000_000 + 5
    assert STRIKES == 2
    # Warm-up on the workers, then the loop's thread.
    assert _until_loop(server, "quick") > WARMUP
    assert _thread(server, "quick") == _LOOP
    # A slow run on the loop's thread (strike one): back to the workers and the warm-up.
    assert _thread(server, "quick", sleep_ms=slow_ms) == _LOOP
    assert _until_loop(server, "quick") > WARMUP
    # The second strike: the workers for good.
    assert _thread(server, "quick", sleep_ms=slow_ms) == _LOOP
    threads = {_thread(server, "quick") for _ in range(3 * WARMUP)}
    assert all(t.startswith(_WORKER) for t in threads), threads


def test_inline_execute_sees_no_running_loop(tmp_path_factory: Any) -> None:
    # The loop is hidden while the model runs on its thread: asyncio.run works in execute,
    # as in Triton's stub (and on a worker thread).
    from pb_tensor.serve import Options, Server

    options = Options([_repository(tmp_path_factory)], http_port=0, grpc_port=0,
                      metrics_port=0, allow_metrics=False, allow_grpc=False, in_process=True,
                      inline_quick_models=True)  # fmt: skip
    with Server(options) as running:
        assert _thread(running, "quick", asyncio_run=True).startswith(_WORKER)
        _until_loop(running, "quick")
        assert _thread(running, "quick", asyncio_run=True) == f"{_LOOP} asyncio.run"
        # The server's loop is back: it serves, and the model runs on its thread again
        # (asyncio.run's loop took longer than a quick run: the warm-up starts again).
        _until_loop(running, "quick")


def test_models_that_wait_for_others_never_run_on_the_loop(server: Any) -> None:
    from pb_tensor.serve._inline import WARMUP, InlinePolicy

    # The batched model runs in the instance's thread, or in the worker whose request found
    # the queue empty and the instance idle: never on the event loop's thread.
    threads = {_thread(server, "batched") for _ in range(2 * WARMUP)}
    assert threads <= {"pb-tensor-batch-batched_0"} | {
        t for t in threads if t.startswith(_WORKER)
    }, threads
    policy = InlinePolicy()
    quick, batched = server.core.model("quick"), server.core.model("batched")
    for _ in range(WARMUP):
        policy.record(quick, 1000, inline=False)
        policy.record(batched, 1000, inline=False)
    assert policy.allowed(quick, alone=True)
    assert not policy.allowed(quick, alone=False)  # another request of it is in flight
    assert not policy.allowed(batched, alone=True)


def test_without_the_opt_in_every_request_runs_on_a_worker(tmp_path_factory: Any) -> None:
    from pb_tensor.serve import Options, Server
    from pb_tensor.serve._inline import WARMUP

    options = Options([_repository(tmp_path_factory)], http_port=0, grpc_port=0,
                      metrics_port=0, allow_metrics=False, allow_grpc=False, in_process=True)
    with Server(options) as running:
        threads = {_thread(running, "quick") for _ in range(3 * WARMUP)}
    assert all(t.startswith(_WORKER) for t in threads), threads
