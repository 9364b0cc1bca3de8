"""The DLPack 1.3 C exchange API, consumed from pure Python.

A producer type may publish ``type(x).__dlpack_c_exchange_api__``: a PyCapsule named
``"dlpack_exchange_api"`` holding a :class:`~dlpack_ctypes.abi.DLPackExchangeAPI` table of C
functions that lives as long as the process. One call of its
``managed_tensor_from_py_object_no_sync`` gives an owning ``DLManagedTensorVersioned*``: no
``__dlpack_device__``/``__dlpack__`` round trip through Python and no capsule. PyTorch publishes
one (numpy, JAX and CuPy do not, as of numpy 2.4, JAX 0.10 and CuPy 14).

:func:`exchange_api` finds a usable table for an object's type (cached per type) and wraps its
functions in ctypes prototypes made once per table address. The consumer
(:func:`dlpack_ctypes.from_dlpack`) uses it only for the plain request and falls back to the
Python protocol whenever the table is absent, of an unknown version, or the call fails, so the
protocol's own errors reach the caller unchanged.

Rules kept here (each is why a fast path is not taken):

* The table must be in the type's own ``__dict__``: a subclass that inherits it may override
  ``__dlpack__`` (or, for torch, dispatch through ``__torch_function__``), and the table would
  bypass that.
* ``header.version.major`` must be 1; otherwise ``prev_api`` is walked for a major-1 table.
  Minor 2 and later share this layout. The two functions used must not be NULL.
* ``torch.Tensor``: the C function exports tensors that torch's ``__dlpack__`` refuses
  (``requires_grad``, the conjugate bit) and ignores torch function modes; such tensors take
  the protocol path, which raises torch's own ``BufferError``. (Sparse and other non-strided
  tensors make the C function fail, which also falls back.)
* The ``no_sync`` functions do no stream synchronisation: a caller importing memory that
  streams write to must order its work after ``current_work_stream`` itself.
"""

from __future__ import annotations

# _thread, not threading: the same C locks and thread-local storage, without importing threading.
import _thread
import ctypes
import struct
import sys
from collections.abc import Callable
from typing import Any, Final

from dlpack_ctypes import _capi
from dlpack_ctypes._adopt import Accepts, adopt, release_versioned
from dlpack_ctypes._tensor import DLPackTensor
from dlpack_ctypes.abi import (
    DLPACK_MAJOR_VERSION,
    NAME_DLPACK_EXCHANGE_API,
    DLDeviceType,
    DLPackExchangeAPI,
    DLPackExchangeAPIHeader,
)

__all__ = ["ATTRIBUTE", "STREAMLESS_DEVICES", "ExchangeAPI", "exchange_api"]

#: The type attribute that publishes the table.
ATTRIBUTE: Final = "__dlpack_c_exchange_api__"

#: Device types whose memory no stream orders: a ``no_sync`` import of them is complete.
STREAMLESS_DEVICES: Final = frozenset(
    {DLDeviceType.kDLCPU, DLDeviceType.kDLCUDAHost, DLDeviceType.kDLROCMHost}
)

#: Oldest minor version whose table has the layout mirrored in ``abi.DLPackExchangeAPI``.
_MIN_MINOR: Final = 2
# A corrupt prev_api chain must not loop forever.
_MAX_CHAIN: Final = 16
# Types are few; the bound only keeps a program that makes classes on the fly from pinning them.
_MAX_TYPES: Final = 256

_name_buf = ctypes.create_string_buffer(NAME_DLPACK_EXCHANGE_API)
_capi.immortalize(_name_buf)
_NAME_ADDR: Final = ctypes.addressof(_name_buf)

# int (*)(PyObject*, DLManagedTensorVersioned**), called with the GIL held (it may set a
# Python error, which PYFUNCTYPE raises after the call).
_FROM_PY_OBJECT: Final = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p)
# int (*)(DLDeviceType, int32_t, void**)
_CURRENT_WORK_STREAM: Final = ctypes.PYFUNCTYPE(
    ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p
)

_MEM: Final = _capi.MEM
_adopt: Final = adopt
_unpack_ptr: Final = struct.Struct("@P").unpack_from


