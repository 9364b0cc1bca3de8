"""ctypes mirrors of the DLPack C ABI, ``dlpack.h`` v1.3.

Names follow the C header (``DLTensor``, ``kDLCUDA``, ``DLPACK_FLAG_BITMASK_READ_ONLY`` ...) so
that code reads like the specification. Enumerations are :class:`enum.IntEnum` and every member is
also exported at module level under its C name.

Layouts are checked when this module is imported: a platform whose C layout differs from the
mirrors below makes the import fail with :class:`ImportError` instead of corrupting memory later.

The ``deleter`` fields are declared ``c_void_p`` (raw addresses) on purpose: a ``CFUNCTYPE``-typed
field would hide NULL checks and function identity behind ctypes objects, and every call site here
wants the raw address anyway.
"""

from __future__ import annotations

import ctypes
import enum
from typing import Final

__all__ = [
    "DLPACK_ABI_VERSION",
    "DLPACK_FLAG_BITMASK_IS_COPIED",
    "DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED",
    "DLPACK_FLAG_BITMASK_READ_ONLY",
    "DLPACK_MAJOR_VERSION",
    "DLPACK_MINOR_VERSION",
    "DLDataType",
    "DLDataTypeCode",
    "DLDevice",
    "DLDeviceType",
    "DLManagedTensor",
    "DLManagedTensorVersioned",
    "DLPackExchangeAPI",
    "DLPackExchangeAPIHeader",
    "DLPackVersion",
    "DLTensor",
    "NAME_DLPACK_EXCHANGE_API",
    "NAME_DLTENSOR",
    "NAME_DLTENSOR_VERSIONED",
    "NAME_USED_DLTENSOR",
    "NAME_USED_DLTENSOR_VERSIONED",
    "kDLAscend",
    "kDLBcomplex",
    "kDLBfloat",
    "kDLBool",
    "kDLCPU",
    "kDLCUDA",
    "kDLCUDAHost",
    "kDLCUDAManaged",
    "kDLComplex",
    "kDLExtDev",
    "kDLFloat",
    "kDLFloat4_e2m1fn",
    "kDLFloat6_e2m3fn",
    "kDLFloat6_e3m2fn",
    "kDLFloat8_e3m4",
    "kDLFloat8_e4m3",
    "kDLFloat8_e4m3b11fnuz",
    "kDLFloat8_e4m3fn",
    "kDLFloat8_e4m3fnuz",
    "kDLFloat8_e5m2",
    "kDLFloat8_e5m2fnuz",
    "kDLFloat8_e8m0fnu",
    "kDLHexagon",
    "kDLInt",
    "kDLMAIA",
    "kDLMetal",
    "kDLOneAPI",
    "kDLOpaqueHandle",
    "kDLOpenCL",
    "kDLROCM",
    "kDLROCMHost",
    "kDLTPU",
    "kDLTPUHost",
    "kDLTrn",
    "kDLUInt",
    "kDLVPI",
    "kDLVulkan",
    "kDLWebGPU",
]

DLPACK_MAJOR_VERSION: Final = 1
DLPACK_MINOR_VERSION: Final = 3
#: The ABI version this package implements, as ``(major, minor)``.
DLPACK_ABI_VERSION: Final = (DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION)

#: The data is read-only; the consumer must not write through it.
DLPACK_FLAG_BITMASK_READ_ONLY: Final = 1 << 0
#: The producer made a copy; the consumer owns the data exclusively until it calls the deleter.
DLPACK_FLAG_BITMASK_IS_COPIED: Final = 1 << 1
#: Sub-byte types are padded to one element per byte instead of packed.
DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED: Final = 1 << 2

#: PyCapsule names of the Python exchange protocol.
NAME_DLTENSOR: Final = b"dltensor"
NAME_DLTENSOR_VERSIONED: Final = b"dltensor_versioned"
NAME_USED_DLTENSOR: Final = b"used_dltensor"
NAME_USED_DLTENSOR_VERSIONED: Final = b"used_dltensor_versioned"
#: Name of the PyCapsule in ``type(x).__dlpack_c_exchange_api__`` (DLPack 1.3 C exchange API).
NAME_DLPACK_EXCHANGE_API: Final = b"dlpack_exchange_api"


class DLDeviceType(enum.IntEnum):
    """``DLDeviceType``: where the memory of a tensor lives (a C ``int32``)."""

    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3
    kDLOpenCL = 4
    kDLVulkan = 7
    kDLMetal = 8
    kDLVPI = 9
    kDLROCM = 10
    kDLROCMHost = 11
    kDLExtDev = 12
    kDLCUDAManaged = 13
    kDLOneAPI = 14
    kDLWebGPU = 15
    kDLHexagon = 16
    kDLMAIA = 17
    kDLTrn = 18
    # Post-1.3 additions on the DLPack main branch; JAX already emits kDLTPUHost.
    kDLTPU = 19
    kDLTPUHost = 20
    kDLAscend = 21


