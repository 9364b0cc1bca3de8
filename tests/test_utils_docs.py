"""docs/pb_utils.md names every public name of upstream's triton_python_backend_utils, and
pb_tensor.utils has each of them. (Its python blocks are run by test_docs.py.)"""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "pb_utils.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


# Upstream's public names: triton_python_backend_utils.py, the pybind module
# c_python_backend_utils (pb_stub.cc) and what the stub adds at start-up, with their methods.
UPSTREAM: dict[str, tuple[str, ...]] = {
    "TRITON_STRING_TO_NUMPY": (),
    "serialize_byte_tensor": (),
    "deserialize_bytes_tensor": (),
    "get_input_tensor_by_name": (),
    "get_output_tensor_by_name": (),
    "get_input_config_by_name": (),
    "get_output_config_by_name": (),
    "using_decoupled_model_transaction_policy": (),
    "triton_to_numpy_type": (),
    "numpy_to_triton_type": (),
    "triton_string_to_numpy": (),
    "ModelConfig": (
        "as_dict",
        "set_max_batch_size",
        "set_dynamic_batching",
        "add_input",
        "add_output",
        "set_model_transaction_policy",
    ),
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START": (),
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END": (),
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL": (),
    "TRITONSERVER_REQUEST_RELEASE_ALL": (),
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE": (),
    "TritonError": (
        "code",
        "message",
        "__ErrorCode",
        "UNKNOWN",
        "INTERNAL",
        "NOT_FOUND",
        "INVALID_ARG",
        "UNAVAILABLE",
        "UNSUPPORTED",
        "ALREADY_EXISTS",
        "CANCELLED",
    ),
    "TritonModelException": (),
    "PreferredMemory": (),
    "MemoryType": ("TRITONSERVER_MEMORY_GPU", "TRITONSERVER_MEMORY_CPU"),
    "TRITONSERVER_MEMORY_GPU": (),
    "TRITONSERVER_MEMORY_CPU": (),
    "InferenceTrace": ("get_context",),
    "InferenceRequest": (
        "inputs",
        "request_id",
        "correlation_id",
        "flags",
        "set_flags",
        "timeout",
        "parameters",
        "trace",
        "exec",
        "async_exec",
        "requested_output_names",
        "get_response_sender",
        "is_cancelled",
        "set_release_flags",
    ),
    "Tensor": (
        "name",
        "as_numpy",
        "triton_dtype",
        "to_dlpack",
        "is_cpu",
        "shape",
        "from_dlpack",
        "__dlpack__",
        "__dlpack_device__",
    ),
    "InferenceResponse": ("output_tensors", "has_error", "error", "parameters"),
    "InferenceResponseSender": ("send", "is_cancelled"),
    "ResponseIterator": ("__iter__", "__next__", "cancel"),
    "Logger": (
        "LogLevel",
        "INFO",
        "WARNING",
        "ERROR",
        "VERBOSE",
        "log",
        "log_info",
        "log_warn",
        "log_error",
        "log_verbose",
    ),
    "Metric": ("increment", "set", "observe", "value"),
    "MetricKind": ("COUNTER", "GAUGE", "HISTOGRAM"),
    "MetricFamily": ("Metric", "COUNTER", "GAUGE", "HISTOGRAM"),
    "load_model": (),
    "unload_model": (),
    "is_model_ready": (),
    "get_model_dir": (),
}
NOT_APPLICABLE = (
    "async_event_future_done_callback",
    "SharedMemory",
    "shared_memory",
    "c_python_backend_utils",
)


def test_every_upstream_name_exists_and_is_in_the_table() -> None:
    import pb_tensor.utils

    text = DOC.read_text(encoding="utf-8")
    table = text[text.index("## Name table") :]
    missing_here = [
        f"{name}.{attr}" if attr else name
        for name, attrs in UPSTREAM.items()
        for attr in ("", *attrs)
        if not hasattr(pb_tensor.utils, name)
        or (attr and not hasattr(getattr(pb_tensor.utils, name), attr))
    ]
    assert missing_here == []
    missing_rows = [name for name in (*UPSTREAM, *NOT_APPLICABLE) if f"`{name}" not in table]
    assert missing_rows == []
    for name in NOT_APPLICABLE:
        assert not hasattr(pb_tensor.utils, name), name


def test_every_export_is_documented() -> None:
    import pb_tensor.utils

    text = DOC.read_text(encoding="utf-8")
    assert [name for name in pb_tensor.utils.__all__ if f"`{name}" not in text] == []