class _Cell(_thread._local):
    """One ``void*`` out-parameter per thread (a shared one could be overwritten by another
    thread between the call and the read)."""

    def __init__(self) -> None:
        self.buffer = ctypes.c_void_p()
        self.address = ctypes.addressof(self.buffer)


_cell: Final = _Cell()


class ExchangeAPI:
    """A producer's exchange table, its functions wrapped once.

    Attributes:
        address: the ``DLPackExchangeAPI*`` in use (after walking ``prev_api``).
        version: its ``(major, minor)``.
    """

    __slots__ = ("_from_py_object", "_guard", "_work_stream", "address", "version")

    address: int
    version: tuple[int, int]

    def __init__(self, address: int, guard: Callable[[Any], bool] | None) -> None:
        table = DLPackExchangeAPI.from_address(address)
        self.address = address
        self.version = (table.header.version.major, table.header.version.minor)
        from_py = _FROM_PY_OBJECT(table.managed_tensor_from_py_object_no_sync or 0)
        work_stream = _CURRENT_WORK_STREAM(table.current_work_stream or 0)
        # Prototypes bound to C addresses that live for the process: never free them.
        _capi.immortalize(from_py)
        _capi.immortalize(work_stream)
        self._from_py_object: Callable[[object, int], int] = from_py
        self._work_stream: Callable[[int, int, int], int] = work_stream
        self._guard = guard

    def __repr__(self) -> str:
        return f"ExchangeAPI(address={self.address:#x}, version={self.version})"

    def managed_tensor(self, obj: object) -> int:
        """An owning ``DLManagedTensorVersioned*`` for ``obj``, or 0 to use ``__dlpack__``.

        0 means the table must not be used for this object (see the module notes) or the
        producer failed; any error it set is discarded, so that the Python protocol raises its
        own. The caller owns a non-zero result and must call its deleter exactly once.
        """
        guard = self._guard
        if guard is not None and not guard(obj):
            return 0
        cell = _cell.address
        try:
            if self._from_py_object(obj, cell):
                return 0
        except Exception:
            return 0
        (address,) = _unpack_ptr(_MEM, cell)
        return address or 0

    def from_py_object(
        self,
        obj: object,
        *,
        check: Callable[[DLPackTensor], None] | None = None,
        accepts: Accepts | None = None,
    ) -> DLPackTensor | None:
        """Import ``obj`` with one C call and no stream synchronisation; None: use
        ``__dlpack__`` instead (see :meth:`managed_tensor`).

        The tensor is validated exactly as a consumed capsule is (same errors); on any failure
        the producer's deleter runs once before the error propagates. ``accepts``: the
        ``(dtypes, device types)`` that ``check`` passes in every C-contiguous tensor, which
        then skips the call of ``check``.

        Raises:
            BufferError: an invalid tensor (as :func:`dlpack_ctypes.consume`).
            Exception: whatever ``check`` raises.
        """
        # managed_tensor() inlined: this is the import's hot path.
        guard = self._guard
        if guard is not None and not guard(obj):
            return None
        cell = _cell.address
        try:
            if self._from_py_object(obj, cell):
                return None
        except Exception:
            return None
        try:
            (address,) = _unpack_ptr(_MEM, cell)  # allocates: a MemoryError must not leak it
        except BaseException:
            _discard(cell)
            raise
        return _adopt(address, check=check, accepts=accepts) if address else None

    def current_work_stream(self, device_type: int, device_id: int) -> int:
        """The producer's current stream on ``(device_type, device_id)`` (0: none/default).

        Raises:
            BufferError: the producer failed without setting an error.
            Exception: the error the producer set.
        """
        cell = _cell.address
        if self._work_stream(int(device_type), int(device_id), cell):
            raise BufferError(
                f"current_work_stream failed for device=({int(device_type)}, {int(device_id)})"
            )
        (stream,) = _unpack_ptr(_MEM, cell)
        return stream or 0


