"""Consuming DLPack capsules from pure Python.

:func:`from_dlpack` negotiates with any producer (an object with ``__dlpack__``, or a raw
capsule); :func:`consume` claims the capsule with one atomic rename to
``used_dltensor[_versioned]`` (so exactly one consumer can win, see ``_claim``), validates the
managed tensor, and returns a :class:`DLPackTensor` that owns it. If validation fails, or
anything interrupts the import before the tensor owns the capsule, the rename is undone and the
capsule is left to its producer. The producer's deleter runs exactly once, when the tensor and
every numpy view made from it are gone, or earlier if :meth:`DLPackTensor.close` is called while
no view exists.
"""

from __future__ import annotations

# _thread, not threading: the same thread ids, without importing threading.
import _thread
import ctypes
import struct
from collections.abc import Callable
from typing import Any, Final

from dlpack_ctypes import _capi, _claim
from dlpack_ctypes._claim import KIND_VERSIONED
from dlpack_ctypes._owned import DEAD, OWNED, Ref, arm, owns, release_dead
from dlpack_ctypes._tensor import DELETERS, DLPackTensor, blank, deleter_for, fill
from dlpack_ctypes.exchange import STREAMLESS_DEVICES, exchange_api

__all__ = ["DLPackTensor", "consume", "from_dlpack"]

_REQUEST_VERSION: Final = (1, 3)
_MEM: Final = _capi.MEM
_CapsuleType = _capi.CapsuleType
_unpack_pp = struct.Struct("@PP").unpack_from
_unpack_ptr = struct.Struct("@P").unpack_from
_pack_ptr = struct.Struct("@P").pack_into
_cas = _claim.CAS
_SEQ_CST: Final = _claim.SEQ_CST
_NAME_OFFSET: Final = _claim.NAME_OFFSET or 0
_POINTER_OFFSET: Final = _claim.POINTER_OFFSET or 0
_SLOTS = _claim.SLOTS
_thread_slot = _claim.thread_slot
_classify = _claim.classify
_KINDS = _claim.KINDS
_get_ident = _thread.get_ident
_new_tensor = object.__new__
_fill = fill
_deleter_for = deleter_for
_DELETERS = DELETERS
_exchange_api = exchange_api
_STREAMLESS: Final = STREAMLESS_DEVICES
_new_ref = Ref
_PTR_SIZE: Final = ctypes.sizeof(ctypes.c_void_p)
_dead_append = DEAD.append
_DEAD = DEAD
_OWNED = OWNED
_release_dead = release_dead


