"""Benchmark of ``pb-tensor serve`` against KServe's and MLServer's Python servers: add_sub over
HTTP and gRPC at concurrency 1 and 16, for ``serve --in-process`` (and, as the ``inline``
row, with the opt-in ``--inline-quick-models``), ``serve`` (stub processes; as ``stub
bound``, the server's threads on one CPU and its stub on the others through
``--host-policy``, where the machine has two or more), KServe's ``ModelServer`` and
MLServer (each serving the same numpy add_sub, ``benchmarks/peers/``); and a 64 MiB FP32
tensor over HTTP binary data against the same bytes sent over a raw loopback socket.
``grpc floor`` (``peers/grpc_floor.py``) is grpcio's asyncio server answering every call with
prebuilt bytes: what any server built on it costs at least; ``grpc floor pool`` the same
answers from grpcio's thread-pool server (4 threads), the floor of a server built on that.

One load generator for every server (``serve_load.py``): every request is built once as the
bytes that go on the wire (HTTP/1.1; gRPC as HTTP/2 frames with the serialised KServe v2 /
Triton ``ModelInferRequest``, inputs as ``raw_input_contents``) and written to plain
sockets, one connection per client with one request in flight, all driven by one thread;
every answer is checked (the first one decoded, the others compared with it). Rounds are
interleaved between the servers so that load changes on the machine fall on all of them.
HTTP bodies use the binary-data extension where the server has it (pb-tensor, KServe) and
JSON otherwise (MLServer); the table says which. Prints requests per second, p50 / p99
latencies and the CPU per call of the server (with its child processes, from ``/proc``)
and of the load generator, then the issue's targets.

KServe and MLServer run from the Python interpreters given with ``--kserve-python`` and
``--mlserver-python`` (default: this interpreter); one without the package is skipped with
a line saying so.

Usage: ``python benchmarks/bench_serve.py [--quick] [--only {table,big}] [--rounds N]
[--kserve-python PY] [--mlserver-python PY] [--servers NAMES] [--protocols NAMES]
[--no-big]`` (needs the serve extra); ``--only big`` runs the 64 MiB transfer alone, ``--only
table`` (or ``--no-big``) the add_sub table alone; ``--servers`` / ``--protocols``
(comma-separated) run only those rows of the add_sub table.
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
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import serve_load
from machine_load import Meter, Share, contended_note

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

EXAMPLES = os.path.join(ROOT, "examples", "model_repository")
PEERS = os.path.join(HERE, "peers")

_IDENTITY = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]) for r in requests]
"""
_IDENTITY_CONFIG = """
name: "identity"
backend: "python"
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _has_module(python: str, module: str) -> bool:
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                           check=False)
    return probe.returncode == 0


class Server:
    """A server under test in a subprocess: its HTTP and gRPC addresses, whether its HTTP
    side takes the binary-data extension, and ``stop()``."""

    binary = True
    proc: subprocess.Popen[str]
    http = ""
    grpc = ""

    def _wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        host, port = self.http.rsplit(":", 1)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{type(self).__name__} exited with {self.proc.returncode}")
            try:
                conn = http.client.HTTPConnection(host, int(port), timeout=2)
                conn.request("GET", "/v2/models/add_sub/ready")
                if conn.getresponse().status == 200:
                    conn.close()
                    return
                conn.close()
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{type(self).__name__} did not get ready")

    def cpu(self) -> float:
        """CPU seconds used so far by the server and its child processes (stubs, workers)
        alive now; 0 where ``/proc`` does not tell."""
        total, todo = 0.0, [self.proc.pid]
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        while todo:
            pid = todo.pop()
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        todo.extend(int(c) for c in f.read().split())
            except OSError:
                continue
        return total

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class Serve(Server):
    """``python -m pb_tensor serve`` in a subprocess (``cpus``: its threads bound to them,
    as ``taskset`` would)."""

    def __init__(self, *extra: str, repository: str = EXAMPLES, model: str = "add_sub",
                 cpus: set[int] | None = None) -> None:  # fmt: skip
        start = ["-m", "pb_tensor"] if cpus is None else [
            "-c", f"import os, runpy; os.sched_setaffinity(0, {cpus!r}); "
            "runpy.run_module('pb_tensor', run_name='__main__', alter_sys=True)"]
        self.proc = subprocess.Popen(
            [sys.executable, *start, "serve", "--model-repository", repository,
             "--model-control-mode=explicit", "--load-model", model, "--http-port", "0",
             "--grpc-port", "0", "--allow-metrics=false", "--http-max-input-size",
             str(1 << 30), *extra],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
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


class KServe(Server):
    """KServe's ``ModelServer`` with ``peers/kserve_add_sub.py``."""

    def __init__(self, python: str) -> None:
        http_port, grpc_port = _free_port(), _free_port()
        self.http, self.grpc = f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
        self.proc = subprocess.Popen(
            [python, os.path.join(PEERS, "kserve_add_sub.py"), str(http_port), str(grpc_port)],
            cwd=PEERS, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self._wait_ready()


class MLServer(Server):
    """MLServer with ``peers/mlserver_add_sub``: default settings but the ports and
    ``parallel_workers=0`` (inference in the server process, as ``serve --in-process``; its
    worker pool does not start with uvloop 0.23)."""

    binary = False

    def __init__(self, python: str) -> None:
        http_port, grpc_port = _free_port(), _free_port()
        self.http, self.grpc = f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
        env = dict(os.environ, MLSERVER_HTTP_PORT=str(http_port),
                   MLSERVER_GRPC_PORT=str(grpc_port), MLSERVER_METRICS_PORT=str(_free_port()),
                   MLSERVER_HOST="127.0.0.1", MLSERVER_PARALLEL_WORKERS="0")
        self.proc = subprocess.Popen(
            [python, "-c", "import sys; from mlserver.cli import main; sys.exit(main())",
             "start", os.path.join(PEERS, "mlserver_add_sub")],
            cwd=PEERS, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env,
        )  # fmt: skip
        self._wait_ready()


class GrpcFloor(Server):
    """``peers/grpc_floor.py``: grpcio's asyncio server (``pool``: its thread-pool server
    with that many threads) answering with prebuilt bytes (gRPC only)."""

    def __init__(self, pool: int = 0) -> None:
        port = _free_port()
        self.grpc = f"127.0.0.1:{port}"
        extra = [f"--pool={pool}"] if pool else []
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(PEERS, "grpc_floor.py"), str(port), *extra],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"grpc_floor exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("grpc_floor did not start")