def _discard(cell: int) -> None:
    # The producer's new tensor is ours, but reading its address failed (MemoryError, or a
    # signal handler raising): read it again and call its deleter, as adopt() does on failure.
    (address,) = _unpack_ptr(_MEM, cell)
    if address:
        release_versioned(address)


# Wrappers by (table address, guard): a table lives for the process, so does its wrapper.
_BY_ADDRESS: dict[tuple[int, Callable[[Any], bool] | None], ExchangeAPI] = {}
_capi.immortalize(_BY_ADDRESS)
# Producer types seen -> their usable table, or None.
_BY_TYPE: dict[type, ExchangeAPI | None] = {}


def exchange_api(tp: type) -> ExchangeAPI | None:
    """The usable exchange table of producer type ``tp``, or None (use ``__dlpack__``).

    Cached per type. None when ``tp`` does not define :data:`ATTRIBUTE` itself, the attribute
    is not a ``"dlpack_exchange_api"`` capsule, no table in the ``prev_api`` chain has major
    version 1 and minor >= 2, or a function this package calls is NULL. Never raises.
    """
    try:
        return _BY_TYPE[tp]
    except KeyError:
        pass
    except TypeError:  # an unhashable metaclass instance
        return None
    found = _discover(tp)
    # No lock: each dict operation is atomic, and a race only discovers a type twice. A lock
    # here could be left held for good by an asynchronous exception (KeyboardInterrupt) landing
    # between the end of a with-block and its __exit__ call, which Python does not protect;
    # every later first import of a type would then hang.
    if len(_BY_TYPE) >= _MAX_TYPES:
        _BY_TYPE.clear()
    _BY_TYPE[tp] = found
    return found


def _discover(tp: type) -> ExchangeAPI | None:
    try:
        capsule = vars(tp).get(ATTRIBUTE)
    except TypeError:
        return None
    if type(capsule) is not _capi.CapsuleType:
        return None
    try:
        address = _capi.PyCapsule_GetPointer(capsule, _NAME_ADDR) or 0
    except ValueError:  # another capsule name
        return None
    address = _usable_table(address)
    if not address:
        return None
    guard = _torch_guard(tp)
    # No lock (see exchange_api): two racing discoveries may each wrap the table; both wrappers
    # are equivalent and setdefault keeps one.
    api = _BY_ADDRESS.get((address, guard))
    if api is None:
        api = _BY_ADDRESS.setdefault((address, guard), ExchangeAPI(address, guard))
    return api


def _usable_table(address: int) -> int:
    """Walk ``prev_api`` from ``address`` to a table this package understands (0: none)."""
    for _ in range(_MAX_CHAIN):
        if not address:
            return 0
        header = DLPackExchangeAPIHeader.from_address(address)
        if header.version.major == DLPACK_MAJOR_VERSION:
            if header.version.minor < _MIN_MINOR:
                return 0
            table = DLPackExchangeAPI.from_address(address)
            if not table.managed_tensor_from_py_object_no_sync or not table.current_work_stream:
                return 0
            return address
        address = ctypes.cast(header.prev_api, ctypes.c_void_p).value or 0
    return 0


_TORCH_GUARDS: dict[type, Callable[[Any], bool]] = {}
_capi.immortalize(_TORCH_GUARDS)


def _torch_guard(tp: type) -> Callable[[Any], bool] | None:
    """For ``torch.Tensor``: a check that the tensor is one torch's ``__dlpack__`` exports as
    is (the C function skips those checks; see the module notes)."""
    torch: Any = sys.modules.get("torch")
    if torch is None or tp is not getattr(torch, "Tensor", None):
        return None
    guard = _TORCH_GUARDS.get(tp)
    if guard is None:
        # Non-strided layouts (sparse, mkldnn) need no check: they have no storage, so the C
        # function fails and the protocol raises torch's own error.

        def torch_guard(
            t: Any,
            _has_torch_function: Any = torch.overrides.has_torch_function_unary,
            _is_conj: Any = torch.Tensor.is_conj,
        ) -> bool:
            return not (t.requires_grad or _has_torch_function(t) or _is_conj(t))

        guard = _TORCH_GUARDS[tp] = torch_guard
    return guard
