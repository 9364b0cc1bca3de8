"""Static types of pb_tensor.utils, the ``triton_python_backend_utils`` surface (checked by
``mypy --strict``; also runs under pytest).

``assert_type`` fails type checking when an inferred type differs; the ``type: ignore[...]``
lines fail it (warn_unused_ignores) when a call that must be rejected is accepted.
"""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import Awaitable, Iterator
from typing import Any, Literal

import numpy as np
import pytest
from typing_extensions import assert_type

from pb_tensor import utils as pb_utils
from pb_tensor.utils import _context


class TritonPythonModel:
    """A model annotated against pb_tensor.utils: it must type-check under --strict."""

    model_config: dict[str, Any]
    out_dtype: type[np.generic] | type[bool]

    @staticmethod
    def auto_complete_config(
        auto_complete_model_config: pb_utils.ModelConfig,
    ) -> pb_utils.ModelConfig:
        auto_complete_model_config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4]})
        auto_complete_model_config.add_output(
            {"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}
        )
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    def initialize(self, args: dict[str, str]) -> None:
        self.model_config = json.loads(args["model_config"])
        out = pb_utils.get_output_config_by_name(self.model_config, "OUT")
        assert_type(out, dict[str, Any] | None)
        self.out_dtype = pb_utils.triton_string_to_numpy(
            out["data_type"] if out else "TYPE_FP32"
        )
        self.counter = pb_utils.MetricFamily(
            "requests_total", "Requests", pb_utils.MetricFamily.COUNTER
        ).Metric(labels={"model": "typed"})

    def execute(
        self, requests: list[pb_utils.InferenceRequest]
    ) -> list[pb_utils.InferenceResponse]:
        responses: list[pb_utils.InferenceResponse] = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "IN")
            if tensor is None:
                error = pb_utils.TritonError("IN is missing", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            out = pb_utils.Tensor("OUT", (tensor.as_numpy() * 2).astype(self.out_dtype))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            self.counter.increment(1)
            pb_utils.Logger.log_verbose(f"served {request.request_id()!r}")
        return responses

    def finalize(self) -> None:
        pb_utils.Logger.log_info("bye")


def test_request_types() -> None:
    t = pb_utils.Tensor("IN", np.zeros(4, dtype=np.float32))
    r = pb_utils.InferenceRequest(
        model_name="m",
        inputs=[t],
        requested_output_names=["OUT"],
        correlation_id="c",
        preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU),
        parameters={"a": 1, "b": True, "c": "x"},
    )
    assert_type(r.inputs(), list[pb_utils.Tensor])
    assert_type(r.requested_output_names(), set[str])
    assert_type(r.request_id(), str)
    assert_type(r.correlation_id(), int | str)
    assert_type(r.flags(), int)
    assert_type(r.timeout(), int)
    assert_type(r.parameters(), str)
    assert_type(r.model_name(), str)
    assert_type(r.is_cancelled(), bool)
    assert_type(r.trace(), pb_utils.InferenceTrace)
    assert_type(r.trace().get_context(), str | None)
    assert_type(r.get_response_sender(), pb_utils.InferenceResponseSender)
    assert_type(r.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL), None)
    assert_type(pb_utils.get_input_tensor_by_name(r, "IN"), pb_utils.Tensor | None)
    with pytest.raises(TypeError):
        pb_utils.InferenceRequest(model_name="m", inputs=[t])  # type: ignore[call-arg]
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.InferenceRequest(
            model_name="m",
            inputs=[t],
            requested_output_names=[],
            parameters={"a": 1.5},  # type: ignore[dict-item]
        )
    with pytest.raises(TypeError):
        pb_utils.InferenceRequest("m", [t], [])  # type: ignore[call-arg]


def _static_only(r: pb_utils.InferenceRequest, flag: bool) -> None:
    """Never called: BLS needs a runtime, and install() changes sys.modules."""
    assert_type(pb_utils.install(), types.ModuleType)
    assert_type(r.exec(), pb_utils.InferenceResponse)
    assert_type(r.exec(decoupled=False), pb_utils.InferenceResponse)
    assert_type(r.exec(decoupled=True), pb_utils.ResponseIterator)
    assert_type(r.exec(flag), pb_utils.InferenceResponse | pb_utils.ResponseIterator)
    assert_type(r.async_exec(), Awaitable[pb_utils.InferenceResponse])
    assert_type(r.async_exec(decoupled=True), Awaitable[pb_utils.ResponseIterator])
    for item in r.exec(decoupled=True):
        assert_type(item, pb_utils.InferenceResponse)