def consume(
    capsule: object,
    *,
    check: Callable[[DLPackTensor], None] | None = None,
    legacy_writable: bool = False,
) -> DLPackTensor:
    """Take ownership of a DLPack capsule (``"dltensor"`` or ``"dltensor_versioned"``).

    The capsule is claimed atomically: when several threads (or this package and another
    consumer such as numpy) consume the same capsule at once, exactly one succeeds and the others
    raise ``ValueError``. If anything fails before the tensor owns the capsule (validation,
    ``check``, an asynchronous exception, ``MemoryError``), the claim is undone and the capsule is
    left as it was, so its producer still frees it.

    Args:
        capsule: a fresh DLPack capsule.
        check: extra validation run on the parsed tensor before the import completes; if it
            raises, the capsule is left unconsumed and the error propagates. It runs before the
            data type is checked against DLPack's table, so it may see an invalid ``dtype``.
        legacy_writable: trust a legacy ``"dltensor"`` capsule's producer to allow writes. A
            legacy capsule cannot say whether its data may be written (an immutable JAX array
            and a torch tensor look alike), so by default its numpy views are read-only, as
            numpy's own ``from_dlpack`` makes them.

    Raises:
        TypeError: ``capsule`` is not a PyCapsule.
        ValueError: the capsule was already consumed (``used_...``, or another consumer won the
            race for it) or is not a DLPack capsule.
        BufferError: versioned major != 1, or an invalid tensor (unknown device type or dtype
            code, bad bits, negative ndim or shape, NULL data for a non-empty tensor, an address
            or byte stride that does not fit 64 bits ...).
    """
    if type(capsule) is not _CapsuleType:
        raise TypeError(f"consume expects a PyCapsule: got {type(capsule).__name__}")
    cas = _cas
    if cas is None:
        return _consume_locked(capsule, check, legacy_writable)
    mem = _MEM
    tensor = _new_tensor(DLPackTensor)
    tensor._fn = None
    tensor._closed = False
    tensor._viewed = False
    tensor.__array_interface__ = None
    base = id(capsule)
    field = base + _NAME_OFFSET
    slot = _SLOTS.get(_get_ident()) or _thread_slot()
    fresh = 0
    try:
        pointer, name = _unpack_pp(mem, base + _POINTER_OFFSET)
        known = _KINDS.get(name)
        if known is not None and mem[name:name + len(known[0])] == known[0]:
            kind = known[1]
        else:
            kind = _classify(name)
        fresh = name  # from here on, an exception checks whether this call holds the claim
        _pack_ptr(mem, slot[0], name)
        # No bytecode between setting the per-thread field argument and the call can run a
        # signal handler or a collection, so the argument cannot change under it.
        slot[3].value = field
        try:
            claimed = cas(slot[3], slot[4], slot[6] if kind else slot[5], _SEQ_CST, _SEQ_CST)
        except ctypes.ArgumentError as exc:
            # The arguments are ready ctypes objects of the right types: converting them fails
            # only when ctypes cannot allocate (it reports that as "argument N: MemoryError").
            raise MemoryError(f"consume: no memory to claim the capsule: {exc}") from exc
        if not claimed:
            raise _claim.name_error(ctypes.string_at(_unpack_ptr(mem, slot[0])[0]))
        deleter = _fill(tensor, pointer, kind == KIND_VERSIONED, check, legacy_writable)
        if deleter:
            # arm() inlined (the consumer's hot path): owned from the registry entry on.
            ref = _new_ref(tensor, _dead_append)
            ref.ptr = pointer
            tensor._fn = ref
            _OWNED[ref] = _DELETERS.get(deleter) or _deleter_for(deleter)
            fresh = 0  # owned: no handler point between the registry entry and this
        else:
            tensor._fn = False
            fresh = 0
    finally:
        # Undo this call's claim unless the tensor owns the capsule (fresh is cleared right
        # after the ownership is recorded). A finally clause whose first instruction starts
        # a try block, not an except clause: CPython 3.10 runs a signal handler on entry to
        # an except clause and at every taken forward branch, so a second asynchronous
        # exception there skipped the undo. Up to the compare-and-swap this path makes no
        # call and takes no branch (3.11+ run handlers only at calls and backward jumps).
        try:
            if fresh:
                # Undo unless the tensor owns the capsule (an exception raised at `fresh = 0`
                # itself, as a tracer can, finds the registry entry) and the field holds one
                # of this thread's used_ strings: only this thread renames to them, so that
                # proves this call's claim succeeded. `|` and `&` of bools: no branch.
                ref = tensor._fn
                current = mem[field:field + _PTR_SIZE]
                if ((ref is None) | ((ref is not False) & (ref not in _OWNED))) & (
                    (current == slot[8]) | (current == slot[9])
                ):
                    mem[slot[0]:slot[0] + _PTR_SIZE] = current
                    slot[7].value = fresh
                    slot[3].value = field
                    cas(slot[3], slot[4], slot[7], _SEQ_CST, _SEQ_CST)
        finally:
            pass
    if _DEAD:
        _release_dead()  # tensors whose finaliser was interrupted
    return tensor


def _consume_locked(
    capsule: object,
    check: Callable[[DLPackTensor], None] | None,
    legacy_writable: bool,
) -> DLPackTensor:
    # Without the compare-and-swap: claims among this package's consumers are serialised by a
    # lock; a foreign consumer racing on the same capsule is not excluded (documented).
    tensor = blank()
    fresh = 0
    try:
        with _claim.LOCK:
            name = _capi.PyCapsule_GetName(capsule)
            kind = _claim.FRESH_KINDS.get(name) if name is not None else None
            if kind is None:
                raise _claim.name_error(name)
            fresh = _capi.ADDR_DLTENSOR_VERSIONED if kind else _capi.ADDR_DLTENSOR
            pointer = _capi.PyCapsule_GetPointer(capsule, fresh) or 0
            slot = _thread_slot()
            _capi.PyCapsule_SetName(capsule, slot[2] if kind else slot[1])
        deleter = _fill(tensor, pointer, kind == KIND_VERSIONED, check, legacy_writable)
        if deleter:
            arm(tensor, _deleter_for(deleter), pointer)
        else:
            tensor._fn = False
    except BaseException:
        if fresh and not owns(tensor):
            with _claim.LOCK:
                name = _capi.PyCapsule_GetName(capsule)
                if name is not None and name.startswith(b"used_"):
                    _capi.PyCapsule_SetName(capsule, fresh)
        raise
    return tensor


