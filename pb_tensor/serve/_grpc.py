"""Triton's gRPC service (``inference.GRPCInferenceService``) on grpcio's asyncio server:
the unary methods matching the HTTP ones, and ``ModelStreamInfer`` for decoupled models."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pb_tensor.serve import _protos
from pb_tensor.serve._core import Core, Options, responses
from pb_tensor.serve._errors import (
    ALREADY_EXISTS,
    CANCELLED,
    INTERNAL,
    INVALID_ARG,
    NOT_FOUND,
    UNAVAILABLE,
    UNSUPPORTED,
    ServeError,
)
from pb_tensor.serve._grpc_messages import Request, infer_response_bytes, response_of
from pb_tensor.serve._http import server_metadata

__all__ = ["serve_grpc"]

log = logging.getLogger("pb_tensor.serve")

# Triton's gRPC limits: clients may send and receive up to INT32_MAX bytes.
_MAX_MESSAGE = 2**31 - 1
_STATUS = {
    INTERNAL: grpc.StatusCode.INTERNAL,
    NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    CANCELLED: grpc.StatusCode.CANCELLED,
}
_M = _protos.message


class _Close:
    """A stream's end with an error status (``triton_grpc_error`` streams)."""

    __slots__ = ("code", "message")

    def __init__(self, code: int, message: str) -> None:
        self.code, self.message = code, message


def _grpc_error_mode(context: Any) -> bool:
    """Whether the client opened the stream with the ``triton_grpc_error: true`` header:
    Triton then ends the stream with the first error a request meets while it runs."""
    for key, value in context.invocation_metadata() or ():
        if key == "triton_grpc_error":
            return bool(value == "true")
    return False