def add_sub_http_body(n: int) -> tuple[bytes, dict[str, str]]:
    """An add_sub HTTP request (two (n,) FP32 inputs, binary data both ways) and its
    headers."""
    data = np.arange(n, dtype=np.float32).tobytes()
    head = json.dumps({"id": "1", "inputs": [
        {"name": f"INPUT{i}", "datatype": "FP32", "shape": [n],
         "parameters": {"binary_data_size": len(data)}} for i in (0, 1)],
        "parameters": {"binary_data_output": True}}).encode()  # fmt: skip
    return head + data + data, {"Inference-Header-Content-Length": str(len(head)),
                                "Content-Type": "application/octet-stream"}


INFER = "/inference.GRPCInferenceService/ModelInfer"


def _expected(n: int) -> dict[str, np.ndarray]:
    a = np.arange(n, dtype=np.float32)
    return {"OUTPUT0": a + a, "OUTPUT1": a - a}


def _check_outputs(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name, value in want.items():
        if name not in got or not np.array_equal(np.asarray(got[name], np.float32).ravel(),
                                                 value):
            raise RuntimeError(f"wrong answer for {name}: {got.get(name)!r}")


def http_check(n: int) -> Callable[[bytes], None]:
    """Checks an add_sub HTTP answer (binary-data extension or JSON) for the right values."""
    want = _expected(n)

    def check(answer: bytes) -> None:
        head, offset = json.JSONDecoder().raw_decode(answer.decode("latin-1"))
        got = {}
        for out in head["outputs"]:
            size = (out.get("parameters") or {}).get("binary_data_size")
            if size is None:
                got[out["name"]] = out["data"]
            else:
                got[out["name"]] = np.frombuffer(answer[offset:offset + size], np.float32)
                offset += size
        _check_outputs(got, want)

    return check


def grpc_request(n: int, model: str = "add_sub") -> bytes:
    """A serialised add_sub ``ModelInferRequest``: two (n,) FP32 inputs as raw contents."""
    from pb_tensor.serve._protos import message

    request = message("ModelInferRequest")(model_name=model, id="1")
    data = np.arange(n, dtype=np.float32).tobytes()
    for i in (0, 1):
        request.inputs.add(name=f"INPUT{i}", datatype="FP32", shape=[n])
        request.raw_input_contents.append(data)
    return bytes(request.SerializeToString())


def grpc_check(n: int) -> Callable[[bytes], None]:
    """Checks an add_sub ``ModelInferResponse`` (raw or typed contents) for the values."""
    from pb_tensor.serve._protos import message

    response_cls = message("ModelInferResponse")
    want = _expected(n)

    def check(answer: bytes) -> None:
        response = response_cls.FromString(answer)
        got = {}
        for i, out in enumerate(response.outputs):
            got[out.name] = (np.frombuffer(response.raw_output_contents[i], np.float32)
                             if len(response.raw_output_contents) > i
                             else list(out.contents.fp32_contents))
        _check_outputs(got, want)

    return check


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


def _add_sub_json_body(n: int) -> tuple[bytes, dict[str, str]]:
    data = np.arange(n, dtype=np.float32).tolist()
    body = json.dumps({"id": "1", "inputs": [
        {"name": f"INPUT{i}", "datatype": "FP32", "shape": [n], "data": data}
        for i in (0, 1)]}).encode()  # fmt: skip
    return body, {"Content-Type": "application/json"}


def _identity_repository(path: str) -> str:
    os.makedirs(os.path.join(path, "identity", "1"))
    with open(os.path.join(path, "identity", "config.pbtxt"), "w") as f:
        f.write(_IDENTITY_CONFIG)
    with open(os.path.join(path, "identity", "1", "model.py"), "w") as f:
        f.write(_IDENTITY)
    return path


def _identity_http_body(n: int) -> tuple[bytes, dict[str, str]]:
    data = np.ones(n, dtype=np.float32).tobytes()
    head = json.dumps({"inputs": [
        {"name": "IN", "datatype": "FP32", "shape": [n],
         "parameters": {"binary_data_size": len(data)}}],
        "parameters": {"binary_data_output": True}}).encode()  # fmt: skip
    return head + data, {"Inference-Header-Content-Length": str(len(head)),
                         "Content-Type": "application/octet-stream"}


def _identity_check(n: int) -> Callable[[bytes | bytearray], None]:
    def check(answer: bytes | bytearray) -> None:
        head, offset = json.JSONDecoder().raw_decode(bytes(answer[:4096]).decode("latin-1"))
        out = np.frombuffer(answer, np.float32, count=n, offset=offset)
        if head["outputs"][0]["shape"] != [n] or not (out == 1).all():
            raise RuntimeError("wrong identity answer")

    return check


# One measured case: rate, latencies, client and server CPU per call, the machine's steal.
_Run = tuple[float, list[float], float, float, Share]
_SERVERS = ("in-process", "inline", "stub", "stub bound", "KServe", "MLServer", "grpc floor",
            "grpc floor pool")
# Threads of the thread-pool floor: at 16 clients more threads ran slower (GIL hand-overs).
_POOL_THREADS = 4


def _split_cpus() -> tuple[set[int], str] | None:
    """(the server's CPU, its stubs' ``cpu-cores``) where this machine can keep them apart:
    Linux and two or more CPUs; None elsewhere."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {cpus[0]}, ",".join(f"{c}-{c}" for c in cpus[1:])


def _start_peers(args: argparse.Namespace, wanted: set[str]) -> dict[str, Server]:
    peers: dict[str, Server] = {}
    for name, cls, python, module in (("KServe", KServe, args.kserve_python, "kserve"),
                                      ("MLServer", MLServer, args.mlserver_python, "mlserver")):
        if name not in wanted:
            continue
        if not _has_module(python, module):
            print(f"{name}: skipped, `{module}` is not installed for {python} (pass "
                  f"--{name.lower()}-python)")
            continue
        try:
            peers[name] = cls(python)
        except RuntimeError as exc:
            print(f"{name}: skipped, it did not start ({exc})")
    return peers


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _targets(results: dict[tuple[str, str, int], list[_Run]],
             servers: dict[str, Server]) -> None:
    def rate(mode: str, proto: str, conc: int) -> float:
        return max(r[0] for r in results[(mode, proto, conc)])

    if "KServe" not in servers:
        print("targets against KServe: not measured (KServe not installed or not run)")
        return
    for mode, want in (("in-process", 2.0), ("stub", 1.0), ("stub bound", 1.0)):
        for proto in ("HTTP", "gRPC"):
            for conc in (1, 16):
                if (mode, proto, conc) not in results:
                    continue
                ratio = rate(mode, proto, conc) / rate("KServe", proto, conc)
                print(f"target {mode} >= {want:.0f}x KServe, {proto}, {conc:>2} clients: "
                      f"{ratio:.2f}x {_verdict(ratio >= want)}")
    for floor, label in (("grpc floor", "asyncio server"), ("grpc floor pool", "thread pool")):
        if floor in servers:
            for conc in (1, 16):
                print(f"grpcio's floor ({label}, prebuilt answers) / KServe, gRPC, {conc:>2} "
                      f"clients: {rate(floor, 'gRPC', conc) / rate('KServe', 'gRPC', conc):.2f}x")


def _big_transfer(rounds: int) -> None:
    """64 MiB over HTTP binary data: identity (64 MiB in, 64 MiB out) and add_sub (two 32
    MiB inputs, two 32 MiB outputs: the model's numpy work counts too), in-process, against
    64 MiB one way over a raw loopback socket."""
    payload = bytes(64 * 1024 * 1024)
    checks = {"identity": _identity_check(16 * 1024 * 1024),
              "add_sub": http_check(8 * 1024 * 1024)}
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("identity", Serve("--in-process", repository=_identity_repository(tmp),
                                    model="identity"), _identity_http_body(16 * 1024 * 1024)),
                 ("add_sub", Serve("--in-process"), add_sub_http_body(8 * 1024 * 1024))]
        try:
            times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
            raw_times = []
            conns = []
            for name, serve, (body, headers) in cases:
                conn = serve_load.http_client(serve.http, f"/v2/models/{name}/infer", body,
                                              headers)()
                reference = bytes(serve_load.call(conn))  # warm, and checked
                checks[name](reference)
                conns.append((name, conn, reference))
            for _ in range(rounds):
                for name, conn, reference in conns:
                    t = time.perf_counter()
                    answer = serve_load.call(conn)
                    times[name].append(time.perf_counter() - t)
                    if answer != reference:
                        checks[name](answer)
                raw_times.extend(_raw_socket_seconds(payload) for _ in range(3))
            for _, conn, _ in conns:
                conn.sock.close()
        finally:
            for _, serve, _ in cases:
                serve.stop()
    raw_best = min(raw_times)
    print(f"64 MiB one way over a raw loopback socket: {raw_best * 1e3:.0f} ms")
    for name, _, _ in cases:
        best = min(times[name])
        ratio = best / 2 / raw_best
        what = ("one 64 MiB FP32 input, the same 64 MiB back" if name == "identity"
                else "two 32 MiB FP32 inputs, two 32 MiB outputs back, numpy add/sub")
        print(f"64 MiB over HTTP binary data, in-process {name} ({what}): {best * 1e3:.0f} ms; "
              f"per 64 MiB moved: {ratio:.2f}x the socket")
    ratio = min(times["identity"]) / 2 / raw_best
    print(f"target 64 MiB transfer within 2x of the raw socket (identity): {ratio:.2f}x "
          f"{_verdict(ratio <= 2.0)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    parser.add_argument("--kserve-python", default=sys.executable,
                        help="a Python with kserve installed (default: this one)")
    parser.add_argument("--mlserver-python", default=sys.executable,
                        help="a Python with mlserver installed (default: this one)")
    parser.add_argument("--servers", default=",".join(_SERVERS),
                        help="comma-separated servers of the add_sub table (default: all: "
                        f"{','.join(_SERVERS)})")
    parser.add_argument("--protocols", default="HTTP,gRPC",
                        help="comma-separated protocols of the add_sub table (default: "
                        "HTTP,gRPC)")
    parser.add_argument("--no-big", action="store_true",
                        help="leave out the 64 MiB transfer (as --only table)")
    parser.add_argument("--only", choices=("table", "big"),
                        help="run only the add_sub table or only the 64 MiB transfer")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: 3, 2 with "
                        "--quick)")
    args = parser.parse_args()
    wanted = set(args.servers.split(","))
    protocols = set(args.protocols.split(","))
    if not wanted <= set(_SERVERS) or not protocols <= {"HTTP", "gRPC"}:
        parser.error(f"--servers takes {','.join(_SERVERS)}; --protocols takes HTTP,gRPC")
    requests = 400 if args.quick else 3000
    rounds = args.rounds or (2 if args.quick else 3)
    if args.only != "big":
        _table(args, wanted, protocols, requests, rounds)
    if args.only != "table" and not args.no_big:
        _big_transfer(rounds)


def _table(args: argparse.Namespace, wanted: set[str], protocols: set[str], requests: int,
           rounds: int) -> None:
    own: dict[str, Callable[[], Server]] = {
        "in-process": lambda: Serve("--in-process"),
        # The opt-in (quick models on the event loop's thread): shown, not a target row.
        "inline": lambda: Serve("--in-process", "--inline-quick-models"),
        "stub": Serve,
    }
    split = _split_cpus()
    if split is not None:
        # The server's threads on one CPU, its stub on the others (--host-policy): threads
        # handing the GIL to each other across CPUs cost several times their work.
        own["stub bound"] = lambda: Serve(f"--host-policy=cpu,cpu-cores={split[1]}",
                                          cpus=split[0])
    elif "stub bound" in wanted:
        print("stub bound: skipped (needs Linux and 2+ CPUs)")
    servers: dict[str, Server] = {name: start() for name, start in own.items()
                                  if name in wanted}
    results: dict[tuple[str, str, int], list[_Run]] = {}
    try:
        servers.update(_start_peers(args, wanted))
        if "grpc floor" in wanted and "gRPC" in protocols:
            servers["grpc floor"] = GrpcFloor()
        if "grpc floor pool" in wanted and "gRPC" in protocols:
            servers["grpc floor pool"] = GrpcFloor(_POOL_THREADS)
        binary_body, binary_headers = add_sub_http_body(16)
        json_body, json_headers = _add_sub_json_body(16)
        message, checks = grpc_request(16), {"HTTP": http_check(16), "gRPC": grpc_check(16)}
        for _ in range(rounds):
            for mode, server in servers.items():
                body, headers = ((binary_body, binary_headers) if server.binary
                                 else (json_body, json_headers))
                makers = {}
                if server.http and "HTTP" in protocols:  # not the grpcio floor
                    makers["HTTP"] = serve_load.http_client(
                        server.http, "/v2/models/add_sub/infer", body, headers)
                if "gRPC" in protocols:
                    makers["gRPC"] = serve_load.grpc_client(server.grpc, INFER, message)
                for concurrency in (1, 16):
                    for proto, make in makers.items():
                        before = server.cpu()
                        meter = Meter()
                        rate, lat, client = serve_load.drive(make, concurrency, requests,
                                                             checks[proto])
                        used = (server.cpu() - before) / len(lat)
                        results.setdefault((mode, proto, concurrency), []).append(
                            (rate, lat, client, used, meter.share()))
        print(f"add_sub, two (16,) FP32 inputs, {requests} requests per case, best of "
              f"{rounds} interleaved rounds; server / client us: CPU per call of the server (with "
              "its child processes) and of the load generator; steal: the share of CPU time "
              "the machine's CPUs waited for the hypervisor during that run")
        print(f"{'server':<16}{'protocol':<14}{'clients':>8}{'req/s':>10}{'p50 ms':>10}"
              f"{'p99 ms':>10}{'server us':>11}{'client us':>11}{'steal':>7}")
        shares = []
        for (mode, proto, concurrency), runs in results.items():
            rate, lat, client, used, share = max(runs, key=lambda r: r[0])
            shares.extend(r[4] for r in runs)
            steal = "n/a" if share.steal is None else f"{share.steal * 100:.0f}%"
            q = statistics.quantiles(lat, n=100)
            shown = proto if proto == "gRPC" else (
                "HTTP binary" if servers[mode].binary else "HTTP JSON")
            print(f"{mode:<16}{shown:<14}{concurrency:>8}{rate:>10.0f}{q[49] * 1e3:>10.2f}"
                  f"{q[98] * 1e3:>10.2f}{used * 1e6:>11.0f}{client * 1e6:>11.0f}{steal:>7}")
        _targets(results, servers)
        note = contended_note(shares)
        if note is not None:
            print(note)
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
