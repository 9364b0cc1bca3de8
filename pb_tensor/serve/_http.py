"""Triton's HTTP/REST protocol (KServe v2 plus Triton's extensions) as a plain ASGI
application: no web framework on the request path."""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import json
import logging
import re
import zlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pb_tensor.serve._core import Core
from pb_tensor.serve._errors import (
    INTERNAL,
    INVALID_ARG,
    METHOD_NOT_ALLOWED,
    UNSUPPORTED,
    ServeError,
    http_status,
)
from pb_tensor.serve._http_infer import header_length, parse_infer, parse_json, render_infer
from pb_tensor.serve._protocol import on_disconnect

__all__ = ["EXTENSIONS", "HttpApp", "extensions", "server_metadata"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("pb_tensor.serve")

_MODEL = re.compile(
    r"^/v2/models/([^/]+)(?:/versions/([0-9]+))?(?:/(infer|ready|config|stats|generate|"
    r"generate_stream|trace/setting))?/?$"
)
_SHM = re.compile(r"^/v2/systemsharedmemory(?:/region/([^/]+))?/(status|register|unregister)/?$")
_REPO = re.compile(r"^/v2/repository(?:/([^/]+))?/models/([^/]+)/(load|unload)/?$")
_JSON = [(b"content-type", b"application/json")]
_JOIN_LIMIT = 64 << 10  # response bodies up to this size are sent in one piece
# Triton's endpoints of extensions not served here: 501 with a message saying so.
_UNSUPPORTED = (
    ("/v2/cudasharedmemory", "the CUDA shared memory extension"),
    ("/v2/trace", "the trace extension"),
)
EXTENSIONS = [
    "model_repository",
    "system_shared_memory",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "logging",
]


def server_metadata() -> dict[str, Any]:
    """Triton's server metadata: name, version and the extensions served here."""
    from pb_tensor import __version__

    return {"name": "triton", "version": __version__, "extensions": extensions()}


def extensions() -> list[str]:
    """Triton's extensions served here."""
    return list(EXTENSIONS)


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}, separators=(",", ":")).encode()


class _Disconnected(Exception):
    """The client went away before its request body arrived."""