class _Service:
    def __init__(self, core: Core) -> None:
        self.core = core

    async def _fail(self, context: Any, exc: ServeError) -> None:
        await context.abort(_STATUS.get(exc.code, grpc.StatusCode.UNKNOWN), exc.message)

    async def LogSettings(self, request: Any, context: Any) -> Any:
        settings = self.core.log_settings
        try:
            settings.update_grpc({
                name: (value.WhichOneof("parameter_choice"),
                       getattr(value, value.WhichOneof("parameter_choice") or "bool_param"))
                for name, value in request.settings.items()
            })  # fmt: skip
        except ServeError as exc:
            await self._fail(context, exc)
        response = _M("LogSettingsResponse")()
        current = settings.as_json()
        for name, value in current.items():
            entry = response.settings[name]
            if isinstance(value, bool):
                entry.bool_param = value
            elif isinstance(value, int):
                entry.uint32_param = value
            else:
                entry.string_param = value
        return response

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return _M("ServerLiveResponse")(live=self.core.live)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        loop = asyncio.get_running_loop()
        return _M("ServerReadyResponse")(
            ready=await loop.run_in_executor(None, self.core.server_ready)
        )

    async def ModelReady(self, request: Any, context: Any) -> Any:
        try:
            model = self.core.model(request.name, request.version)
        except ServeError:
            return _M("ModelReadyResponse")(ready=False)
        loop = asyncio.get_running_loop()
        return _M("ModelReadyResponse")(ready=await loop.run_in_executor(None, model.is_ready))

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        meta = server_metadata()
        return _M("ServerMetadataResponse")(name=meta["name"], version=meta["version"],
                                            extensions=meta["extensions"])

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        try:
            model = self.core.model(request.name, request.version)
        except ServeError as exc:
            await self._fail(context, exc)
        config = model.config
        batch = [-1] if config.get("max_batch_size", 0) >= 1 else []
        response = _M("ModelMetadataResponse")(
            name=request.name,
            versions=[str(model.version)] if request.version
            else [str(v) for v in self.core.versions(request.name)],
            platform=config.get("platform") or config.get("backend", "python"),
        )  # fmt: skip
        for entries, target in ((config.get("input", []), response.inputs),
                                (config.get("output", []), response.outputs)):
            for e in entries:
                dt = e.get("data_type", "TYPE_INVALID").removeprefix("TYPE_")
                target.add(name=e["name"], datatype="BYTES" if dt == "STRING" else dt,
                           shape=batch + [int(d) for d in e.get("dims", [])])
        return response

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        try:
            model = self.core.model(request.name, request.version)
        except ServeError as exc:
            await self._fail(context, exc)
        return _M("ModelConfigResponse")(config=_protos.config_from_dict(model.config))

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        try:
            model = self.core.model(request.model_name, request.model_version)
            if model.decoupled:
                raise ServeError("ModelInfer RPC doesn't support models with decoupled "
                                 "transaction policy", UNSUPPORTED)
            parsed = Request(request, stream=False, writable=self.core.options.in_process,
                              regions=self.core.regions)
            if self.core.grpc_headers is not None:
                parsed.parameters.update(self.core.grpc_headers.parameters(
                    context.invocation_metadata() or ()))
            outputs = await self.core.infer(
                model, parsed.inputs, parsed.requested, parsed.parameters, request.id,
                parsed.correlation_id, parsed.flags,
            )  # fmt: skip
            # Serialised here (the method's serializer passes bytes on): see
            # infer_response_bytes.
            return infer_response_bytes(request, model.version, outputs, parsed,
                                        self.core.regions)
        except ServeError as exc:
            await self._fail(context, exc)

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any
                               ) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()
        streams: set[Any] = set()
        state: dict[str, Any] = {"active": 1, "tail": None,
                                 "grpc_error": _grpc_error_mode(context),
                                 "metadata": context.invocation_metadata() or ()}  # fmt: skip

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        async def reader() -> None:
            try:
                async for request in requests:
                    state["active"] += 1
                    self._start_stream(request, put, done, streams, state)
            finally:
                queue.put_nowait(done)

        read = asyncio.ensure_future(reader())
        try:
            while True:
                item = await queue.get()
                if item is done:
                    state["active"] -= 1
                    if state["active"] == 0:
                        return
                    continue
                if type(item) is _Close:
                    # As Triton's WriteGRPCErrorResponse: the stream ends with the error's
                    # status; requests still running are cancelled, their responses dropped.
                    read.cancel()
                    for stream in list(streams):
                        stream.cancel()
                    await context.abort(_STATUS.get(item.code, grpc.StatusCode.UNKNOWN),
                                        item.message)  # fmt: skip
                yield item
        finally:
            read.cancel()
            for stream in list(streams):  # the client went away: cancel what still runs
                stream.cancel()

    def _start_stream(self, request: Any, put: Any, done: object, streams: set[Any],
                      state: dict[str, Any]) -> None:
        def error(message: str, refused: bool = False, code: int = INTERNAL,
                  final: bool = True) -> Any:  # fmt: skip
            # As Triton's stream handler: a request refused before it ran gets an error
            # with only its id; one that failed running also names the model and carries
            # the final flag, or, in a triton_grpc_error stream, ends the stream.
            if not refused and state["grpc_error"]:
                return _Close(code, message)
            response = _M("ModelInferResponse")(id=request.id)
            if not refused:
                response.model_name = request.model_name
                response.model_version = request.model_version
                response.parameters["triton_final_response"].bool_param = final
            return _M("ModelStreamInferResponse")(error_message=message,
                                                  infer_response=response)

        def in_order() -> tuple[Any, asyncio.Future[None]]:
            # As Triton's stream handler queues the states of non-decoupled requests (and of
            # requests refused before they ran): their responses go out in request order.
            previous = state["tail"]
            mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            state["tail"] = mine
            return previous, mine

        model = None
        try:
            model = self.core.model(request.model_name, request.model_version)
            parsed = Request(request, stream=True, writable=self.core.options.in_process,
                              regions=self.core.regions)
            if self.core.grpc_headers is not None:  # the stream's, for each of its requests
                parsed.parameters.update(self.core.grpc_headers.parameters(state["metadata"]))
            if not model.decoupled:  # one response: run it as ModelInfer runs it
                self._start_single(request, model, parsed, put, done, error, streams,
                                   in_order())
                return
            stream = self.core.stream(
                model, parsed.inputs, parsed.requested, parsed.parameters, request.id,
                parsed.correlation_id, parsed.flags,
            )  # fmt: skip
        except ServeError as exc:  # refused as it was read, before it ran
            if model is not None and model.decoupled:
                put(error(exc.message, refused=True))
                put(done)
            else:
                self._put_in_order(in_order(), [error(exc.message, refused=True), done], put,
                                   streams)
            return
        streams.add(stream)
        decoupled = model.decoupled

        def run() -> None:
            from pb_tensor.runtime import InferenceError, RequestRefused, ResponseSenderDropped

            # As Triton's stream handler: each response carries its final flag, an error
            # response too (a decoupled model may go on after one); a flags-only final is
            # sent (empty) only when the request enabled it.
            final = False
            try:
                for item in responses(stream):
                    if isinstance(item, ResponseSenderDropped):
                        # Triton's response factory went with the sender: nothing more comes.
                        return
                    if isinstance(item, InferenceError):
                        final = stream.finished
                        put(error(item.message(), isinstance(item, RequestRefused),
                                  int(item.code()), final))  # fmt: skip
                        continue
                    response = response_of(request, model.version, item, parsed,
                                           self.core.regions)
                    final = item.final
                    response.parameters["triton_final_response"].bool_param = final
                    put(_M("ModelStreamInferResponse")(infer_response=response))
                if decoupled and parsed.empty_final and not final:
                    response = _M("ModelInferResponse")(
                        model_name=request.model_name, model_version=str(model.version),
                        id=request.id,
                    )  # fmt: skip
                    response.parameters["triton_final_response"].bool_param = True
                    put(_M("ModelStreamInferResponse")(infer_response=response))
            except Exception as exc:
                log.exception("stream request on model '%s' failed", request.model_name)
                put(error(f"{type(exc).__name__}: {exc}"))
            finally:
                streams.discard(stream)
                self.core.done(model)
                put(done)

        threading.Thread(target=run, name="pb-tensor-serve-stream", daemon=True).start()

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        from google.protobuf import json_format

        from pb_tensor.serve._stats import statistics

        try:
            entries = statistics(self.core, request.name, request.version)
        except ServeError as exc:
            await self._fail(context, exc)
        response = _M("ModelStatisticsResponse")()
        json_format.ParseDict({"model_stats": entries}, response, ignore_unknown_fields=True)
        return response

    def _start_single(self, request: Any, model: Any, parsed: Request, put: Any,
                      done: object, error: Any, pending: set[Any],
                      order: tuple[Any, asyncio.Future[None]]) -> None:
        previous, mine = order

        async def run() -> None:
            try:
                try:
                    outputs = await self.core.infer(
                        model, parsed.inputs, parsed.requested, parsed.parameters,
                        request.id, parsed.correlation_id, parsed.flags,
                    )  # fmt: skip
                    response = response_of(request, model.version, outputs, parsed,
                                           self.core.regions)
                    response.parameters["triton_final_response"].bool_param = True
                    reply = _M("ModelStreamInferResponse")(infer_response=response)
                except ServeError as exc:
                    reply = error(exc.message, exc.refused, exc.code)
                if previous is not None and type(reply) is not _Close:
                    await asyncio.shield(previous)
                put(reply)
            finally:
                pending.discard(task)
                put(done)
                if not mine.done():
                    mine.set_result(None)

        task = asyncio.ensure_future(run())
        pending.add(task)  # cancelled with the stream

    @staticmethod
    def _put_in_order(order: tuple[Any, asyncio.Future[None]], items: list[Any], put: Any,
                      pending: set[Any]) -> None:
        previous, mine = order

        async def run() -> None:
            try:
                if previous is not None:
                    await asyncio.shield(previous)
                for item in items:
                    put(item)
            finally:
                pending.discard(task)
                if not mine.done():
                    mine.set_result(None)

        task = asyncio.ensure_future(run())
        pending.add(task)

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        try:
            entries = self.core.regions.status(request.name)
        except ServeError as exc:
            await self._fail(context, exc)
        response = _M("SystemSharedMemoryStatusResponse")()
        for e in entries:
            status = response.regions[e["name"]]
            status.name, status.key = e["name"], e["key"]
            status.offset, status.byte_size = e["offset"], e["byte_size"]
        return response

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        try:
            self.core.regions.register(request.name, request.key, request.offset,
                                       request.byte_size)
        except ServeError as exc:
            await self._fail(context, exc)
        return _M("SystemSharedMemoryRegisterResponse")()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.core.regions.unregister(request.name)
        return _M("SystemSharedMemoryUnregisterResponse")()

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        if request.repository_name:
            await self._fail(context, ServeError(
                "'repository_name' specification is not supported", UNSUPPORTED))
        response = _M("RepositoryIndexResponse")()
        for s in self.core.index(request.ready):
            response.models.add(name=s.name, version=s.version, state=s.state, reason=s.reason)
        return response

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        config: str | None = None
        files: dict[str, bytes] = {}
        try:
            if request.repository_name:
                raise ServeError("'repository_name' specification is not supported",
                                 UNSUPPORTED)
            # Triton's gRPC front end: "config" as string_param, "file:<path>" as
            # bytes_param, any other parameter refused.
            for key, p in request.parameters.items():
                if key == "config":
                    if p.WhichOneof("parameter_choice") != "string_param":
                        raise ServeError(f"invalid value type for load parameter '{key}', "
                                         "expected string_param.")
                    config = p.string_param
                elif key.startswith("file:"):
                    if p.WhichOneof("parameter_choice") != "bytes_param":
                        raise ServeError(f"invalid value type for load parameter '{key}', "
                                         "expected bytes_param.")
                    files[key[len("file:"):]] = p.bytes_param
                else:
                    raise ServeError(f"unrecognized load parameter '{key}'.")
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.core.load, request.model_name, config, files)
        except ServeError as exc:
            await self._fail(context, exc)
        return _M("RepositoryModelLoadResponse")()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        try:
            if request.repository_name:
                raise ServeError("'repository_name' specification is not supported",
                                 UNSUPPORTED)
            dependents = False
            if "unload_dependents" in request.parameters:
                param = request.parameters["unload_dependents"]
                if param.WhichOneof("parameter_choice") != "bool_param":
                    raise ServeError("invalid value type for 'unload_dependents' parameter, "
                                     "expected bool_param.")
                dependents = param.bool_param
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, functools.partial(
                self.core.unload, request.model_name, unload_dependents=dependents))
        except ServeError as exc:
            await self._fail(context, exc)
        return _M("RepositoryModelUnloadResponse")()


