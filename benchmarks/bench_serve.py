"""Benchmark of ``pb-tensor serve``: add_sub over HTTP and gRPC at concurrency 1 and 16, for
``serve --in-process`` and ``serve`` (stub processes), and a 64 MiB FP32 tensor over HTTP binary
data against the same bytes sent over a raw loopback socket.

One load generator for every server (threads, one persistent connection each: raw
``http.client`` requests with the binary-data extension, and grpcio's unary calls with
Triton's ``ModelInferRequest``), rounds interleaved between the servers so that load changes
on the machine fall on both. Prints requests per second and p50 / p99 latencies per case.
KServe's and MLServer's servers are not installed here; the issue's comparison with them is
not made by this script.

Usage: ``python benchmarks/bench_serve.py [--quick]`` (needs the serve extra).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

EXAMPLES = os.path.join(ROOT, "examples", "model_repository")


class Serve:
    """``python -m pb_tensor serve`` for add_sub in a subprocess."""

    def __init__(self, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pb_tensor", "serve", "--model-repository", EXAMPLES,
             "--model-control-mode=explicit", "--load-model", "add_sub", "--http-port", "0",
             "--grpc-port", "0", "--allow-metrics=false", "--http-max-input-size",
             str(1 << 30), *extra],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.http = self.grpc = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            found = re.search(r"Started (\w+) at (\S+)", line)
            if found and found.group(1) == "GRPCInferenceService":
                self.grpc = found.group(2)
            elif found and found.group(1) == "HTTPService":
                self.http = found.group(2)
                break
        if not self.http:
            raise RuntimeError("serve did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def _add_sub_http_body(n: int) -> tuple[bytes, dict[str, str]]:
    data = np.arange(n, dtype=np.float32).tobytes()
    head = json.dumps({"inputs": [
        {"name": f"INPUT{i}", "datatype": "FP32", "shape": [n],
         "parameters": {"binary_data_size": len(data)}} for i in (0, 1)],
        "parameters": {"binary_data_output": True}}).encode()  # fmt: skip
    return head + data + data, {"Inference-Header-Content-Length": str(len(head)),
                                "Content-Type": "application/octet-stream"}


def http_worker(url: str, body: bytes, headers: dict[str, str], path: str
                ) -> Callable[[], None]:
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)

    def call() -> None:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")

    return call


def grpc_worker(url: str, n: int) -> Callable[[], None]:
    import grpc

    from pb_tensor.serve._protos import message

    request_cls = message("ModelInferRequest")
    response_cls = message("ModelInferResponse")
    channel = grpc.insecure_channel(url)
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=request_cls.SerializeToString,
                                response_deserializer=response_cls.FromString)
    request = request_cls(model_name="add_sub")
    data = np.arange(n, dtype=np.float32).tobytes()
    for i in (0, 1):
        request.inputs.add(name=f"INPUT{i}", datatype="FP32", shape=[n])
        request.raw_input_contents.append(data)

    def call() -> None:
        infer(request, timeout=120)

    return call


def run(make: Callable[[], Callable[[], None]], concurrency: int, requests: int
        ) -> tuple[float, list[float]]:
    """Requests per second and the latencies (seconds) of ``requests`` calls spread over
    ``concurrency`` threads."""
    calls = [make() for _ in range(concurrency)]
    for call in calls:
        call()  # warm the connection
    latencies: list[float] = []
    lock = threading.Lock()
    per_thread = max(1, requests // concurrency)

    def loop(call: Callable[[], None]) -> None:
        mine = []
        for _ in range(per_thread):
            t = time.perf_counter()
            call()
            mine.append(time.perf_counter() - t)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=loop, args=(c,)) for c in calls]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return len(latencies) / elapsed, latencies


def _raw_socket_seconds(payload: bytes) -> float:
    """Seconds to send ``payload`` over a loopback TCP socket and get one byte back."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def sink() -> None:
        conn, _ = server.accept()
        left = len(payload)
        while left:
            left -= len(conn.recv(min(left, 1 << 20)))
        conn.sendall(b"x")
        conn.close()

    thread = threading.Thread(target=sink)
    thread.start()
    t = time.perf_counter()
    with socket.create_connection(server.getsockname()) as client:
        client.sendall(payload)
        client.recv(1)
    elapsed = time.perf_counter() - t
    thread.join()
    server.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    args = parser.parse_args()
    requests = 400 if args.quick else 3000
    rounds = 2 if args.quick else 3
    servers = {"in-process": Serve("--in-process"), "stub": Serve()}
    results: dict[tuple[str, str, int], list[tuple[float, list[float]]]] = {}
    try:
        body, headers = _add_sub_http_body(16)
        for _ in range(rounds):
            for mode, serve in servers.items():
                for concurrency in (1, 16):
                    http_make = lambda s=serve: http_worker(  # noqa: E731
                        s.http, body, headers, "/v2/models/add_sub/infer")
                    grpc_make = lambda s=serve: grpc_worker(s.grpc, 16)  # noqa: E731
                    for proto, make in (("HTTP", http_make), ("gRPC", grpc_make)):
                        results.setdefault((mode, proto, concurrency), []).append(
                            run(make, concurrency, requests))
        print(f"add_sub, two (16,) FP32 inputs, {requests} requests per case, best of "
              f"{rounds} interleaved rounds")
        print(f"{'server':<12}{'protocol':<10}{'clients':>8}{'req/s':>10}{'p50 ms':>10}"
              f"{'p99 ms':>10}")
        for (mode, proto, concurrency), runs in results.items():
            rate, lat = max(runs, key=lambda r: r[0])
            q = statistics.quantiles(lat, n=100)
            print(f"{mode:<12}{proto:<10}{concurrency:>8}{rate:>10.0f}{q[49] * 1e3:>10.2f}"
                  f"{q[98] * 1e3:>10.2f}")
        for mode in servers:
            for proto in ("HTTP", "gRPC"):
                one = max(r[0] for r in results[(mode, proto, 1)])
                many = max(r[0] for r in results[(mode, proto, 16)])
                print(f"{mode} {proto}: 16 clients / 1 client throughput = {many / one:.2f}x")
        # 64 MiB over HTTP binary data (two 32 MiB inputs; 64 MiB of outputs come back) vs
        # the same 64 MiB over a raw loopback socket.
        big, big_headers = _add_sub_http_body(8 * 1024 * 1024)
        call = http_worker(servers["in-process"].http, big, big_headers,
                           "/v2/models/add_sub/infer")
        times, raw_times = [], []
        payload = bytes(64 * 1024 * 1024)
        for _ in range(rounds):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
            raw_times.append(_raw_socket_seconds(payload))
        best, raw_best = min(times), min(raw_times)
        print(f"64 MiB of FP32 inputs over HTTP binary data, in-process, 64 MiB of outputs "
              f"back: {best * 1e3:.0f} ms; 64 MiB one way over a raw loopback socket: "
              f"{raw_best * 1e3:.0f} ms; per 64 MiB moved: {best / 2 / raw_best:.2f}x the "
              "socket")
    finally:
        for serve in servers.values():
            serve.stop()


if __name__ == "__main__":
    main()