class HttpApp:
    """The ASGI application: ``await app(scope, receive, send)``."""

    def __init__(self, core: Core) -> None:
        self._core = core
        self._metadata = json.dumps(server_metadata(), separators=(",", ":")).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        try:
            await self._route(scope, receive, send)
        except ServeError as exc:
            headers = list(_JSON)
            if exc.code == UNSUPPORTED and exc.message == "Unsupported compression type":
                headers.append((b"accept-encoding", b"gzip, deflate"))
            await _reply(send, http_status(exc.code), _error_body(exc.message), headers)
        except _Disconnected:
            return

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        core = self._core
        if path in ("/v2/health/live", "/v2/health/ready"):
            if method != "GET":
                raise ServeError("Method Not Allowed", METHOD_NOT_ALLOWED)
            if path.endswith("live"):
                ok = core.live
            else:  # (the models' readiness checks may wait: off the event loop)
                ok = await asyncio.get_running_loop().run_in_executor(None, core.server_ready)
            await _reply(send, 200 if ok else 400, b"", [])
            return
        if path in ("/v2", "/v2/"):
            _need(method, "GET")
            await _reply(send, 200, self._metadata, _JSON)
            return
        if path.rstrip("/") == "/v2/models/stats":
            _need(method, "GET")
            from pb_tensor.serve._stats import statistics

            entries = statistics(core, "", "")
            await _reply(send, 200, json.dumps({"model_stats": entries},
                                               separators=(",", ":")).encode(), _JSON)
            return
        match = _MODEL.match(path)
        if match is not None:
            name, version, action = match.group(1), match.group(2) or "", match.group(3)
            if action == "infer":
                _need(method, "POST")
                await self._infer(scope, receive, send, name, version)
            elif action == "ready":
                _need(method, "GET")
                await self._ready(send, name, version)
            elif action == "config":
                _need(method, "GET")
                model = core.model(name, version)
                await _reply(send, 200, json.dumps(model.config, separators=(",", ":"))
                             .encode(), _JSON)
            elif action is None:
                _need(method, "GET")
                await _reply(send, 200, _metadata(core, name, version), _JSON)
            elif action == "stats":
                _need(method, "GET")
                from pb_tensor.serve._stats import statistics

                entries = statistics(core, name, version)
                await _reply(send, 200, json.dumps({"model_stats": entries},
                                                   separators=(",", ":")).encode(), _JSON)
            elif action in ("generate", "generate_stream"):
                _need(method, "POST")
                model = core.model(name, version)
                headers = dict(scope["headers"])
                encoding = headers.get(b"content-encoding", b"identity").strip().lower()
                if encoding != b"identity":
                    raise ServeError("Unsupported content-encoding, only 'identity' is "
                                     "supported.")
                body = await _body(scope, receive, core.options.max_input_size)
                from pb_tensor.serve._generate import generate

                await generate(core, model, body, action == "generate_stream", receive, send)
            else:
                core.model(name, version)
                raise ServeError(f"the {action} endpoint is not supported by pb-tensor serve",
                                 UNSUPPORTED)
            return
        if path.rstrip("/") in ("/v2/repository/index",) or re.match(
            r"^/v2/repository/[^/]+/index/?$", path
        ):
            _need(method, "POST")
            body = await _body(scope, receive, core.options.max_input_size)
            ready = False
            if body:
                request = parse_json(body)
                if isinstance(request, dict) and "ready" in request:
                    if not isinstance(request["ready"], bool):
                        raise ServeError("Invalid value for 'ready': expected a boolean")
                    ready = request["ready"]
            rows = [
                {k: v for k, v in (("name", s.name), ("version", s.version), ("state", s.state),
                                   ("reason", s.reason)) if v or k == "name"}
                for s in core.index(ready)
            ]  # fmt: skip
            await _reply(send, 200, json.dumps(rows, separators=(",", ":")).encode(), _JSON)
            return
        match = _REPO.match(path)
        if match is not None:
            _need(method, "POST")
            if match.group(1) is not None:
                raise ServeError("'repository_name' specification is not supported",
                                 UNSUPPORTED)
            body = await _body(scope, receive, core.options.max_input_size)
            await self._control(send, match.group(2), match.group(3), body)
            return
        match = _SHM.match(path)
        if match is not None:
            await self._shm(scope, receive, send, match.group(1) or "", match.group(2))
            return
        if path == "/v2/logging":
            if method not in ("GET", "POST"):
                raise ServeError("Method Not Allowed", METHOD_NOT_ALLOWED)
            settings = core.log_settings
            if method == "POST":
                body = await _body(scope, receive, core.options.max_input_size)
                # (tritonserver parses even an empty body: "The document is empty.")
                settings.update_json(parse_json(body))
            await _reply(send, 200, json.dumps(settings.as_json(), separators=(",", ":"))
                         .encode(), _JSON)  # fmt: skip
            return
        for prefix, what in _UNSUPPORTED:
            if path.startswith(prefix):
                raise ServeError(f"{what} is not supported by pb-tensor serve", UNSUPPORTED)
        await _reply(send, 404, _error_body("Not Found"), _JSON)

    async def _shm(self, scope: Scope, receive: Receive, send: Send, name: str,
                   action: str) -> None:
        regions = self._core.regions
        if action == "status":
            _need(scope["method"], "GET")
            body = json.dumps(regions.status(name), separators=(",", ":")).encode()
            await _reply(send, 200, body, _JSON)
            return
        _need(scope["method"], "POST")
        if action == "unregister":
            regions.unregister(name)
            await _reply(send, 200, b"", _JSON)
            return
        if not name:
            raise ServeError("'region name' is necessary to register system shared memory "
                             "region")
        request = parse_json(await _body(scope, receive, self._core.options.max_input_size))
        if not isinstance(request, dict):
            raise ServeError("Shared memory register request has no 'key' field")
        key = request.get("key")
        if not isinstance(key, str):
            raise ServeError("Shared memory register request has no 'key' field")
        offset = request.get("offset", 0)
        byte_size = request.get("byte_size")
        if type(byte_size) is not int:
            raise ServeError("Shared memory register request has no 'byte_size' field")
        if type(offset) is not int:
            raise ServeError("Unable to parse 'offset'")
        regions.register(name, key, offset, byte_size)
        await _reply(send, 200, b"", _JSON)

    async def _ready(self, send: Send, name: str, version: str) -> None:
        try:
            model = self._core.model(name, version)
        except ServeError as exc:
            if "version string" in exc.message or "invalid model version" in exc.message:
                raise
            model = None
        loop = asyncio.get_running_loop()
        ready = model is not None and await loop.run_in_executor(None, model.is_ready)
        if not ready:
            raise ServeError("Model version not ready")
        await _reply(send, 200, b"", [])

    async def _control(self, send: Send, name: str, action: str, body: bytearray) -> None:
        request = parse_json(body) if body else {}
        params = request.get("parameters", {}) if isinstance(request, dict) else {}
        if not isinstance(params, dict):
            raise ServeError("Unable to parse 'parameters'")
        loop = asyncio.get_running_loop()
        if action == "load":
            config: str | None = None
            files: dict[str, bytes] = {}
            # Triton's HTTP front end: every parameter read as a string, "config" and
            # "file:<path>" ones made load parameters, any other refused.
            for key, value in params.items():
                if not isinstance(value, str):
                    raise ServeError("attempt to access JSON non-string as string", INTERNAL)
                if key == "config":
                    config = value
                elif key.startswith("file:"):
                    try:
                        files[key[len("file:"):]] = base64.b64decode(value, validate=True)
                    except (binascii.Error, ValueError):
                        raise ServeError(f"Unable to parse '{key}': not valid base64") from None
                else:
                    raise ServeError("unexpected error on creating Triton parameter", INTERNAL)
            await loop.run_in_executor(None, self._core.load, name, config, files)
        else:
            dependents = params.get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise ServeError("Unable to parse 'unload_dependents': attempt to access JSON "
                                 "non-boolean as boolean")
            await loop.run_in_executor(None, functools.partial(
                self._core.unload, name, unload_dependents=dependents))
        await _reply(send, 200, b"", _JSON)

    async def _infer(self, scope: Scope, receive: Receive, send: Send, name: str,
                     version: str) -> None:
        core = self._core
        model = core.model(name, version)
        if model.decoupled:
            raise ServeError(
                "HTTP end point doesn't support models with decoupled transaction policy",
                UNSUPPORTED,
            )
        headers = dict(scope["headers"])
        body = await _body(scope, receive, core.options.max_input_size)
        encoding = headers.get(b"content-encoding")
        if encoding is not None and encoding.strip().lower() != b"identity":
            body = _decompress(body, encoding.strip().lower(), core.options.max_input_size)
        raw_len = headers.get(b"inference-header-content-length")
        call = parse_infer(
            body, header_length(raw_len.decode("latin-1") if raw_len else None, len(body)),
            name, core.options.max_input_size, core.regions,
        )  # fmt: skip
        if core.http_headers is not None:  # after the body's, as tritonserver adds them
            call.parameters.update(core.http_headers.parameters(
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]))
        task = asyncio.ensure_future(core.infer(
            model, call.inputs, call.requested, call.parameters, call.request_id,
            call.correlation_id, call.flags,
        ))  # fmt: skip
        if on_disconnect(receive, task.cancel):  # pb-tensor's protocol tells
            try:
                outputs = await task
            except asyncio.CancelledError:  # the client went away: the request is cancelled
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return
        else:
            gone = asyncio.ensure_future(_disconnect(receive))
            try:
                await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not task.done():  # the client went away: cancel the request
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return
            outputs = task.result()
        parts, head_len = render_infer(name, model.version, call, outputs, outputs.parameters,
                                       core.regions)
        out_headers: list[tuple[bytes, bytes]] = []
        if head_len is None:
            out_headers.append((b"content-type", b"application/json"))
        else:
            out_headers.append((b"content-type", b"application/octet-stream"))
            out_headers.append((b"inference-header-content-length", str(head_len).encode()))
        accept = headers.get(b"accept-encoding")
        chosen = _accepted(accept) if accept is not None else None
        if chosen is not None:
            parts = [_compress(b"".join(parts), chosen)]
            out_headers.append((b"content-encoding", chosen))
        # Large outputs go out as they are (views of the model's arrays): no joined copy;
        # small ones in one piece (one write).
        size = sum(len(p) for p in parts)
        if len(parts) > 1 and size <= _JOIN_LIMIT:
            parts = [b"".join(parts)]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*out_headers, (b"content-length", str(size).encode())]})
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part,
                        "more_body": i < len(parts) - 1})