def from_dlpack(
    obj: object,
    *,
    device: tuple[int, int] | None = None,
    copy: bool | None = None,
    stream: object = None,
    check: Callable[[DLPackTensor], None] | None = None,
    legacy_writable: bool = False,
    exchange: bool = True,
) -> DLPackTensor:
    """Import any DLPack producer (or a raw capsule) without copying.

    Asks the producer for ``max_version=(1, 3)``; if it raises TypeError and the caller asked
    for neither ``device`` nor ``copy``, retries the legacy call (``stream`` only). Without
    ``device``, ``copy`` and ``stream``, a producer type that publishes the DLPack 1.3 C exchange
    API (torch) is imported through it instead, with the same validation and errors (see
    :mod:`dlpack_ctypes.exchange`); memory that streams order (GPU) still takes ``__dlpack__``.

    Args:
        obj: an object with ``__dlpack__`` (numpy, torch, JAX, CuPy ...) or a DLPack capsule.
        device: passed to the producer as ``dl_device``.
        copy: passed to the producer.
        stream: passed to the producer when not None (the consumer's stream, DLPack rules).
        check: see :func:`consume`.
        legacy_writable: see :func:`consume`.
        exchange: use the producer type's C exchange API when it publishes one (False: always
            ``__dlpack__``).

    Raises:
        TypeError: ``obj`` is neither a capsule nor a DLPack producer, or the producer rejected
            the arguments.
        ValueError: a raw capsule combined with ``device``/``copy``/``stream`` (nothing to
            negotiate with), or an already consumed capsule.
        BufferError: the producer refused, or the tensor is invalid (see :func:`consume`).
    """
    if type(obj) is _CapsuleType:
        if device is not None or copy is not None or stream is not None:
            raise ValueError(
                "from_dlpack: device, copy and stream cannot be negotiated with a raw capsule"
            )
        return consume(obj, check=check, legacy_writable=legacy_writable)
    if stream is None and device is None and copy is None:
        # The common request, with the fewest steps (this is the consumer's hot path).
        api = _exchange_api(type(obj)) if exchange else None
        if api is not None:
            # DLPack 1.3 C exchange API: one C call. It does no stream synchronisation, which
            # only __dlpack__ can negotiate: stream-ordered memory goes back to the producer.
            tensor = api.from_py_object(obj, check=check)
            if tensor is not None:
                if tensor.device[0] in _STREAMLESS:
                    return tensor
                tensor.close()
        producer: Any = obj
        try:
            capsule = producer.__dlpack__(max_version=_REQUEST_VERSION)
        except AttributeError:
            if hasattr(obj, "__dlpack__"):
                raise  # raised inside the producer
            raise TypeError(
                f"from_dlpack expects a DLPack capsule or an object with __dlpack__: "
                f"got {type(obj).__name__}"
            ) from None
        except TypeError:
            capsule = producer.__dlpack__()  # a producer that predates DLPack 1.0
        return consume(capsule, check=check, legacy_writable=legacy_writable)
    method = getattr(obj, "__dlpack__", None)
    if method is None:
        raise TypeError(
            f"from_dlpack expects a DLPack capsule or an object with __dlpack__: "
            f"got {type(obj).__name__}"
        )
    kwargs: dict[str, Any] = {"max_version": _REQUEST_VERSION}
    if stream is not None:
        kwargs["stream"] = stream
    if device is not None:
        kwargs["dl_device"] = device
    if copy is not None:
        kwargs["copy"] = copy
    try:
        capsule = method(**kwargs)
    except TypeError:
        if device is not None or copy is not None:
            raise
        capsule = method() if stream is None else method(stream=stream)
    return consume(capsule, check=check, legacy_writable=legacy_writable)
