"""The benchmark's load generator (``benchmarks/serve_load.py``) against a real server: its
HTTP/1.1 and HTTP/2 (gRPC) clients get the right answers, and a failed call (an error status,
a gRPC call answered with trailers only) or a wrong answer is an error, not a result."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from serve_support import EXAMPLES, REPO_ROOT, needs_serve

pytestmark = needs_serve

sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from pb_tensor.serve import Options, Server

    options = Options([EXAMPLES], http_port=0, grpc_port=0, metrics_port=0,
                      allow_metrics=False, model_control_mode="explicit",
                      load_models=["add_sub"], in_process=True)
    with Server(options) as running:
        yield running


def _makers(server: Any, model: str = "add_sub") -> dict[str, Any]:
    import bench_serve
    import serve_load

    body, headers = bench_serve.add_sub_http_body(16)
    request = bench_serve.grpc_request(16, model)
    return {
        "HTTP": (serve_load.http_client(server.http_url, f"/v2/models/{model}/infer", body,
                                        headers), bench_serve.http_check(16)),
        "gRPC": (serve_load.grpc_client(server.grpc_url, bench_serve.INFER, request),
                 bench_serve.grpc_check(16)),
    }  # fmt: skip


@pytest.mark.parametrize("clients", [1, 4])
@pytest.mark.parametrize("protocol", ["HTTP", "gRPC"])
def test_answers_are_checked(server: Any, protocol: str, clients: int) -> None:
    import serve_load

    make, check = _makers(server)[protocol]
    checked: list[int] = []

    def counting(answer: bytes | bytearray) -> None:
        check(answer)
        checked.append(len(answer))

    rate, latencies, cpu = serve_load.drive(make, clients, 300, counting)
    assert len(latencies) == 300
    assert rate > 0
    assert cpu >= 0
    assert checked  # the first answer was decoded and checked
    # gRPC streams keep going past the server's first connection window (65535 bytes).
    conn = make()
    for _ in range(400):
        check(serve_load.call(conn))
    conn.sock.close()


@pytest.mark.parametrize("protocol", ["HTTP", "gRPC"])
def test_wrong_answers_and_errors_raise(server: Any, protocol: str) -> None:
    import bench_serve
    import serve_load

    make, _ = _makers(server)[protocol]
    wrong = bench_serve.http_check(8) if protocol == "HTTP" else bench_serve.grpc_check(8)
    with pytest.raises(RuntimeError, match="wrong answer"):
        serve_load.drive(make, 1, 10, wrong)
    make, check = _makers(server, "no_such_model")[protocol]
    text = "HTTP answer 'HTTP/1.1 400" if protocol == "HTTP" else "without one answer"
    with pytest.raises(RuntimeError, match=text):
        serve_load.drive(make, 1, 10, check)


@pytest.mark.parametrize("pool", [0, 4], ids=["asyncio server", "thread pool"])
def test_the_grpc_floors_give_the_checked_answer(pool: int) -> None:
    # The benchmark's reference rows (peers/grpc_floor.py): each must answer the load
    # generator's request with the add_sub answer, or its rate would be no floor at all.
    import bench_serve
    import serve_load

    floor = bench_serve.GrpcFloor(pool)
    try:
        make = serve_load.grpc_client(floor.grpc, bench_serve.INFER, bench_serve.grpc_request(16))
        rate, latencies, _ = serve_load.drive(make, 2, 100, bench_serve.grpc_check(16))
        assert len(latencies) == 100
        assert rate > 0
        with pytest.raises(RuntimeError, match="wrong answer"):
            serve_load.drive(make, 1, 5, bench_serve.grpc_check(8))
    finally:
        floor.stop()