def _need(method: str, wanted: str) -> None:
    if method != wanted:
        raise ServeError("Method Not Allowed", METHOD_NOT_ALLOWED)


def _metadata(core: Core, name: str, version: str) -> bytes:
    model = core.model(name, version)
    config = model.config
    batch = [-1] if config.get("max_batch_size", 0) >= 1 else []

    def io(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {"name": e["name"], "datatype": _wire(e.get("data_type", "TYPE_INVALID")),
             "shape": batch + [int(d) for d in e.get("dims", [])]}
            for e in entries
        ]  # fmt: skip

    return json.dumps({
        "name": name,
        # (Triton's: the version asked for, else every version served)
        "versions": [str(model.version)] if version else [str(v) for v in core.versions(name)],
        "platform": config.get("platform") or config.get("backend", "python"),
        "inputs": io(config.get("input", [])),
        "outputs": io(config.get("output", [])),
    }, separators=(",", ":")).encode()  # fmt: skip


def _wire(data_type: str) -> str:
    """Triton's protocol name of a configuration data type (``TYPE_FP32`` -> ``FP32``)."""
    name = data_type[len("TYPE_"):] if data_type.startswith("TYPE_") else data_type
    return "BYTES" if name == "STRING" else name


async def _reply(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
                 ) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _body(scope: Scope, receive: Receive, limit: int) -> bytearray:
    """The request body in a buffer of its own (writable: binary inputs are views of it that
    the model may write into, as into its copy in Triton). A ``Content-Length`` over
    ``limit`` is refused before anything is read."""
    for key, value in scope["headers"]:
        if key == b"content-length" and value.isdigit() and int(value) > limit:
            raise ServeError(
                f"request JSON size of {int(value)} bytes exceeds the maximum allowed input "
                f"size of {limit} bytes. Use --http-max-input-size to increase the limit."
            )
    body: bytearray | None = None
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size = len(chunk) + (len(body) if body is not None else 0)
        if size > limit:
            raise ServeError(
                f"request JSON size of {size} bytes exceeds the maximum allowed input size "
                f"of {limit} bytes. Use --http-max-input-size to increase the limit."
            )
        if body is None:  # the server's own buffer (pb-tensor's protocol) is taken as is
            body = chunk if type(chunk) is bytearray else bytearray(chunk)
        else:
            body += chunk
        if not message.get("more_body", False):
            return body


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _decompress(body: bytearray, encoding: bytes, limit: int) -> bytearray:
    if encoding == b"gzip":
        wbits = 31
    elif encoding == b"deflate":
        wbits = 15
    else:
        raise ServeError("Unsupported compression type", UNSUPPORTED)
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ServeError(f"failed to decompress the request body: {exc}", INVALID_ARG) from None
    if len(out) > limit:
        raise ServeError(
            f"decompressed request size exceeds the maximum allowed input size of {limit} "
            "bytes. Use --http-max-input-size to increase the limit."
        )
    return bytearray(out)


def _accepted(accept: bytes) -> bytes | None:
    """The first of gzip / deflate the client accepts (q > 0), as Triton chooses."""
    for part in accept.lower().split(b","):
        token, _, q = part.strip().partition(b";")
        if token in (b"gzip", b"deflate"):
            q = q.strip()
            if q.startswith(b"q="):
                try:
                    if float(q[2:]) <= 0:
                        continue
                except ValueError:
                    continue
            return token
    return None


def _compress(body: bytes, encoding: bytes) -> bytes:
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31 if encoding == b"gzip" else 15)
    return compressor.compress(body) + compressor.flush()