_UNARY = {
    "ServerLive": ("ServerLiveRequest", "ServerLiveResponse"),
    "ServerReady": ("ServerReadyRequest", "ServerReadyResponse"),
    "ModelReady": ("ModelReadyRequest", "ModelReadyResponse"),
    "ServerMetadata": ("ServerMetadataRequest", "ServerMetadataResponse"),
    "ModelMetadata": ("ModelMetadataRequest", "ModelMetadataResponse"),
    "ModelConfig": ("ModelConfigRequest", "ModelConfigResponse"),
    "ModelInfer": ("ModelInferRequest", "ModelInferResponse"),
    "ModelStatistics": ("ModelStatisticsRequest", "ModelStatisticsResponse"),
    "RepositoryIndex": ("RepositoryIndexRequest", "RepositoryIndexResponse"),
    "SystemSharedMemoryUnregister": ("SystemSharedMemoryUnregisterRequest",
                                     "SystemSharedMemoryUnregisterResponse"),
    "SystemSharedMemoryRegister": ("SystemSharedMemoryRegisterRequest",
                                   "SystemSharedMemoryRegisterResponse"),
    "SystemSharedMemoryStatus": ("SystemSharedMemoryStatusRequest",
                                 "SystemSharedMemoryStatusResponse"),
    "RepositoryModelLoad": ("RepositoryModelLoadRequest", "RepositoryModelLoadResponse"),
    "RepositoryModelUnload": ("RepositoryModelUnloadRequest", "RepositoryModelUnloadResponse"),
    "LogSettings": ("LogSettingsRequest", "LogSettingsResponse"),
}
_NOT_SUPPORTED = {
    "CudaSharedMemoryStatus": ("CudaSharedMemoryStatusRequest",
                               "CudaSharedMemoryStatusResponse"),
    "CudaSharedMemoryRegister": ("CudaSharedMemoryRegisterRequest",
                                 "CudaSharedMemoryRegisterResponse"),
    "CudaSharedMemoryUnregister": ("CudaSharedMemoryUnregisterRequest",
                                   "CudaSharedMemoryUnregisterResponse"),
    "TraceSetting": ("TraceSettingRequest", "TraceSettingResponse"),
}


