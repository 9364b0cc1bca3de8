# Stubs for the subset of `cuda.bindings.driver` that pb_tensor.cuda calls (the two facts the
# runtime API cannot give: primary-context state and an allocation's start address). Unlike the
# runtime module, these calls raise (cuda.pathfinder.DynamicLibNotFoundError, a RuntimeError)
# when libcuda cannot be loaded.
from enum import IntEnum
from typing import SupportsInt

class CUresult(IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_INITIALIZED = 3

class CUpointer_attribute(IntEnum):
    CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11

class CUdevice:
    def __init__(self, init_value: int = 0) -> None: ...
    def __int__(self) -> int: ...

def cuInit(Flags: int) -> tuple[CUresult]: ...
def cuGetErrorName(error: CUresult) -> tuple[CUresult, bytes | None]: ...
def cuGetErrorString(error: CUresult) -> tuple[CUresult, bytes | None]: ...
def cuDeviceGet(ordinal: int) -> tuple[CUresult, CUdevice | None]: ...
def cuDevicePrimaryCtxGetState(
    dev: CUdevice | int,
) -> tuple[CUresult, int | None, int | None]: ...
def cuPointerGetAttribute(
    attribute: CUpointer_attribute, ptr: int
) -> tuple[CUresult, SupportsInt | None]: ...
