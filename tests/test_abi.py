"""dlpack_ctypes.abi: the ctypes mirrors against dlpack.h v1.3 (64-bit layout)."""

from __future__ import annotations

import ctypes
import enum

import numpy as np
import pytest

import dlpack_ctypes
from dlpack_ctypes import abi

# (struct, sizeof, alignment, {field: offset}) from dlpack.h v1.3 on a 64-bit ABI.
LAYOUTS = [
    (abi.DLPackVersion, 8, 4, {"major": 0, "minor": 4}),
    (abi.DLDevice, 8, 4, {"device_type": 0, "device_id": 4}),
    (abi.DLDataType, 4, 2, {"code": 0, "bits": 1, "lanes": 2}),
    (
        abi.DLTensor,
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
    (abi.DLManagedTensor, 64, 8, {"dl_tensor": 0, "manager_ctx": 48, "deleter": 56}),
    (
        abi.DLManagedTensorVersioned,
        80,
        8,
        {"version": 0, "manager_ctx": 8, "deleter": 16, "flags": 24, "dl_tensor": 32},
    ),
]

# Field C types (size of each field, which pins signedness-insensitive width).
FIELD_SIZES = {
    abi.DLPackVersion: {"major": 4, "minor": 4},
    abi.DLDevice: {"device_type": 4, "device_id": 4},
    abi.DLDataType: {"code": 1, "bits": 1, "lanes": 2},
    abi.DLTensor: {
        "data": 8,
        "device": 8,
        "ndim": 4,
        "dtype": 4,
        "shape": 8,
        "strides": 8,
        "byte_offset": 8,
    },
    abi.DLManagedTensor: {"dl_tensor": 48, "manager_ctx": 8, "deleter": 8},
    abi.DLManagedTensorVersioned: {
        "version": 8,
        "manager_ctx": 8,
        "deleter": 8,
        "flags": 8,
        "dl_tensor": 48,
    },
}

DEVICE_TYPES = {
    "kDLCPU": 1,
    "kDLCUDA": 2,
    "kDLCUDAHost": 3,
    "kDLOpenCL": 4,
    "kDLVulkan": 7,
    "kDLMetal": 8,
    "kDLVPI": 9,
    "kDLROCM": 10,
    "kDLROCMHost": 11,
    "kDLExtDev": 12,
    "kDLCUDAManaged": 13,
    "kDLOneAPI": 14,
    "kDLWebGPU": 15,
    "kDLHexagon": 16,
    "kDLMAIA": 17,
    "kDLTrn": 18,
    # Post-1.3 (DLPack main); JAX already emits kDLTPUHost.
    "kDLTPU": 19,
    "kDLTPUHost": 20,
    "kDLAscend": 21,
}

DTYPE_CODES = {
    "kDLInt": 0,
    "kDLUInt": 1,
    "kDLFloat": 2,
    "kDLOpaqueHandle": 3,
    "kDLBfloat": 4,
    "kDLComplex": 5,
    "kDLBool": 6,
    "kDLFloat8_e3m4": 7,
    "kDLFloat8_e4m3": 8,
    "kDLFloat8_e4m3b11fnuz": 9,
    "kDLFloat8_e4m3fn": 10,
    "kDLFloat8_e4m3fnuz": 11,
    "kDLFloat8_e5m2": 12,
    "kDLFloat8_e5m2fnuz": 13,
    "kDLFloat8_e8m0fnu": 14,
    "kDLFloat6_e2m3fn": 15,
    "kDLFloat6_e3m2fn": 16,
    "kDLFloat4_e2m1fn": 17,
    # Post-1.3 (DLPack main).
    "kDLBcomplex": 18,
}


@pytest.mark.parametrize(("struct", "size", "align", "offsets"), LAYOUTS,
                         ids=[s[0].__name__ for s in LAYOUTS])
def test_struct_layout(
    struct: type[ctypes.Structure], size: int, align: int, offsets: dict[str, int]
) -> None:
    assert ctypes.sizeof(struct) == size
    assert ctypes.alignment(struct) == align
    assert [name for name, *_ in struct._fields_] == list(offsets)
    for field, offset in offsets.items():
        descriptor = getattr(struct, field)
        assert descriptor.offset == offset, field
        assert descriptor.size == FIELD_SIZES[struct][field], field


def test_integer_field_signedness() -> None:
    t = abi.DLTensor()
    t.ndim = -1
    t.device.device_type = -1
    t.byte_offset = 2**64 - 1
    dt = abi.DLDataType(255, 255, 65535)
    assert (t.ndim, t.device.device_type, t.byte_offset) == (-1, -1, 2**64 - 1)
    assert (dt.code, dt.bits, dt.lanes) == (255, 255, 65535)
    v = abi.DLPackVersion(2**32 - 1, 0)
    assert v.major == 2**32 - 1
    m = abi.DLManagedTensorVersioned()
    m.flags = 2**64 - 1
    assert m.flags == 2**64 - 1


def test_deleter_fields_are_raw_addresses() -> None:
    # c_void_p fields: NULL reads as None and any address round-trips unchanged.
    m, mv = abi.DLManagedTensor(), abi.DLManagedTensorVersioned()
    assert m.deleter is None
    assert mv.deleter is None
    m.deleter = mv.deleter = 0x7F00_DEAD_BEE8
    assert m.deleter == mv.deleter == 0x7F00_DEAD_BEE8


@pytest.mark.parametrize(("name", "value"), DEVICE_TYPES.items())
def test_device_types(name: str, value: int) -> None:
    member = abi.DLDeviceType[name]
    assert member == value
    assert isinstance(member, enum.IntEnum)
    assert getattr(abi, name) is member
    assert name in abi.__all__


def test_device_types_complete() -> None:
    assert {m.name: m.value for m in abi.DLDeviceType} == DEVICE_TYPES


@pytest.mark.parametrize(("name", "value"), DTYPE_CODES.items())
def test_dtype_codes(name: str, value: int) -> None:
    member = abi.DLDataTypeCode[name]
    assert member == value
    assert isinstance(member, enum.IntEnum)
    assert getattr(abi, name) is member
    assert name in abi.__all__


def test_dtype_codes_complete() -> None:
    assert {m.name: m.value for m in abi.DLDataTypeCode} == DTYPE_CODES


def test_flags_and_versions() -> None:
    assert abi.DLPACK_FLAG_BITMASK_READ_ONLY == 1
    assert abi.DLPACK_FLAG_BITMASK_IS_COPIED == 2
    assert abi.DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED == 4
    assert (abi.DLPACK_MAJOR_VERSION, abi.DLPACK_MINOR_VERSION) == (1, 3)
    assert abi.DLPACK_ABI_VERSION == (1, 3)
    for name in (
        "DLPACK_FLAG_BITMASK_READ_ONLY",
        "DLPACK_FLAG_BITMASK_IS_COPIED",
        "DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED",
        "DLPACK_ABI_VERSION",
    ):
        assert getattr(dlpack_ctypes, name) == getattr(abi, name)


def test_capsule_names() -> None:
    assert abi.NAME_DLTENSOR == b"dltensor"
    assert abi.NAME_DLTENSOR_VERSIONED == b"dltensor_versioned"
    assert abi.NAME_USED_DLTENSOR == b"used_dltensor"
    assert abi.NAME_USED_DLTENSOR_VERSIONED == b"used_dltensor_versioned"


def test_all_names_exist() -> None:
    for name in abi.__all__:
        assert hasattr(abi, name), name
    for name in dlpack_ctypes.__all__:
        assert hasattr(dlpack_ctypes, name), name
    # Every C enumerator is exported at module level, and nothing else starts with kDL.
    c_names = {n for n in dir(abi) if n.startswith("kDL")}
    assert c_names == set(DEVICE_TYPES) | set(DTYPE_CODES)
    assert dlpack_ctypes.DLDeviceType is abi.DLDeviceType
    assert dlpack_ctypes.DLDataTypeCode is abi.DLDataTypeCode


def test_layout_check_rejects_a_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    abi._check_layout()  # the real mirrors pass

    class Longer(ctypes.Structure):
        _fields_ = (*abi.DLTensor._fields_, ("extra", ctypes.c_int64))

    monkeypatch.setattr(abi, "DLTensor", Longer)
    with pytest.raises(
        ImportError,
        match=r"DLPack ABI mismatch: Longer has size=56 align=8, dlpack.h v1.3 requires size=48",
    ):
        abi._check_layout()
    monkeypatch.undo()

    class Shuffled(ctypes.Structure):
        _fields_ = (
            ("manager_ctx", ctypes.c_void_p),
            ("version", abi.DLPackVersion),
            ("deleter", ctypes.c_void_p),
            ("flags", ctypes.c_uint64),
            ("dl_tensor", abi.DLTensor),
        )

    monkeypatch.setattr(abi, "DLManagedTensorVersioned", Shuffled)
    with pytest.raises(ImportError, match=r"Shuffled.version at offset 8, .* requires 0"):
        abi._check_layout()


# ------------------------------------------------------------------------------------------------
# What the producer writes, read back through the mirrors.


def test_exported_versioned_struct_fields() -> None:
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, ::-1, 1:3]
    capsule = dlpack_ctypes.to_dlpack(a, max_version=(1, 3))
    t = dlpack_ctypes.consume(capsule)  # renames it: safe to inspect, released below
    m = abi.DLManagedTensorVersioned.from_address(
        _pointer(capsule, abi.NAME_USED_DLTENSOR_VERSIONED)
    )
    assert (m.version.major, m.version.minor) == (1, 3)
    assert m.flags == 0
    assert m.deleter
    dl = m.dl_tensor
    assert dl.data == a.__array_interface__["data"][0]
    assert (dl.device.device_type, dl.device.device_id) == (abi.kDLCPU, 0)
    assert dl.ndim == 3
    assert (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes) == (abi.kDLFloat, 32, 1)
    assert dl.shape[:3] == [2, 3, 2]
    assert dl.strides[:3] == [12, -4, 1]
    assert dl.byte_offset == 0
    # shape and strides live in the same block, right after the struct.
    base = ctypes.addressof(m)
    assert ctypes.cast(dl.shape, ctypes.c_void_p).value == base + 80
    assert ctypes.cast(dl.strides, ctypes.c_void_p).value == base + 80 + 3 * 8
    t.close()


