"""Message classes of Triton's ``inference`` protos, built from the vendored descriptors in a
private descriptor pool (they never clash with tritonclient's generated copies)."""

from __future__ import annotations

from typing import Any, Final

from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory

from pb_tensor.serve._proto_desc import GRPC_SERVICE, MODEL_CONFIG

__all__ = ["SERVICE", "config_from_dict", "config_to_text", "message"]

_POOL: Final = descriptor_pool.DescriptorPool()
_POOL.Add(descriptor_pb2.FileDescriptorProto.FromString(MODEL_CONFIG))
_POOL.Add(descriptor_pb2.FileDescriptorProto.FromString(GRPC_SERVICE))

SERVICE: Final = "inference.GRPCInferenceService"
_CLASSES: dict[str, Any] = {}


def message(name: str) -> Any:
    """The message class ``inference.<name>``."""
    cls = _CLASSES.get(name)
    if cls is None:
        descriptor = _POOL.FindMessageTypeByName("inference." + name)
        get = getattr(message_factory, "GetMessageClass", None)
        if get is not None:
            cls = get(descriptor)
        else:  # protobuf < 4.22
            cls = message_factory.MessageFactory(_POOL).GetPrototype(descriptor)
        _CLASSES[name] = cls
    return cls


def config_from_dict(config: dict[str, Any]) -> Any:
    """An ``inference.ModelConfig`` from its JSON form (proto field names).

    Raises:
        google.protobuf.json_format.ParseError: a field the schema does not have.
    """
    return json_format.ParseDict(config, message("ModelConfig")(), descriptor_pool=_POOL)


def config_to_text(config: dict[str, Any]) -> str:
    """``config.pbtxt`` text of a configuration in JSON form.

    Raises:
        google.protobuf.json_format.ParseError: a field the schema does not have.
    """
    from google.protobuf import text_format

    return str(text_format.MessageToString(config_from_dict(config)))