def test_response_types() -> None:
    t = pb_utils.Tensor("OUT", np.zeros(2))
    resp = pb_utils.InferenceResponse([t], parameters={"k": "v"})
    assert_type(resp.output_tensors(), list[pb_utils.Tensor])
    assert_type(resp.has_error(), bool)
    assert_type(resp.error(), pb_utils.TritonError | None)
    assert_type(resp.parameters(), str)
    assert_type(pb_utils.get_output_tensor_by_name(resp, "OUT"), pb_utils.Tensor | None)
    with pytest.raises(TypeError):
        pb_utils.InferenceResponse(error="boom")  # type: ignore[arg-type]

    err = pb_utils.TritonError("x", pb_utils.TritonError.NOT_FOUND)
    assert_type(err.message(), str)
    assert_type(err.code(), pb_utils.TritonErrorCode)
    assert_type(pb_utils.TritonError.CANCELLED, pb_utils.TritonErrorCode)

    sender = pb_utils.InferenceResponseSender(lambda r, f: None, lambda: False, decoupled=True)
    assert_type(sender.send(resp), None)
    assert_type(sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL), None)
    assert_type(sender.is_cancelled(), bool)
    with pytest.raises(TypeError):
        sender.send(t)  # type: ignore[arg-type]

    it = pb_utils.ResponseIterator([resp])
    assert_type(next(it), pb_utils.InferenceResponse)
    assert_type(it.cancel(), None)


def test_config_logger_metric_types() -> None:
    c = pb_utils.ModelConfig('{"name": "m", "input": [], "output": []}')
    assert_type(c.as_dict(), dict[str, Any])
    assert_type(c.set_dynamic_batching(), None)
    assert_type(c.set_model_transaction_policy({"decoupled": True}), None)
    assert_type(pb_utils.using_decoupled_model_transaction_policy(c.as_dict()), bool)
    assert_type(pb_utils.get_input_config_by_name(c.as_dict(), "x"), dict[str, Any] | None)

    assert_type(pb_utils.Logger.log("x", pb_utils.Logger.LogLevel.WARNING), None)
    assert_type(pb_utils.Logger.log_error("x"), None)
    with pytest.raises(TypeError):
        pb_utils.Logger.log("x", 1)  # type: ignore[arg-type]

    _context.reset_metrics()
    family = pb_utils.MetricFamily("g", "g", pb_utils.MetricFamily.GAUGE)
    m = family.Metric(labels={"a": "b"})
    assert_type(m, pb_utils.Metric)
    assert_type(m.value(), float)
    assert_type(m.set(1.5), None)
    with pytest.raises(TypeError):
        pb_utils.MetricFamily("g", "g", "gauge")  # type: ignore[arg-type]
    _context.reset_metrics()


def test_module_helpers_types() -> None:
    gpu: pb_utils.MemoryType = pb_utils.TRITONSERVER_MEMORY_GPU
    assert_type(pb_utils.PreferredMemory(gpu, 0).preferred_memory_type, pb_utils.MemoryType | None)
    assert_type(pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, Literal[1])
    assert_type(pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL, Literal[1])
    assert_type(pb_utils.serialize_byte_tensor(np.array([b"a"], dtype=object)),
                bytes | tuple[()] | None)


def test_typed_model_runs() -> None:
    model = TritonPythonModel()
    cfg = TritonPythonModel.auto_complete_config(pb_utils.ModelConfig('{"name": "typed"}'))
    _context.reset_metrics()
    model.initialize({"model_config": json.dumps(cfg.as_dict())})
    ok = pb_utils.InferenceRequest(
        model_name="typed",
        inputs=[pb_utils.Tensor("IN", np.arange(4, dtype=np.float32))],
        requested_output_names=["OUT"],
    )
    missing = pb_utils.InferenceRequest(model_name="typed", inputs=[], requested_output_names=[])
    first, second = model.execute([ok, missing])
    out = pb_utils.get_output_tensor_by_name(first, "OUT")
    assert out is not None
    np.testing.assert_array_equal(out.as_numpy(), np.arange(4, dtype=np.float32) * 2)
    error = second.error()
    assert error is not None
    assert error.code() is pb_utils.TritonError.INVALID_ARG
    assert model.counter.value() == 1.0
    model.finalize()
    _context.reset_metrics()
    with pytest.raises(pb_utils.TritonModelException):
        asyncio.run(_bls_outside_runtime(ok))


class _Backend:
    """A runtime's backend: must satisfy the seam's ModelBackend protocol statically."""

    def exec_request(
        self, request: pb_utils.InferenceRequest, *, decoupled: bool, timeout_us: int | None
    ) -> pb_utils.InferenceResponse | Iterator[pb_utils.InferenceResponse]:
        return pb_utils.InferenceResponse()

    def is_model_decoupled(self) -> bool:
        return False

    def model_name(self) -> str:
        return "m"

    def model_dir(self) -> str:
        return "."

    def load_model(self, model_name: str, config: str, files: dict[str, bytes] | None) -> None:
        return None

    def unload_model(self, model_name: str, unload_dependents: bool) -> None:
        return None

    def is_model_ready(self, model_name: str, model_version: str) -> bool:
        return True


def test_backend_protocol() -> None:
    backend: _context.ModelBackend = _Backend()
    previous = _context.set_backend(backend)
    try:
        assert_type(_context.get_backend(), _context.ModelBackend)
        request = pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[])
        assert not request.exec().has_error()
    finally:
        _context.set_backend(previous)


async def _bls_outside_runtime(request: pb_utils.InferenceRequest) -> None:
    await request.async_exec()