class DLDataTypeCode(enum.IntEnum):
    """``DLDataTypeCode``: the type-code part of :class:`DLDataType` (stored as ``uint8``)."""

    kDLInt = 0
    kDLUInt = 1
    kDLFloat = 2
    kDLOpaqueHandle = 3
    kDLBfloat = 4
    kDLComplex = 5
    kDLBool = 6
    kDLFloat8_e3m4 = 7
    kDLFloat8_e4m3 = 8
    kDLFloat8_e4m3b11fnuz = 9
    kDLFloat8_e4m3fn = 10
    kDLFloat8_e4m3fnuz = 11
    kDLFloat8_e5m2 = 12
    kDLFloat8_e5m2fnuz = 13
    kDLFloat8_e8m0fnu = 14
    kDLFloat6_e2m3fn = 15
    kDLFloat6_e3m2fn = 16
    kDLFloat4_e2m1fn = 17
    # Post-1.3 main.
    kDLBcomplex = 18


kDLCPU: Final = DLDeviceType.kDLCPU
kDLCUDA: Final = DLDeviceType.kDLCUDA
kDLCUDAHost: Final = DLDeviceType.kDLCUDAHost
kDLOpenCL: Final = DLDeviceType.kDLOpenCL
kDLVulkan: Final = DLDeviceType.kDLVulkan
kDLMetal: Final = DLDeviceType.kDLMetal
kDLVPI: Final = DLDeviceType.kDLVPI
kDLROCM: Final = DLDeviceType.kDLROCM
kDLROCMHost: Final = DLDeviceType.kDLROCMHost
kDLExtDev: Final = DLDeviceType.kDLExtDev
kDLCUDAManaged: Final = DLDeviceType.kDLCUDAManaged
kDLOneAPI: Final = DLDeviceType.kDLOneAPI
kDLWebGPU: Final = DLDeviceType.kDLWebGPU
kDLHexagon: Final = DLDeviceType.kDLHexagon
kDLMAIA: Final = DLDeviceType.kDLMAIA
kDLTrn: Final = DLDeviceType.kDLTrn
kDLTPU: Final = DLDeviceType.kDLTPU
kDLTPUHost: Final = DLDeviceType.kDLTPUHost
kDLAscend: Final = DLDeviceType.kDLAscend

kDLInt: Final = DLDataTypeCode.kDLInt
kDLUInt: Final = DLDataTypeCode.kDLUInt
kDLFloat: Final = DLDataTypeCode.kDLFloat
kDLOpaqueHandle: Final = DLDataTypeCode.kDLOpaqueHandle
kDLBfloat: Final = DLDataTypeCode.kDLBfloat
kDLComplex: Final = DLDataTypeCode.kDLComplex
kDLBool: Final = DLDataTypeCode.kDLBool
kDLFloat8_e3m4: Final = DLDataTypeCode.kDLFloat8_e3m4
kDLFloat8_e4m3: Final = DLDataTypeCode.kDLFloat8_e4m3
kDLFloat8_e4m3b11fnuz: Final = DLDataTypeCode.kDLFloat8_e4m3b11fnuz
kDLFloat8_e4m3fn: Final = DLDataTypeCode.kDLFloat8_e4m3fn
kDLFloat8_e4m3fnuz: Final = DLDataTypeCode.kDLFloat8_e4m3fnuz
kDLFloat8_e5m2: Final = DLDataTypeCode.kDLFloat8_e5m2
kDLFloat8_e5m2fnuz: Final = DLDataTypeCode.kDLFloat8_e5m2fnuz
kDLFloat8_e8m0fnu: Final = DLDataTypeCode.kDLFloat8_e8m0fnu
kDLFloat6_e2m3fn: Final = DLDataTypeCode.kDLFloat6_e2m3fn
kDLFloat6_e3m2fn: Final = DLDataTypeCode.kDLFloat6_e3m2fn
kDLFloat4_e2m1fn: Final = DLDataTypeCode.kDLFloat4_e2m1fn
kDLBcomplex: Final = DLDataTypeCode.kDLBcomplex


class DLPackVersion(ctypes.Structure):
    """``DLPackVersion {uint32_t major; uint32_t minor;}`` (8 bytes)."""

    _fields_ = (("major", ctypes.c_uint32), ("minor", ctypes.c_uint32))


class DLDevice(ctypes.Structure):
    """``DLDevice {DLDeviceType device_type; int32_t device_id;}`` (8 bytes)."""

    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class DLDataType(ctypes.Structure):
    """``DLDataType {uint8_t code; uint8_t bits; uint16_t lanes;}`` (4 bytes, align 2)."""

    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class DLTensor(ctypes.Structure):
    """``DLTensor`` (48 bytes). ``strides`` are in elements; NULL only when ``ndim == 0``."""

    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


