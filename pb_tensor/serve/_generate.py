"""Triton's generate extension: ``POST .../generate`` (one JSON response) and
``.../generate_stream`` (server-sent events, one ``data: {...}`` per response, which is how
HTTP clients reach decoupled models). Request keys that name a model input become tensors
shaped by the input's metadata; the others become request parameters. Each output becomes a
key (a single element as a scalar), with the response's parameters."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import numpy as np

from pb_tensor.runtime import (
    InferenceError,
    LoadedModel,
    ResponseSenderDropped,
)
from pb_tensor.serve._core import Core, inference_error, responses
from pb_tensor.serve._errors import ServeError, http_status
from pb_tensor.serve._http_infer import parse_json
from pb_tensor.serve._tensors import bytes_text, from_json, json_bytes

__all__ = ["generate"]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def _wire(data_type: str) -> str:
    name = data_type[len("TYPE_"):] if data_type.startswith("TYPE_") else data_type
    return "BYTES" if name == "STRING" else name


def _inputs(model: LoadedModel, request: dict[str, Any]) -> tuple[dict[str, Any],
                                                                   dict[str, Any]]:
    """The input tensors and parameters of a generate request (Triton's exact mapping)."""
    config = model.config
    batch = [-1] if config.get("max_batch_size", 0) >= 1 else []
    metadata = {e["name"]: (_wire(e.get("data_type", "")),
                            batch + [int(d) for d in e.get("dims", [])])
                for e in config.get("input", [])}  # fmt: skip
    inputs: dict[str, Any] = {}
    parameters: dict[str, Any] = {}
    for key, value in request.items():
        if key not in metadata:
            if isinstance(value, (dict, list)) or value is None:
                raise ServeError(f"parameter '{key}' has invalid type. It should be either "
                                 "'int', 'bool', or 'string'.")
            parameters[key] = value
            continue
        datatype, dims = metadata[key]
        data = value if isinstance(value, list) else [value]
        count = len(data)
        shape = list(dims)
        known = math.prod(d for d in shape if d != -1) if shape else 1
        wild = shape.count(-1)
        if (known and count % known) or (wild == 0 and count != known) or (
                not known and count):
            raise ServeError(f"The schema can not convert input '{key}' to tensor with proper "
                             "shape")
        rest = count // known if known else 0
        for i in range(len(shape) - 1, -1, -1):  # the last -1 takes the rest, others 1
            if shape[i] == -1:
                shape[i], rest = rest, 1
        inputs[key] = from_json(key, datatype, shape, data)
    return inputs, parameters


def _render(model: LoadedModel, outputs: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model_name": model.name, "model_version": str(model.version)}
    body.update(getattr(outputs, "parameters", {}))
    for name, array in outputs.items():
        flat = array.reshape(-1)
        if array.dtype == object:
            values: list[Any] = [bytes_text(v) if isinstance(v, bytes) else str(v)
                                 for v in flat.tolist()]
        elif array.dtype == np.float16:
            raise ServeError("sending FP16 data via JSON is not supported. Please use the "
                             "binary data format for output")
        else:
            values = flat.tolist()
        body[name] = values[0] if len(values) == 1 else values
    return body


async def generate(core: Core, model: LoadedModel, body: bytearray, streaming: bool,
                   receive: Receive, send: Send) -> None:
    """Answer one generate request.

    Raises:
        ServeError: malformed request, or an error before the first response.
    """
    request = parse_json(body)
    if not isinstance(request, dict):
        raise ServeError("Unable to parse request: attempt to access JSON non-object as "
                         "object")
    inputs, parameters = _inputs(model, request)
    if not streaming and model.decoupled:
        await _generate_once(core, model, inputs, parameters, receive, send)
        return
    if not model.decoupled:  # one response
        outputs = await core.infer(model, inputs, None, parameters, "", 0, 0)
        text = json_bytes(_render(model, outputs))
        if streaming:
            await _send_all(send, 200, [b"data: " + text + b"\n\n"],
                            b"text/event-stream; charset=utf-8")
        else:
            await _send_all(send, 200, [text], b"application/json")
        return
    stream = core.stream(model, inputs, None, parameters, "", 0, 0)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    end = object()

    def run() -> None:
        try:
            for item in responses(stream):
                if isinstance(item, ResponseSenderDropped):
                    break  # (Triton's response would never end: this one ends here)
                if isinstance(item, InferenceError):  # Triton goes on after an error response
                    loop.call_soon_threadsafe(queue.put_nowait, inference_error(item))
                else:
                    loop.call_soon_threadsafe(queue.put_nowait, _render(model, item))
        except ServeError as exc:
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            core.done(model)
            loop.call_soon_threadsafe(queue.put_nowait, end)

    threading.Thread(target=run, name="pb-tensor-serve-generate", daemon=True).start()

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    started = False
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait((getter, watcher), return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():  # the client went away: cancel the request
                getter.cancel()
                stream.cancel()
                return
            item = getter.result()
            if item is end:
                break
            if isinstance(item, ServeError):
                if not started:
                    raise item
                text = json_bytes({"error": item.message})
            else:
                text = json_bytes(item)
            if not started:
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8")]})
                started = True
            await send({"type": "http.response.body", "body": b"data: " + text + b"\n\n",
                        "more_body": True})
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": b""})
    finally:
        watcher.cancel()


_NOT_ONE = ("generate expects model to produce exactly 1 response, use generate stream for "
            "model that generates various number of responses")


async def _generate_once(core: Core, model: LoadedModel, inputs: dict[str, Any],
                         parameters: dict[str, Any], receive: Receive, send: Send) -> None:
    """``generate`` on a decoupled model, as Triton answers it: the status of the first
    response (200 when the model sent only a final flag), and its body when the model sent
    exactly one response, else Triton's error for the count."""
    stream = core.stream(model, inputs, None, parameters, "", 0, 0)

    def run() -> list[dict[str, Any] | ServeError]:
        entries: list[dict[str, Any] | ServeError] = []
        try:
            for item in responses(stream):
                if isinstance(item, ResponseSenderDropped):
                    break
                if isinstance(item, InferenceError):
                    entries.append(inference_error(item))
                    continue
                try:
                    entries.append(_render(model, item))
                except ServeError as exc:
                    entries.append(exc)
        finally:
            core.done(model)
        return entries

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(loop.run_in_executor(None, run))

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():  # the client went away: cancel the request
        stream.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return
    entries = task.result()
    first = entries[0] if entries else None
    status = http_status(first.code) if isinstance(first, ServeError) else 200
    if len(entries) != 1:
        text = json_bytes({"error": _NOT_ONE})
    elif isinstance(first, ServeError):
        text = json_bytes({"error": first.message})
    else:
        text = json_bytes(first)
    await _send_all(send, status, [text], b"application/json")


async def _send_all(send: Send, status: int, parts: list[bytes], ctype: bytes) -> None:
    body = b"".join(parts)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

