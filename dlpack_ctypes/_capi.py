"""Private prototypes for the CPython C API functions this package calls.

Never set ``argtypes``/``restype`` on ``ctypes.pythonapi.X``: those attributes are shared by
every library in the process and peers that mutate them break each other. Each prototype here is
a private ``PYFUNCTYPE`` object (the GIL stays held and a pending Python error is raised after the
call), created once and immortalised so that interpreter teardown can never free it while a
callback might still use it.

Capsule names are passed as raw addresses of module-level, immortal ``create_string_buffer``
constants: ``PyCapsule_New`` and ``PyCapsule_SetName`` store the pointer, not a copy.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any, Final, cast

from dlpack_ctypes import abi

_api = ctypes.pythonapi
_py_object = ctypes.py_object
_void_p = ctypes.c_void_p

Py_IncRef: Final = cast(
    "Callable[[object], None]",
    ctypes.PYFUNCTYPE(None, _py_object)(("Py_IncRef", _api)),
)


def immortalize(obj: object) -> None:
    """Take one extra reference to ``obj`` that is never released.

    Used for everything a C callback may touch during interpreter teardown (thunks, name buffers,
    registries): after module globals are cleared they must still be alive.
    """
    Py_IncRef(obj)


def _proto(restype: Any, name: str, *argtypes: Any) -> Any:
    fn = ctypes.PYFUNCTYPE(restype, *argtypes)((name, _api))
    immortalize(fn)
    return fn


immortalize(Py_IncRef)

PyCapsule_New: Final = cast(
    "Callable[[int, int, int | None], object]",
    _proto(_py_object, "PyCapsule_New", _void_p, _void_p, _void_p),
)
PyCapsule_IsValid: Final = cast(
    "Callable[[object, int], int]",
    _proto(ctypes.c_int, "PyCapsule_IsValid", _py_object, _void_p),
)
PyCapsule_GetPointer: Final = cast(
    "Callable[[object, int], int | None]",
    _proto(_void_p, "PyCapsule_GetPointer", _py_object, _void_p),
)
PyCapsule_SetName: Final = cast(
    "Callable[[object, int], int]",
    _proto(ctypes.c_int, "PyCapsule_SetName", _py_object, _void_p),
)
PyCapsule_GetName: Final = cast(
    "Callable[[object], bytes | None]",
    _proto(ctypes.c_char_p, "PyCapsule_GetName", _py_object),
)


def _static_name(value: bytes) -> tuple[ctypes.Array[ctypes.c_char], int]:
    buf = ctypes.create_string_buffer(value)
    immortalize(buf)
    return buf, ctypes.addressof(buf)


# (buffer, address) pairs; the buffers are immortal so the addresses stay valid forever.
_NAME_BUFFERS = {
    name: _static_name(name)
    for name in (
        abi.NAME_DLTENSOR,
        abi.NAME_DLTENSOR_VERSIONED,
        abi.NAME_USED_DLTENSOR,
        abi.NAME_USED_DLTENSOR_VERSIONED,
    )
}
immortalize(_NAME_BUFFERS)
ADDR_DLTENSOR: Final = _NAME_BUFFERS[abi.NAME_DLTENSOR][1]
ADDR_DLTENSOR_VERSIONED: Final = _NAME_BUFFERS[abi.NAME_DLTENSOR_VERSIONED][1]
ADDR_USED_DLTENSOR: Final = _NAME_BUFFERS[abi.NAME_USED_DLTENSOR][1]
ADDR_USED_DLTENSOR_VERSIONED: Final = _NAME_BUFFERS[abi.NAME_USED_DLTENSOR_VERSIONED][1]

# The capsule type, without relying on types.CapsuleType (3.13+).
_probe_buf, _probe_addr = _static_name(b"dlpack_ctypes.probe")
CapsuleType: Final[type] = type(PyCapsule_New(_probe_addr, _probe_addr, None))

def _probe_capsule_name_field() -> int | None:
    """Offset of ``PyCapsule.name`` from the object's address, if it is where CPython puts it.

    Consumers claim capsules with an atomic compare-and-swap on that field, and read the name
    and the pointer from it directly (a third of the C API calls' cost). It is used only if this
    check, run once at import, shows that the fields are where CPython puts them and that writing
    the name field is exactly what ``PyCapsule_SetName`` does; otherwise the C API is used.
    """
    if sys.implementation.name != "cpython":
        return None
    offset = object.__basicsize__ + ctypes.sizeof(ctypes.c_void_p)  # {HEAD; pointer; name; ...}
    first, second = ADDR_DLTENSOR, ADDR_USED_DLTENSOR
    capsule = PyCapsule_New(_probe_addr, first, None)
    field = ctypes.c_void_p.from_address(id(capsule) + offset)
    pointer = ctypes.c_void_p.from_address(id(capsule) + offset - ctypes.sizeof(ctypes.c_void_p))
    if (
        field.value != first
        or pointer.value != _probe_addr
        or PyCapsule_GetPointer(capsule, first) != _probe_addr
    ):
        return None
    field.value = second
    if PyCapsule_GetName(capsule) != abi.NAME_USED_DLTENSOR or not PyCapsule_IsValid(
        capsule, second
    ):
        return None
    return offset


#: Where a capsule's name pointer lives relative to ``id(capsule)``, or None (use the C API).
#: The capsule's ``pointer`` field sits right before it (``CAPSULE_NAME_OFFSET - 8``).
CAPSULE_NAME_OFFSET: Final = _probe_capsule_name_field()

#: A byte view of the whole address space, for reading and writing the structs a producer hands
#: us at their absolute addresses with precompiled struct formats (3x cheaper than
#: ``ctypes.string_at``).
MEM: Final = memoryview((ctypes.c_char * sys.maxsize).from_address(0)).cast("B")

#: ``void (*)(void*)`` — the C type of DLPack deleters and of our own thunks.
VOIDFN: Final = ctypes.CFUNCTYPE(None, _void_p)
#: The same C type, called with the GIL held (for calling foreign deleters).
VOIDFN_GIL: Final = ctypes.PYFUNCTYPE(None, _void_p)