class DLManagedTensor(ctypes.Structure):
    """Legacy ``DLManagedTensor`` (64 bytes), carried by ``"dltensor"`` capsules."""

    _fields_ = (
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    )


class DLManagedTensorVersioned(ctypes.Structure):
    """``DLManagedTensorVersioned`` (80 bytes), carried by ``"dltensor_versioned"`` capsules.

    Everything up to and including ``flags`` is ABI-stable across major versions, so a consumer
    may call ``deleter`` even when it rejects ``version.major``.
    """

    _fields_ = (
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    )


class DLPackExchangeAPIHeader(ctypes.Structure):
    """``DLPackExchangeAPIHeader`` (16 bytes): the part of the exchange API stable across majors.

    ``prev_api`` points to an older table (an earlier major) or is NULL.
    """


DLPackExchangeAPIHeader._fields_ = (
    ("version", DLPackVersion),
    ("prev_api", ctypes.POINTER(DLPackExchangeAPIHeader)),
)


class DLPackExchangeAPI(ctypes.Structure):
    """``DLPackExchangeAPI`` (56 bytes): the C function table of the DLPack 1.3 exchange API.

    A producer type publishes it as ``type(x).__dlpack_c_exchange_api__``, a PyCapsule named
    ``"dlpack_exchange_api"``, for the life of the process. The function pointers are raw
    addresses (like the ``deleter`` fields); their C signatures, all returning 0 on success and
    -1 with a Python exception set:

    * ``managed_tensor_allocator(DLTensor* prototype, DLManagedTensorVersioned** out,
      void* error_ctx, void (*SetError)(void*, const char*, const char*))``
    * ``managed_tensor_from_py_object_no_sync(PyObject* obj, DLManagedTensorVersioned** out)``:
      an owning tensor, no stream synchronisation
    * ``managed_tensor_to_py_object_no_sync(DLManagedTensorVersioned* tensor, PyObject** out)``:
      steals ``tensor``
    * ``dltensor_from_py_object_no_sync(PyObject* obj, DLTensor* out)``: non-owning, valid
      until control returns to the producer; may be NULL
    * ``current_work_stream(DLDeviceType device_type, int32_t device_id, void** out_stream)``
    """

    _fields_ = (
        ("header", DLPackExchangeAPIHeader),
        ("managed_tensor_allocator", ctypes.c_void_p),
        ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
        ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
        ("dltensor_from_py_object_no_sync", ctypes.c_void_p),
        ("current_work_stream", ctypes.c_void_p),
    )


def _check_layout() -> None:
    """Fail the import if the mirrors do not match the C ABI of ``dlpack.h`` v1.3."""
    expected: tuple[tuple[type[ctypes.Structure], int, int, dict[str, int]], ...] = (
        (DLPackVersion, 8, 4, {"major": 0, "minor": 4}),
        (DLDevice, 8, 4, {"device_type": 0, "device_id": 4}),
        (DLDataType, 4, 2, {"code": 0, "bits": 1, "lanes": 2}),
        (
            DLTensor,
            48,
            8,
            {
                "data": 0,
                "device": 8,
                "ndim": 16,
                "dtype": 20,
                "shape": 24,
                "strides": 32,
                "byte_offset": 40,
            },
        ),
        (DLManagedTensor, 64, 8, {"dl_tensor": 0, "manager_ctx": 48, "deleter": 56}),
        (
            DLManagedTensorVersioned,
            80,
            8,
            {"version": 0, "manager_ctx": 8, "deleter": 16, "flags": 24, "dl_tensor": 32},
        ),
        (DLPackExchangeAPIHeader, 16, 8, {"version": 0, "prev_api": 8}),
        (
            DLPackExchangeAPI,
            56,
            8,
            {
                "header": 0,
                "managed_tensor_allocator": 16,
                "managed_tensor_from_py_object_no_sync": 24,
                "managed_tensor_to_py_object_no_sync": 32,
                "dltensor_from_py_object_no_sync": 40,
                "current_work_stream": 48,
            },
        ),
    )
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        raise ImportError(
            f"dlpack_ctypes supports 64-bit platforms only: "
            f"sizeof(void*)={ctypes.sizeof(ctypes.c_void_p)}"
        )
    for struct_type, size, align, offsets in expected:
        got_size, got_align = ctypes.sizeof(struct_type), ctypes.alignment(struct_type)
        if (got_size, got_align) != (size, align):
            raise ImportError(
                f"DLPack ABI mismatch: {struct_type.__name__} has size={got_size} "
                f"align={got_align}, dlpack.h v1.3 requires size={size} align={align}"
            )
        for field, offset in offsets.items():
            got = getattr(struct_type, field).offset
            if got != offset:
                raise ImportError(
                    f"DLPack ABI mismatch: {struct_type.__name__}.{field} at offset {got}, "
                    f"dlpack.h v1.3 requires {offset}"
                )


_check_layout()
