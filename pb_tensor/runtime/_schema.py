"""Triton's model configuration schema: ``config.pbtxt`` <-> protobuf ``ModelConfig`` <-> JSON.

The message classes are built from the vendored descriptor of Triton's ``model_config.proto``
(:mod:`pb_tensor.runtime._model_config_desc`) in a private descriptor pool, so they never clash
with another copy of the same schema (``tritonclient``'s) in the default pool. Text is parsed
by protobuf's own ``text_format`` (no hand-written parser), and the JSON form follows
Triton's ``ModelConfigToJson``: proto field names, every primitive field printed, 64-bit
integers as JSON numbers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from typing import Any, Final

try:
    from google.protobuf import descriptor_pb2, descriptor_pool, json_format, text_format
except ImportError as exc:  # pragma: no cover - depends on the environment
    from pb_tensor._hints import install_hint

    raise ImportError(
        f"reading Triton model configurations needs protobuf: "
        f"{install_hint('runtime', 'protobuf')} ({exc})"
    ) from exc

from pb_tensor.errors import TritonModelException
from pb_tensor.runtime._model_config_desc import SERIALIZED_FILE_DESCRIPTOR

__all__ = [
    "ConfigError",
    "PYTHON_BACKEND",
    "PYTHON_FILENAME",
    "WILDCARD_DIM",
    "config_from_dict",
    "config_to_dict",
    "config_to_json",
    "decoupled",
    "new_config",
    "normalize",
    "normalize_instance_groups",
    "parse_config_file",
    "validate",
    "validate_io",
]

PYTHON_BACKEND: Final = "python"
PYTHON_FILENAME: Final = "model.py"
WILDCARD_DIM: Final = -1


class ConfigError(TritonModelException):
    """A model configuration that Triton would refuse (message as Triton's, plus the file)."""


def _message_class(pool: Any, full_name: str) -> Any:
    descriptor = pool.FindMessageTypeByName(full_name)
    from google.protobuf import message_factory

    get = getattr(message_factory, "GetMessageClass", None)
    if get is not None:
        return get(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)  # protobuf < 4.22


_POOL: Final = descriptor_pool.DescriptorPool()
_POOL.Add(descriptor_pb2.FileDescriptorProto.FromString(SERIALIZED_FILE_DESCRIPTOR))
_MODEL_CONFIG: Final = _message_class(_POOL, "inference.ModelConfig")


def new_config() -> Any:
    """An empty ``inference.ModelConfig`` message."""
    return _MODEL_CONFIG()


def parse_config_file(path: str) -> Any:
    """Parse ``config.pbtxt`` at ``path`` with protobuf's ``text_format``.

    Raises:
        ConfigError: the file cannot be read or is not a valid ``ModelConfig`` text proto
            (Triton's ``failed to read text proto from <path>``, then protobuf's detail).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"failed to read text proto from {path}: {exc}") from None
    config = _MODEL_CONFIG()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ConfigError(f"failed to read text proto from {path}: {_cpp_text(exc)}") from None
    return config


_INTEGER_ERROR = re.compile(
    r"^(\d+):(\d+) : '.*': (?:Couldn't parse integer: (?P<bad>.*)|Value out of range: (?P<v>.*))$"
)


def _cpp_text(exc: text_format.ParseError) -> str:
    """Protobuf's C++ text for the integer errors Triton's parser reports (``Expected
    integer, got: -`` for a negative value of an unsigned field, ``Expected integer, got:
    "x"``, ``Integer out of range (N)``); any other error as Python's protobuf words it."""
    text = str(exc)
    found = _INTEGER_ERROR.match(text)
    if found is None:
        return text
    bad, value = found.group("bad"), found.group("v")
    if bad is not None:
        detail = f"Expected integer, got: {bad}"
    elif value.startswith("-") and value[1:].isdigit() and int(value[1:]) <= 2**31:
        detail = "Expected integer, got: -"  # a signed 32-bit field would have parsed it
    else:
        detail = f"Integer out of range ({value.removeprefix('-')})"
    return f"Error parsing text-format inference.ModelConfig: {found[1]}:{found[2]}: {detail}"


# Triton's ModelConfigToJson turns these 64-bit fields back into numbers (protobuf's JSON
# printer writes them as strings): paths of int arrays and of single ints.
_INT_ARRAYS: Final[tuple[tuple[str, ...], ...]] = (
    ("input", "*", "dims"), ("input", "*", "reshape", "shape"),
    ("output", "*", "dims"), ("output", "*", "reshape", "shape"),
    ("version_policy", "specific", "versions"),
    ("sequence_batching", "state", "*", "dims"),
    ("sequence_batching", "state", "*", "initial_state", "*", "dims"),
    ("model_warmup", "*", "inputs", "**", "dims"),
)  # fmt: skip
_INTS: Final[tuple[tuple[str, ...], ...]] = (
    ("dynamic_batching", "max_queue_delay_microseconds"),
    ("dynamic_batching", "priority_levels"),
    ("dynamic_batching", "default_priority_level"),
    ("dynamic_batching", "default_queue_policy", "default_timeout_microseconds"),
    ("dynamic_batching", "priority_queue_policy", "**", "default_timeout_microseconds"),
    ("sequence_batching", "max_sequence_idle_microseconds"),
    ("sequence_batching", "oldest", "max_queue_delay_microseconds"),
    ("sequence_batching", "direct", "max_queue_delay_microseconds"),
    ("ensemble_scheduling", "step", "*", "model_version"),
)  # fmt: skip


def _fix(node: Any, path: tuple[str, ...], array: bool) -> None:
    if not path or node is None:
        return
    head, rest = path[0], path[1:]
    if head == "*":
        for item in node if isinstance(node, list) else ():
            _fix(item, rest, array)
        return
    if head == "**":
        for item in node.values() if isinstance(node, dict) else ():
            _fix(item, rest, array)
        return
    if not isinstance(node, dict) or head not in node:
        return
    if rest:
        _fix(node[head], rest, array)
    elif array:
        node[head] = [int(v) for v in node[head]]
    else:
        node[head] = int(node[head])


def config_to_dict(config: Any) -> dict[str, Any]:
    """The JSON form Triton gives models (``ModelConfigToJson``), as a dict."""
    try:
        data: dict[str, Any] = json_format.MessageToDict(
            config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    except TypeError:  # protobuf < 5.26 spells the option differently
        data = json_format.MessageToDict(
            config, preserving_proto_field_name=True, including_default_value_fields=True
        )
    for p in _INT_ARRAYS:
        _fix(data, p, True)
    for p in _INTS:
        _fix(data, p, False)
    ordered: dict[str, Any] = _ordered(data, config.DESCRIPTOR)
    return ordered


def _ordered(value: Any, descriptor: Any) -> Any:
    """Keys in declaration order, as the C++ JSON printer writes them (Python's puts the set
    fields first)."""
    if descriptor is None:
        return value
    if isinstance(value, list):
        return [_ordered(v, descriptor) for v in value]
    if not isinstance(value, dict):
        return value
    if descriptor.GetOptions().map_entry:
        inner = descriptor.fields_by_name["value"].message_type
        return {k: _ordered(v, inner) for k, v in value.items()}
    out: dict[str, Any] = {}
    for field in descriptor.fields:
        if field.name in value:
            out[field.name] = _ordered(value[field.name], field.message_type)
    return out


def config_to_json(config: Any) -> str:
    """``config_to_dict`` as the compact JSON string Triton's ``initialize`` args carry."""
    return json.dumps(config_to_dict(config), separators=(",", ":"))


def config_from_dict(data: dict[str, Any], *, where: str) -> Any:
    """A ``ModelConfig`` from its JSON form (what ``auto_complete_config`` returns).

    Raises:
        ConfigError: ``data`` does not fit the schema (the message names ``where``).
    """
    config = _MODEL_CONFIG()
    try:
        json_format.ParseDict(data, config)
    except json_format.ParseError as exc:
        raise ConfigError(f"failed to parse the model configuration of {where}: {exc}") from None
    return config


def normalize(config: Any, model_name: str) -> None:
    """Fill what Triton's core fills before the backend sees the configuration.

    ``name``, ``backend`` (``python``: the model directory holds a ``model.py``),
    ``default_model_filename``, the latest-1 version policy, pinned-memory optimization
    flags and a preferred batch size for dynamic batching.
    """
    if not config.name:
        config.name = model_name
    if not config.backend and not config.platform:
        config.backend = PYTHON_BACKEND
    if config.backend == PYTHON_BACKEND and not config.default_model_filename:
        config.default_model_filename = PYTHON_FILENAME
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if (
        config.HasField("dynamic_batching")
        and not config.dynamic_batching.preferred_batch_size
        and config.max_batch_size > 0
    ):
        config.dynamic_batching.preferred_batch_size.append(config.max_batch_size)
    if not config.HasField("ensemble_scheduling"):
        opt = config.optimization
        if not opt.HasField("input_pinned_memory"):
            opt.input_pinned_memory.enable = True
        if not opt.HasField("output_pinned_memory"):
            opt.output_pinned_memory.enable = True


def normalize_instance_groups(config: Any, gpu_count: Callable[[], int] | None = None) -> None:
    """Triton's instance-group defaults and checks (after ``auto_complete_config``): one
    group named ``<model>`` when none is given (its instance is ``<model>_0``), unnamed
    groups ``<model>_<i>`` (``i`` the group's index), count 1,
    ``KIND_AUTO`` resolved to GPU when GPUs are listed (else CPU), a ``KIND_GPU`` group
    without GPUs given every visible one. ``gpu_count`` counts the visible GPUs (asked only
    for a ``KIND_GPU`` group; default: none visible).

    Raises:
        ConfigError: Triton's messages for a ``KIND_GPU`` group with no GPU visible or a GPU
            id that is not visible, and for GPUs listed in a ``KIND_CPU`` or ``KIND_MODEL``
            group.
    """
    if not config.instance_group:
        config.instance_group.add().name = config.name
    kinds = config.instance_group[0].DESCRIPTOR.enum_types_by_name["Kind"].values_by_name
    visible: int | None = None
    for i, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{i}"
        if group.kind == kinds["KIND_AUTO"].number:
            group.kind = kinds["KIND_GPU" if group.gpus else "KIND_CPU"].number
        group.count = max(group.count, 1)
        named = f"instance group {group.name} of model {config.name}"
        if group.kind == kinds["KIND_GPU"].number:
            if visible is None:
                visible = gpu_count() if gpu_count is not None else 0
            if not group.gpus:
                if not visible:
                    raise ConfigError(f"{named} has kind KIND_GPU but no GPUs are available")
                group.gpus.extend(range(visible))
            for gid in group.gpus:
                if not 0 <= gid < visible:
                    supported = ", ".join(str(g) for g in range(visible))
                    raise ConfigError(
                        f"{named} specifies invalid or unsupported gpu id {gid}. GPUs with "
                        "at least the minimum required CUDA compute compatibility of "
                        f"6.000000 are: {supported}"
                    )
        elif group.gpus:
            kind = "KIND_MODEL" if group.kind == kinds["KIND_MODEL"].number else "KIND_CPU"
            raise ConfigError(f"{named} has kind {kind} but specifies one or more GPUs")


def validate_io(ios: Iterable[Any], prefix: str, model: str) -> None:
    """Triton's checks of a model's inputs or outputs (name, data type, dims).

    Raises:
        ConfigError: Triton's message for the first rule an input or output breaks.
    """
    for io in ios:
        if not io.name:
            raise ConfigError(f"{prefix}must specify 'name' for {model}")
        named = f"{prefix}'{io.name}' "
        if io.data_type == 0:
            raise ConfigError(f"{named}must specify 'data_type' for {model}")
        if not io.dims:
            raise ConfigError(f"{named}must specify 'dims' for {model}")
        for d in io.dims:
            if d < 1 and d != WILDCARD_DIM:
                raise ConfigError(
                    f"{named}dimension must be integer >= 1, or {WILDCARD_DIM} to indicate a "
                    f"variable-size dimension for {model}"
                )


def validate(config: Any, model_dir: str) -> None:
    """Triton's checks of a completed configuration (the ones a Python model can hit).

    Raises:
        ConfigError: Triton's message (name mismatch, negative ``max_batch_size``, inputs or
            outputs without name, data type or dims, bad dims, a non-Python backend).
    """
    dir_name = os.path.basename(os.path.normpath(model_dir))
    if config.name != dir_name:
        raise ConfigError(
            f"unexpected directory name '{dir_name}' for model '{config.name}', directory "
            "name must equal model name"
        )
    if config.backend != PYTHON_BACKEND:
        raise ConfigError(
            f"model '{config.name}' uses backend {config.backend!r} (platform "
            f"{config.platform!r}): only Python models ('backend: \"python\"') run here"
        )
    if config.max_batch_size < 0:
        raise ConfigError(f"'max_batch_size' must be non-negative value for {config.name}")
    validate_io(config.input, "model input ", config.name)
    validate_io(config.output, "model output ", config.name)


def decoupled(config: Any) -> bool:
    """Whether the configuration asks for the decoupled transaction policy."""
    return bool(config.model_transaction_policy.decoupled)
