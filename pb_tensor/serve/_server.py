"""``pb-tensor serve`` in a process: the models, the HTTP service (uvicorn, with the metrics
endpoint on its own port) and the gRPC service (grpcio's asyncio server), each on a thread of
its own, started and stopped together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import threading
import time
from types import TracebackType
from typing import Any, TextIO

from pb_tensor.serve._core import Core, ModelState, Options
from pb_tensor.serve._errors import INTERNAL, ServeError

__all__ = ["Server", "status_table"]

log = logging.getLogger("pb_tensor.serve")

_START_TIMEOUT = 30.0


def status_table(states: list[ModelState]) -> str:
    """tritonserver's model status table."""
    rows = [("Model", "Version", "Status")]
    for s in states:
        reason = s.reason.strip().split("\n")[0]
        status = s.state if s.state == "READY" or not reason else f"{s.state}: {reason}"
        rows.append((s.name, s.version, status))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    lines = [rule]
    for i, row in enumerate(rows):
        lines.append("|" + "|".join(f" {c:<{w}} " for c, w in zip(row, widths)) + "|")
        if i == 0:
            lines.append(rule)
    lines.append(rule)
    return "\n".join(lines)


def _listen(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"failed to start server on {address}:{port}: {exc}", INTERNAL) from None
    sock.set_inheritable(True)
    return sock


class Server:
    """``pb-tensor serve`` running in this process (a context manager).

    :meth:`start` loads the models and starts the services; ports given as 0 are chosen by
    the system (:attr:`http_port`, :attr:`grpc_port`, :attr:`metrics_port` tell them).
    :meth:`stop` stops accepting requests, waits for those in flight, unloads every model
    (``finalize`` runs, stubs stop, shared memory is removed).

    Raises:
        ServeError: an unknown control mode, or ``poll``.
        ModelLoadError: a repository path that is not a directory.
    """

    def __init__(self, options: Options, *, out: TextIO | None = None) -> None:
        self.options = options
        self._out = out
        self.core = Core(options)
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.metrics_port: int | None = None
        self._http: Any = None
        self._http_thread: threading.Thread | None = None
        self._grpc_thread: threading.Thread | None = None
        self._grpc_stop: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._stopped = False

    def _say(self, text: str) -> None:
        if self._out is not None:
            self._out.write(text + "\n")
            self._out.flush()

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP service (what tritonclient.http takes)."""
        return f"{self.options.http_address}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC service (what tritonclient.grpc takes)."""
        return f"{self.options.grpc_address}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """``http://host:port/metrics`` of the metrics service."""
        return f"http://{self.options.metrics_address}:{self.metrics_port}/metrics"

    def start(self) -> None:
        """Load the models, print the status table, start the services.

        Raises:
            ServeError: a model failed to load with ``exit_on_error``, or a port is taken.
        """
        try:
            states = self.core.startup()
            self._say(status_table(states))
            if self.options.exit_on_error and self.core.startup_failures:
                raise ServeError("failed to load all models", INTERNAL)
            if self.options.allow_grpc:
                self._start_grpc()
                self._say(f"Started GRPCInferenceService at {self.grpc_url}")
            if self.options.allow_http or self.options.allow_metrics:
                self._start_http()
            if self.options.allow_http:
                self._say(f"Started HTTPService at {self.http_url}")
            if self.options.allow_metrics:
                self._say(f"Started Metrics Service at {self.options.metrics_address}:"
                          f"{self.metrics_port}")
        except BaseException:
            self.stop()
            raise

    def _start_http(self) -> None:
        import uvicorn

        from pb_tensor.serve._http import HttpApp
        from pb_tensor.serve._metrics import MetricsApp
        from pb_tensor.serve._protocol import protocol_class

        sockets = []
        if self.options.allow_http:
            sockets.append(_listen(self.options.http_address, self.options.http_port))
            self.http_port = sockets[-1].getsockname()[1]
        if self.options.allow_metrics:
            sockets.append(_listen(self.options.metrics_address, self.options.metrics_port))
            self.metrics_port = sockets[-1].getsockname()[1]
        http_app = HttpApp(self.core)
        metrics_app = MetricsApp(self.core)
        metrics_port = self.metrics_port

        async def app(scope: Any, receive: Any, send: Any) -> None:
            server = scope.get("server")
            if server is not None and server[1] == metrics_port:
                await metrics_app(scope, receive, send)
            else:
                await http_app(scope, receive, send)

        loop = "uvloop" if _has("uvloop") else "asyncio"
        protocol = protocol_class(self.options.max_input_size) if _has("httptools") else "h11"
        config = uvicorn.Config(
            app, loop=loop, http=protocol,
            lifespan="off", log_level="warning", access_log=False,
            timeout_graceful_shutdown=30, timeout_keep_alive=60,
        )  # fmt: skip
        self._http = uvicorn.Server(config)
        self._http_thread = threading.Thread(
            target=self._http.run, kwargs={"sockets": sockets}, name="pb-tensor-serve-http",
            daemon=True,
        )  # fmt: skip
        self._http_thread.start()
        deadline = time.monotonic() + _START_TIMEOUT
        while not self._http.started:
            if not self._http_thread.is_alive() or time.monotonic() > deadline:
                raise ServeError("the HTTP service did not start", INTERNAL)
            time.sleep(0.01)

    def _start_grpc(self) -> None:
        from pb_tensor.serve._grpc import serve_grpc

        started = threading.Event()
        result: dict[str, Any] = {}

        def run() -> None:
            loop = _new_loop()
            stop = asyncio.Event()
            self._grpc_stop = (loop, stop)
            try:
                loop.run_until_complete(serve_grpc(self.core, self.options, stop, started,
                                                   result))
            except BaseException as exc:
                result["error"] = exc
                started.set()
            finally:
                loop.close()

        self._grpc_thread = threading.Thread(target=run, name="pb-tensor-serve-grpc",
                                             daemon=True)
        self._grpc_thread.start()
        if not started.wait(_START_TIMEOUT) or "error" in result:
            error = result.get("error")
            raise ServeError(f"the gRPC service did not start: {error}", INTERNAL)
        self.grpc_port = result["port"]

    def stop(self, drain_timeout: float = 30.0) -> None:
        """Stop the services, wait (at most ``drain_timeout`` s) for requests in flight,
        unload every model. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.core.ready = False
        if self._http is not None:
            self._http.should_exit = True
        if self._grpc_stop is not None:
            loop, stop = self._grpc_stop
            if not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
                    loop.call_soon_threadsafe(stop.set)
        for thread in (self._http_thread, self._grpc_thread):
            if thread is not None:
                thread.join(drain_timeout + 5)
        if not self.core.drain(drain_timeout):
            log.warning("requests still in flight after %.0f s: unloading anyway",
                        drain_timeout)
        self.core.close()

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _new_loop() -> asyncio.AbstractEventLoop:
    """An event loop for the gRPC service: uvloop's where it is installed (as the HTTP
    service's; measured, grpcio's asyncio server spends ~15% less CPU per call on it)."""
    if _has("uvloop"):
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def default_out() -> TextIO:
    """Where the command line prints the status table and the service lines."""
    return sys.stdout