def _not_supported(method: str) -> Any:
    async def handler(request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"{method} is not supported by pb-tensor serve")

    return handler


def _handlers(core: Core) -> Any:
    service = _Service(core)
    methods: dict[str, Any] = {}
    for name, (req, resp) in {**_UNARY, **_NOT_SUPPORTED}.items():
        fn = getattr(service, name) if name in _UNARY else _not_supported(name)
        methods[name] = grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=_M(req).FromString,
            # ModelInfer answers with the serialised message (grpcio sends bytes as they are).
            response_serializer=None if name == "ModelInfer" else _M(resp).SerializeToString,
        )  # fmt: skip
    methods["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        service.ModelStreamInfer, request_deserializer=_M("ModelInferRequest").FromString,
        response_serializer=_M("ModelStreamInferResponse").SerializeToString,
    )  # fmt: skip
    return grpc.method_handlers_generic_handler(_protos.SERVICE, methods)


async def serve_grpc(core: Core, options: Options, stop: asyncio.Event,
                     started: threading.Event, result: dict[str, Any]) -> None:
    """Run the gRPC service on this thread's loop until ``stop`` is set; ``result["port"]``
    is the bound port once ``started`` is set.

    Raises:
        ServeError: the port could not be bound.
    """
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", _MAX_MESSAGE),
        ("grpc.max_receive_message_length", _MAX_MESSAGE),
        ("grpc.so_reuseport", 0),
    ])  # fmt: skip
    server.add_generic_rpc_handlers((_handlers(core),))
    address = options.grpc_address
    host = f"[{address}]" if ":" in address else address
    try:
        port = server.add_insecure_port(f"{host}:{options.grpc_port}")
    except RuntimeError as exc:
        raise ServeError(f"failed to start GRPC service on {address}:{options.grpc_port}: "
                         f"{exc}", INTERNAL) from None
    if port == 0:
        raise ServeError(f"failed to start GRPC service on {address}:{options.grpc_port}",
                         INTERNAL)
    await server.start()
    result["port"] = port
    started.set()
    await stop.wait()
    await server.stop(grace=30)