def test_exported_legacy_struct_fields_0d() -> None:
    a = np.array(7, dtype=np.int16)
    capsule = dlpack_ctypes.to_dlpack(a)
    t = dlpack_ctypes.consume(capsule)
    m = abi.DLManagedTensor.from_address(_pointer(capsule, abi.NAME_USED_DLTENSOR))
    assert m.deleter
    dl = m.dl_tensor
    assert dl.ndim == 0
    assert not dl.shape  # NULL for ndim == 0
    assert not dl.strides
    assert (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes) == (abi.kDLInt, 16, 1)
    assert dl.data == a.__array_interface__["data"][0]
    t.close()


def test_exported_readonly_and_copied_flags() -> None:
    a = np.arange(4.0)
    a.flags.writeable = False
    t = dlpack_ctypes.from_dlpack(dlpack_ctypes.BufferExporter.from_numpy(a))
    assert t.flags == abi.DLPACK_FLAG_BITMASK_READ_ONLY
    t.close()
    t = dlpack_ctypes.from_dlpack(dlpack_ctypes.BufferExporter.from_numpy(a), copy=True)
    assert t.flags == abi.DLPACK_FLAG_BITMASK_IS_COPIED
    t.close()


_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)


def _pointer(capsule: object, name: bytes) -> int:
    ptr: int | None = _GetPointer(capsule, name)
    assert ptr
    return ptr
