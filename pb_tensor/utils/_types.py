"""The small types of requests: ``PreferredMemory`` (and its ``MemoryType``) and
``InferenceTrace``, plus the integer checks of upstream's pybind signatures."""

from __future__ import annotations

import enum
from typing import Final

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "NO_PREFERENCE",
    "NO_TRACE",
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_GPU",
    "UINT32_MAX",
    "UINT64_MAX",
    "InferenceTrace",
    "MemoryType",
    "PreferredMemory",
    "check_int",
]

UINT32_MAX: Final = 2**32 - 1
UINT64_MAX: Final = 2**64 - 1
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1


class MemoryType(enum.IntEnum):
    """Upstream's ``c_python_backend_utils.MemoryType``: the kinds a BLS caller may prefer for
    its outputs. Not ``pb_tensor.MemoryType`` (``TRITONSERVER_MemoryType``): upstream numbers
    these differently (GPU is 0 here), and ``pb_utils.TRITONSERVER_MEMORY_CPU`` is this one."""

    TRITONSERVER_MEMORY_GPU = 0
    TRITONSERVER_MEMORY_CPU = 1


TRITONSERVER_MEMORY_GPU: Final = MemoryType.TRITONSERVER_MEMORY_GPU
TRITONSERVER_MEMORY_CPU: Final = MemoryType.TRITONSERVER_MEMORY_CPU

_DEFAULT_MEMORY: Final = 2  # upstream's kDefault: no preference (not exposed to Python)


def check_int(value: object, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise TypeError(f"{what}={value!r} is out of range [{low}, {high}]")
    return value


class PreferredMemory:
    """Where a BLS caller prefers its output tensors:
    ``PreferredMemory(preferred_memory_type, preferred_device_id=0)``.

    Raises:
        TypeError: the type is not a ``MemoryType`` value or the device id not an int64.
    """

    __slots__ = ("_device_id", "_type")

    def __init__(self, preferred_memory_type: MemoryType, preferred_device_id: int = 0) -> None:
        if not isinstance(preferred_memory_type, MemoryType):
            raise TypeError(
                "PreferredMemory(): preferred_memory_type must be "
                "pb_utils.TRITONSERVER_MEMORY_GPU or pb_utils.TRITONSERVER_MEMORY_CPU, got "
                f"{preferred_memory_type!r}"
            )
        self._type: int = int(preferred_memory_type)
        self._device_id = check_int(
            preferred_device_id, "PreferredMemory(): preferred_device_id", INT64_MIN, INT64_MAX
        )

    @classmethod
    def _default(cls) -> PreferredMemory:
        self = cls.__new__(cls)
        self._type = _DEFAULT_MEMORY
        self._device_id = 0
        return self

    @property
    def preferred_memory_type(self) -> MemoryType | None:
        """The preferred kind, or None for the default (no preference). Typed extra."""
        return None if self._type == _DEFAULT_MEMORY else MemoryType(self._type)

    @property
    def preferred_device_id(self) -> int:
        """The preferred device id. Typed extra."""
        return self._device_id

    def __repr__(self) -> str:
        kind = self.preferred_memory_type
        return f"PreferredMemory({'default' if kind is None else kind.name}, {self._device_id})"


class InferenceTrace:
    """The trace a request belongs to (``request.trace()``). Tracing is not recorded here:
    ``get_context()`` gives the trace context text or None."""

    __slots__ = ("_context",)

    def __init__(self, context: str = "") -> None:
        self._context = context

    def get_context(self) -> str | None:
        """The trace context (W3C/OpenTelemetry propagation text), or None when empty."""
        return self._context or None

    def __repr__(self) -> str:
        return f"InferenceTrace(context={self._context!r})"


# Immutable defaults, shared by every request.
NO_PREFERENCE: Final = PreferredMemory._default()
NO_TRACE: Final = InferenceTrace()
