"""``pb_utils.Tensor`` in pure Python.

Behaves like Triton python_backend's C++ ``PbTensor`` for every input (same exception types and
messages), minus upstream's bugs; the README's "Differences from Triton" table lists each fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, SupportsIndex

import numpy as np

import dlpack_ctypes as dl
from dlpack_ctypes.abi import DLDeviceType
from pb_tensor._first_use import first_use
from pb_tensor._tensor_export import ctypes_export as _ctypes_export
from pb_tensor._tensor_export import host_copy as _host_copy
from pb_tensor._tensor_export import numpy_export as _numpy_export
from pb_tensor._tensor_export import raw_host as _raw_host
from pb_tensor._tensor_fields import TensorFields
from pb_tensor._tensor_import import DEVICE_OF_MEMORY as _DEVICE_OF_MEMORY
from pb_tensor._tensor_import import DTYPE_OF_DL as _DTYPE_OF_DL
from pb_tensor._tensor_import import KDL_CPU as _KDL_CPU
from pb_tensor._tensor_import import KDL_CUDA as _KDL_CUDA
from pb_tensor._tensor_import import KDL_CUDA_HOST as _KDL_CUDA_HOST
from pb_tensor._tensor_import import MEMORY_OF_DEVICE as _MEMORY_OF_DEVICE
from pb_tensor._tensor_import import NOT_A_PRODUCER as _NOT_A_PRODUCER
from pb_tensor._tensor_import import bind_torch as _bind_torch
from pb_tensor._tensor_import import check_importable as _check_importable
from pb_tensor._tensor_import import device_error as _device_error
from pb_tensor._tensor_import import import_gpu as _import_gpu
from pb_tensor._tensor_import import torch_array as _torch_array
from pb_tensor._tensor_import import wait_for_producer as _wait_for_producer
from pb_tensor.dtypes import MemoryType, TritonDtype, triton_dtype_from_numpy
from pb_tensor.errors import TritonBufferError, TritonModelException
from pb_tensor.extras_policy import extras_allowed
from pb_tensor.numpy_policy import bf16_numpy_allowed

if TYPE_CHECKING:
    # typing_extensions is not a runtime dependency: annotations only.
    import numpy.typing as npt
    from typing_extensions import CapsuleType

    from dlpack_ctypes.exchange import ExchangeAPI
    from pb_tensor._pickling import Decoded
    from pb_tensor.shm import SharedMemoryPool
    from pb_tensor.shm._held import Held

__all__ = ["Tensor"]

_EMPTY_NAME: Final = "Tensor name cannot be an empty string."
_STRING_DLPACK: Final = "DLPack does not have support for string tensors."
_GPU_NUMPY: Final = "Tensor is stored in GPU and cannot be converted to NumPy."
_BF16_NUMPY: Final = (
    "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and from_dlpack() "
    "instead."
)

_PICKLE_ERROR: Final = "cannot pickle 'c_python_backend_utils.Tensor' object"


def _dlpack_keywords_error(*given: object) -> str:
    """pybind11's refusal of keywords Triton's ``__dlpack__(stream=None)`` does not take."""
    names = ("max_version", "dl_device", "copy")
    kwargs = ", ".join(f"{n}={v!r}" for n, v in zip(names, given) if v is not None)
    return (
        "__dlpack__(): incompatible function arguments. The following argument types are "
        "supported:\n    1. (self: c_python_backend_utils.Tensor, stream: object = None) -> "
        f"capsule\n\nInvoked with kwargs: {kwargs} (pb-tensor's DLPack 1.x keywords are off "
        "inside models, as in Triton: ModelRepository(..., pb_tensor_extras=True) turns them on)"
    )


# numpy >= 2.4 exports host memory by its C code while keeping every rule of ours.
_NUMPY_EXPORTS: Final = dl.NUMPY_EXPORTER_KEEPS_RULES

# ------------------------------------------------------------------------------------------------
# Loaded on first use. A Tensor made from a numpy array needs neither the DLPack machinery (the
# capsule type, the consumer, the C exchange API, the exporters) nor the BYTES codec, so this
# module does not import them. Each callable below starts as a binder: its first call imports
# what it stands for, rebinds the module global to the real object and forwards the call; from
# then on the hot paths call the real object directly (no check, no import statement per call).
# The DLPack binder also binds the capsule type; the others are made by first_use().


class _Unbound:
    """What :data:`_CapsuleType` holds until the first DLPack import binds the capsule type."""


# Read by from_dlpack only after its call of _exchange_api, whose binder sets it first.
_CapsuleType: type = _Unbound
# torch.Tensor, once from_dlpack has met a producer other than a capsule while torch was
# imported (torch is never imported here).
_TorchTensor: type = _Unbound


def _bind_dlpack() -> None:
    """Bind the DLPack globals (the first DLPack import or export calls this).

    Race-free: the import system serialises the imports, every thread stores the same objects,
    and the data global is stored before the callables that trigger this, so a thread that
    finds a real callable also finds the real capsule type.
    """
    global _CapsuleType, _exchange_api, _numpy_dlpack
    from dlpack_ctypes.exchange import exchange_api

    capsule_type = dl.CapsuleType
    numpy_dlpack = dl.numpy_dlpack
    _CapsuleType = capsule_type
    _exchange_api = exchange_api
    _numpy_dlpack = numpy_dlpack


def _see_torch() -> None:
    global _TorchTensor
    found = _bind_torch()
    if found is not None:
        _TorchTensor = found


def _first_exchange_api(tp: type) -> ExchangeAPI | None:
    _bind_dlpack()
    return _exchange_api(tp)


def _first_numpy_dlpack(
    array: np.ndarray[Any, Any],
    *,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
) -> CapsuleType:
    _bind_dlpack()
    return _numpy_dlpack(array, max_version=max_version, dl_device=dl_device, copy=copy)


_exchange_api: Callable[[type], ExchangeAPI | None] = _first_exchange_api
_numpy_dlpack: Callable[..., CapsuleType] = _first_numpy_dlpack
_serialize_with_lengths: Callable[
    [npt.NDArray[Any]], tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint32] | None]
] = first_use(
    globals(), "_serialize_with_lengths", "pb_tensor.bytes_codec", "serialize_with_lengths"
)

# Enum members read on hot paths: ``MemoryType.CPU`` costs ~70 ns, a module global ~8 ns.
_CPU: Final = MemoryType.CPU
_GPU: Final = MemoryType.GPU
_BYTES: Final = TritonDtype.TYPE_BYTES
_BF16: Final = TritonDtype.TYPE_BF16

# What _check_importable passes in every C-contiguous tensor: the exchange import then skips it.
_TRITON_ACCEPTS: Final = (_DTYPE_OF_DL.keys(), _MEMORY_OF_DEVICE.keys())

# numpy dtype.num -> TritonDtype for the numeric types DLPack carries (not BYTES, not BF16).
_DIRECT_NUMPY: dict[int, TritonDtype] = {
    np.dtype(char).num: triton_dtype_from_numpy(np.dtype(char)) for char in "?bBhHiIlLqQefd"
}


class Tensor(TensorFields):
    """A named tensor, as Triton's ``pb_utils.Tensor``.

    ``Tensor(name, array)`` wraps a numpy array without copying it (a non-C-contiguous array is
    copied first, as upstream does). :meth:`from_dlpack` imports any DLPack producer.

    Raises:
        TypeError: ``name`` is not a ``str`` or ``array`` is not a ``numpy.ndarray``.
        TritonModelException: empty name ("Tensor name cannot be an empty string.") or an
            unsupported dtype ("NumPy dtype is not supported.").
    """

    # Every field lives in TensorFields' slots: no instance __dict__.
    __slots__ = ()

    def __init__(self, name: str, array: np.ndarray[Any, Any], /) -> None:
        if not isinstance(name, str) or not isinstance(array, np.ndarray):
            raise TypeError(
                "Tensor(): incompatible constructor arguments. The following argument types "
                "are supported: (name: str, array: numpy.ndarray); got "
                f"(name={type(name).__name__}, array={type(array).__name__})"
            )
        if not name:
            raise TritonModelException(_EMPTY_NAME)
        dtype = triton_dtype_from_numpy(array.dtype)
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        if dtype is not _BYTES:
            _fill(self, name, dtype, array.shape, _CPU, 0, array, None, None)
            return
        serialized, lengths = _serialize_with_lengths(array)
        _fill(self, name, dtype, array.shape, _CPU, 0, array, None, serialized)
        self._lengths = lengths

    # ----------------------------------------------------------------------------------------
    # Construction from DLPack

    @staticmethod
    def from_dlpack(name: str, tensor: object, /) -> Tensor:
        """Import a DLPack capsule or any object with ``__dlpack__``/``__dlpack_device__``.

        CPU (and pinned) memory is shared, not copied. GPU producers are synchronised through a
        per-device proxy stream before this returns; raw capsules are wrapped
        without synchronisation, as upstream does. A plain CPU ``torch.Tensor`` is read through
        torch's own numpy bridge: the same memory, dtype and errors as through DLPack, and the
        storage stays alive should the torch tensor later be ``set_()`` to other memory.

        Raises:
            TypeError: ``name`` is not a ``str``.
            TritonModelException: empty name; not a DLPack capsule/producer; a capsule that
                was already consumed; an unsupported device or dtype; a tensor that is not
                C-contiguous; GPU import without CUDA; an invalid DLPack tensor or a
                producer's ``BufferError`` (as :class:`TritonBufferError`, also a
                ``BufferError``).
        """
        if type(name) is not str:
            raise TypeError(
                "from_dlpack(): incompatible function arguments. The following argument types "
                f"are supported: (name: str, tensor: object); got name={type(name).__name__}"
            )
        if not name:
            raise TritonModelException(_EMPTY_NAME)
        if type(tensor) is np.ndarray:
            # A numpy array is wrapped directly: the same zero-copy view its DLPack export would
            # give, without the capsule round trip. Anything DLPack would refuse (strided views,
            # object or byte-swapped dtypes) takes the DLPack path below for the exact error.
            direct = _DIRECT_NUMPY.get(tensor.dtype.num)
            if (
                direct is not None and tensor.dtype.isnative and tensor.flags.c_contiguous
                and (tensor.size or extras_allowed())
            ):
                return Tensor._from_array(name, tensor, direct)
        kind = type(tensor)
        if kind is _TorchTensor:
            # A CPU torch tensor through torch's numpy bridge: the same memory as DLPack
            # gives, in one C call (see torch_array). Anything it declines, or that Triton
            # would refuse, takes DLPack below for the exact error.
            array = _torch_array(tensor)
            if array is not None:
                direct = _DIRECT_NUMPY.get(array.dtype.num)
                # Empty ones take DLPack too: numpy gives them a data pointer of its own.
                if direct is not None and array.flags.c_contiguous and array.size:
                    return _fill(_new_tensor(Tensor), name, direct, array.shape, _CPU, 0, array,
                                 None, None)
        try:
            # The DLPack 1.3 C exchange API (torch): one C call instead of __dlpack_device__
            # and __dlpack__ in Python. None: not offered or not usable for this object.
            api = _exchange_api(kind)
            if api is not None:
                if _TorchTensor is _Unbound:
                    _see_torch()
                imported = api.from_py_object(tensor, check=_check_importable,
                                              accepts=_TRITON_ACCEPTS)
                if imported is not None:
                    if imported.device[0] == _KDL_CUDA:
                        _wait_for_producer(api, imported)
                    return Tensor._from_imported(name, imported)
            if kind is _CapsuleType:
                imported = dl.consume(tensor, check=_check_importable)
            else:
                if _TorchTensor is _Unbound:
                    _see_torch()  # a torch without an exchange table still gets the bridge
                device_fn = getattr(tensor, "__dlpack_device__", None)
                if device_fn is None or not hasattr(tensor, "__dlpack__"):
                    raise TritonModelException(_NOT_A_PRODUCER)
                device_type, device_id = device_fn()
                # Compared as returned (an IntEnum or an int): int() only where it is needed.
                if device_type in (_KDL_CPU, _KDL_CUDA_HOST):
                    # exchange=False: the exchange API was tried above.
                    imported = dl.from_dlpack(tensor, check=_check_importable, exchange=False)
                elif device_type == _KDL_CUDA:
                    imported = _import_gpu(tensor, int(device_id))
                else:
                    raise _device_error(int(device_type))
        except ValueError as exc:
            # A consumed or foreign capsule: Triton model code catches TritonModelException.
            raise TritonModelException(str(exc)) from exc
        except BufferError as exc:
            # The consumer's validation (e.g. a float8 code/bits pair DLPack does not define):
            # Triton raises TritonModelException for every invalid input.
            if isinstance(exc, TritonModelException):
                raise
            raise TritonBufferError(str(exc)) from exc
        return Tensor._from_imported(name, imported)

    @staticmethod
    def _from_array(name: str, array: np.ndarray[Any, Any], dtype: TritonDtype) -> Tensor:
        return _fill(_new_tensor(Tensor), name, dtype, array.shape, _CPU, 0, array,
                     None, None)

    @staticmethod
    def _from_imported(name: str, imported: dl.DLPackTensor) -> Tensor:
        device_type, device_id = imported.device
        return _fill(_new_tensor(Tensor), name, _DTYPE_OF_DL[imported.dtype], imported.shape,
                     _MEMORY_OF_DEVICE[device_type], device_id, None, imported, None)

    # ----------------------------------------------------------------------------------------
    # The pb_utils.Tensor methods

    def as_numpy(self) -> np.ndarray[Any, Any]:
        """The data as a numpy array, without copying.

        BYTES tensors give the array they were built from (or, once loaded from shared memory,
        an object array of ``bytes``). BF16 gives an ``ml_dtypes.bfloat16`` view when
        ``ml_dtypes`` is installed and :mod:`pb_tensor.numpy_policy` allows it (inside a model
        served by ``pb_tensor.runtime`` it does not, as in Triton, unless the repository opts
        in).

        Raises:
            TritonModelException: GPU memory ("Tensor is stored in GPU and cannot be converted to
                NumPy."), or BF16 without ``ml_dtypes`` or where the policy refuses it.
        """
        array = self._array
        if array is not None:
            return array
        if self._memory_type == _GPU:
            raise TritonModelException(_GPU_NUMPY)
        return self._make_array()

    def _make_array(self) -> np.ndarray[Any, Any]:
        imported = self._dl
        if imported is None:
            raise TritonModelException(f"Tensor {self._name!r} holds no host data")
        if self._dtype == _BF16:
            if not bf16_numpy_allowed():
                raise TritonModelException(_BF16_NUMPY)
            try:
                # Not cached: whether BF16 converts depends on where as_numpy() is called.
                return imported.numpy()
            except BufferError:
                raise TritonModelException(_BF16_NUMPY) from None
        else:
            array = imported.numpy()
        self._array = array
        return array

    def to_dlpack(self) -> CapsuleType:
        """A legacy ``"dltensor"`` capsule sharing this tensor's memory (as upstream).

        Raises:
            TritonModelException: BYTES tensors ("DLPack does not have support for string
                tensors."), or read-only data (a legacy capsule cannot say so; use
                ``__dlpack__(max_version=(1, 0))``).
        """
        return self.__dlpack__()

    def __dlpack__(
        self,
        *,
        stream: object = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> CapsuleType:
        """Export through the DLPack protocol without copying.

        ``max_version=None`` gives a legacy ``"dltensor"`` capsule (JAX accepts no other);
        ``(1, x)`` a ``"dltensor_versioned"`` one (version 1.3). ``copy=True`` copies (IS_COPIED);
        ``dl_device=(kDLCPU, 0)`` of a GPU tensor copies to the host unless ``copy=False``. The
        tensor never carries pending GPU work, so any consumer ``stream`` is valid without a
        wait; ``stream=0`` is rejected for CUDA as DLPack requires.

        Raises:
            TritonBufferError: BYTES tensors, read-only data as a legacy capsule, an unsupported
                ``dl_device``; also a ``BufferError``.
            TypeError, ValueError: malformed arguments.
        """
        if (
            max_version is not None or dl_device is not None or copy is not None
        ) and not extras_allowed():
            raise TypeError(_dlpack_keywords_error(max_version, dl_device, copy))
        array = self._array
        dtype = self._dtype
        if (
            array is not None
            and stream is None
            and self._dl is None
            and self._memory_type is _CPU
            and dtype is not _BYTES
            and dtype is not _BF16
            and _NUMPY_EXPORTS
        ):
            # The common case first (a tensor made from a numpy array, exported to numpy,
            # torch or JAX): numpy's own exporter, with no other step.
            try:
                return _numpy_dlpack(array, max_version=max_version, dl_device=dl_device,
                                     copy=copy)
            except BufferError as exc:
                raise TritonBufferError(str(exc)) from exc
        if dtype == TritonDtype.TYPE_BYTES:
            raise TritonBufferError(_STRING_DLPACK)
        memory_type = self._memory_type
        if memory_type == MemoryType.CPU and (stream is None or stream == -1):
            array = self._array if self._array is not None else self._host_array_or_none()
            # numpy cannot export an ml_dtypes bfloat16 view (cached by as_numpy()), nor the
            # read-only view of a legacy import as the legacy capsule it came from.
            if (
                array is not None and _NUMPY_EXPORTS and self._dtype is not TritonDtype.TYPE_BF16
                and (self._dl is None or self._dl.version is not None)
            ):
                return _numpy_export(array, max_version, dl_device, copy)
        try:
            return _ctypes_export(self._name, dtype, self._dims, memory_type, self._memory_id,
                                  self._array, self._dl, stream, max_version, dl_device, copy)
        except BufferError as exc:
            if isinstance(exc, TritonBufferError):
                raise
            raise TritonBufferError(str(exc)) from exc

    def _host_array_or_none(self) -> np.ndarray[Any, Any] | None:
        if self._dtype == TritonDtype.TYPE_BF16:
            return None  # numpy's exporter cannot describe bfloat16
        return self._make_array()

    def __dlpack_device__(self) -> tuple[DLDeviceType, int]:
        """``(kDLCPU, 0)``, ``(kDLCUDA, id)`` or ``(kDLCUDAHost, id)``."""
        return _DEVICE_OF_MEMORY[self._memory_type], self._memory_id

    def __reduce_ex__(self, protocol: SupportsIndex, /) -> tuple[Any, ...]:
        """Pickle support, for every protocol (``multiprocessing``, Ray, Dask ...).

        The stream holds a checked metadata header (name, Triton dtype, shape, memory type) and
        the host data: BYTES as their serialised wire bytes, BF16 as 16-bit words. From protocol
        5 on the data is a :class:`pickle.PickleBuffer`, so a ``buffer_callback`` keeps it out of
        band and the loaded tensor views the received buffer (read-only when that buffer is).
        A pinned tensor loads as a CPU tensor (the received memory is not page-locked).

        Raises:
            TritonModelException: the tensor is in GPU memory (call ``to_host()`` first).
            TypeError: inside a model served by ``pb_tensor.runtime`` without
                ``pb_tensor_extras=True``, as Triton's tensors cannot be pickled.
        """
        if not extras_allowed():
            raise TypeError(_PICKLE_ERROR)
        memory_type = self._memory_type
        if memory_type == MemoryType.GPU:
            raise TritonModelException(
                f"Tensor {self._name!r} is stored in GPU memory (device {self._memory_id}) and "
                "cannot be pickled: call to_host() first to pickle a host copy"
            )
        if self._serialized is not None:
            payload = self._serialized
        elif self._dtype == TritonDtype.TYPE_BF16:
            payload = _raw_host(self._name, self._dl)
        elif self._array is not None:
            payload = self._array
        else:
            payload = self._make_array()
        return _rebuild_tensor, _encode(
            self._name, self._dtype, self._dims, memory_type, self._memory_id, payload,
            int(protocol),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """As :meth:`__reduce_ex__` with protocol 2 (for callers that skip ``__reduce_ex__``)."""
        return self.__reduce_ex__(2)

    # ----------------------------------------------------------------------------------------
    # GPU and shared memory

    def to_host(self) -> Tensor:
        """A CPU copy of this tensor (the tensor itself when it already is in host memory).

        Answers server#3547 without torch: ``t.to_host().as_numpy()`` works for GPU tensors.

        Raises:
            TritonModelException: CUDA unavailable or the copy failed.
        """
        if self._memory_type != MemoryType.GPU:
            return self
        array, imported = _host_copy(self._dtype, self._dims, self.byte_size, self.data_ptr,
                                     self._memory_id)
        return _fill(_new_tensor(Tensor), self._name, self._dtype, self._dims, MemoryType.CPU, 0,
                     array, imported, None)

    def save_to_shared_memory(self, pool: SharedMemoryPool) -> int:
        """Copy the tensor into ``pool`` once and return its handle (the same handle on every
        call, as upstream).

        The handle is a *message*: the record stays valid until a
        :meth:`load_from_shared_memory` takes it over or ``pool.release(handle)`` gives it
        back, whatever happens to this tensor (a temporary is fine). Each call hands out one
        more message on the same record (one copy). Afterwards the tensor's data lives in the
        pool. A GPU tensor stays in device memory: the record holds a CUDA IPC handle of its
        allocation and the pointer's offset in it, which a loading process opens.

        Raises:
            TritonModelException: the pool cannot grow enough, or GPU memory without CUDA
                (or memory CUDA cannot export, such as another process's mapping).
        """
        # The handle is handed over in this frame, the caller's: CPython 3.10 runs signal
        # handlers after every call returns, in the frame it returns to, so a handle returned
        # through one more frame of the library could be lost there (and the record with it).
        cell = [0]
        try:
            _save_tensor(self, pool, cell)
        except BaseException:
            _give_back(pool, cell)
            raise
        handle = cell[0]
        cell[0] = 0  # handed over: nothing from here on calls or branches (no handler runs)
        return handle

    @staticmethod
    def load_from_shared_memory(pool: SharedMemoryPool, handle: int) -> Tensor:
        """A zero-copy view of a tensor saved in ``pool`` (by any process).

        The load takes over the message of a save (see :meth:`save_to_shared_memory`); a
        second load while the record is alive adds a reference, and a failed load leaves the
        message pending. The loaded tensor, and everything exported from it, keep the
        allocation alive. A GPU
        record's IPC handle is opened on its device (and closed when the last of them dies);
        in the process that saved it, the saving tensor's memory is reused instead, as CUDA
        cannot open a handle in the process that exported it.

        Raises:
            TritonModelException: a bad handle or a corrupted record (naming the field); a GPU
                record without CUDA, or whose IPC handle cannot be opened.
        """
        # Claimed in this frame, the caller's (see save_to_shared_memory): until the claim is
        # set, losing the tensor gives the taken message back instead of dropping it.
        box: list[Held | None] = [None]
        try:
            tensor, claim = _load_tensor(pool, handle, _blank, box)
        except BaseException:
            _untake(pool, box)
            raise
        claim[0] = True  # nothing from here on calls or branches (no handler runs)
        return tensor


_new_tensor: Final = object.__new__


def _fill(
    t: Tensor,
    name: str,
    dtype: TritonDtype,
    dims: tuple[int, ...],
    memory_type: MemoryType,
    memory_id: int,
    array: np.ndarray[Any, Any] | None,
    imported: dl.DLPackTensor | None,
    serialized: np.ndarray[Any, Any] | None,
) -> Tensor:
    """Set every field of ``t`` (the one place that knows them all); returns ``t``."""
    t._name = name
    t._dtype = dtype
    t._dims = dims
    t._memory_type = memory_type
    t._memory_id = memory_id
    t._array = array
    t._dl = imported
    t._serialized = serialized
    t._lengths = None
    t._shm = None
    return t


def _blank(
    name: str, dtype: TritonDtype, dims: tuple[int, ...], memory_type: MemoryType, memory_id: int
) -> Tensor:
    """A tensor with metadata and no data yet (the shared-memory loader fills it in)."""
    return _fill(_new_tensor(Tensor), name, dtype, dims, memory_type, memory_id, None, None, None)


def _rebuild_tensor(header: object, payload: object, /) -> Tensor:
    """Unpickle a Tensor (named in pickle streams: keep this name and signature).

    Raises:
        TritonModelException: a corrupted or truncated pickle (the rule it breaks).
    """
    name, dtype, dims, array, imported, serialized = _decode(header, payload)
    return _fill(_new_tensor(Tensor), name, dtype, dims, MemoryType.CPU, 0, array, imported,
                 serialized)


# Shared memory and pickling load on first use, as the BYTES codec does (see above).
_save_tensor: Callable[[Tensor, SharedMemoryPool, list[int]], None] = first_use(
    globals(), "_save_tensor", "pb_tensor.shm._tensors", "save_tensor"
)
_give_back: Callable[[SharedMemoryPool, list[int]], None] = first_use(
    globals(), "_give_back", "pb_tensor.shm._tensors", "give_back"
)
_load_tensor: Callable[
    [
        SharedMemoryPool,
        int,
        Callable[[str, TritonDtype, tuple[int, ...], MemoryType, int], Tensor],
        list[Held | None],
    ],
    tuple[Tensor, list[bool]],
] = first_use(globals(), "_load_tensor", "pb_tensor.shm._tensors", "load_tensor")
_untake: Callable[[SharedMemoryPool, list[Held | None]], None] = first_use(
    globals(), "_untake", "pb_tensor.shm._tensors", "untake"
)
_encode: Callable[
    [str, TritonDtype, tuple[int, ...], MemoryType, int, np.ndarray[Any, Any], int],
    tuple[bytes, object],
] = first_use(globals(), "_encode", "pb_tensor._pickling", "encode")
_decode: Callable[[object, object], Decoded] = first_use(
    globals(), "_decode", "pb_tensor._pickling", "decode"
)
