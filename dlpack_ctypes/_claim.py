"""The consumer's claim on a capsule: one atomic compare-and-swap of the capsule's name pointer.

A DLPack consumer takes ownership by renaming the capsule from ``dltensor[_versioned]`` to
``used_dltensor[_versioned]``. Reading the name and writing the new one as two steps lets two
consumers both win (each then calls the deleter: a double free). Here the rename is one
``__atomic_compare_exchange_8`` on the capsule's ``name`` field (libatomic, through ctypes):
exactly one consumer wins, whether the others are this package on other threads, numpy or torch
(their C code renames while holding the GIL, so a compare-and-swap cannot interleave with it),
and also on free-threaded CPython where nothing else serialises the threads.

Each thread renames to its *own* immortal copy of the ``used_...`` strings. A consumer
interrupted right after its claim (a signal handler raising ``KeyboardInterrupt``, ``MemoryError``)
can then tell that the claim is its own by comparing pointers, and undo it.

Where libatomic or the capsule layout check is unavailable, :data:`MODE` is ``"lock"``: claims
among this package's consumers are serialised by a process-wide lock; a foreign consumer
racing on the same capsule is then not excluded (documented).
"""

from __future__ import annotations

# _thread, not threading: the same C locks and thread ids, without importing threading.
import _thread
import ctypes
import os
import struct
import sys
from typing import Any, Final, cast

from dlpack_ctypes import _capi
from dlpack_ctypes.abi import NAME_DLTENSOR, NAME_DLTENSOR_VERSIONED

__all__ = [
    "CAS",
    "FRESH_KINDS",
    "KINDS",
    "KIND_LEGACY",
    "KIND_VERSIONED",
    "LOCK",
    "MODE",
    "NAME_OFFSET",
    "POINTER_OFFSET",
    "SEQ_CST",
    "SLOTS",
    "classify",
    "name_error",
    "thread_slot",
]

KIND_LEGACY: Final = 0
KIND_VERSIONED: Final = 1

_MEM: Final = _capi.MEM
_pack_ptr = struct.Struct("@P").pack_into
_unpack_ptr = struct.Struct("@P").unpack_from
_pack_ptr_bytes = struct.Struct("@P").pack

#: Offset of the capsule's ``name`` field from ``id(capsule)``, or None (C API only).
NAME_OFFSET: Final = _capi.CAPSULE_NAME_OFFSET
#: Offset of the capsule's ``pointer`` field (right before ``name``), or None.
POINTER_OFFSET: Final = None if NAME_OFFSET is None else NAME_OFFSET - ctypes.sizeof(
    ctypes.c_void_p)

#: Serialises claims in ``"lock"`` mode (and nothing else).
LOCK = _thread.allocate_lock()


def _after_fork_in_child() -> None:
    # A thread that held the lock at fork() does not exist in the child.
    global LOCK
    LOCK = _thread.allocate_lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# --------------------------------------------------------------------------------------------
# Per-thread slots: an 8-byte "expected" cell for the compare-and-swap, then this thread's own
# copies of the two used_ names (immortal: renamed capsules point at them forever).

_USED_LEGACY = b"used_dltensor\0"
_USED_VERSIONED = b"used_dltensor_versioned\0"
_SLOT_WORDS: Final = 6  # 8 + 14 + 24 = 46 bytes
#: thread id -> (expected cell, used legacy name, used versioned name: addresses; then the
#: ctypes arguments of :data:`CAS`: the field pointer (set per call), the expected cell, the two
#: used names; then the desired value of an undo (set per undo) and the two used names'
#: addresses as native pointer bytes, to compare with the field without a call).
_SLOTS: dict[int, tuple[Any, ...]] = {}
_capi.immortalize(_SLOTS)
#: The per-thread slots, for callers that inline :func:`thread_slot`'s lookup.
SLOTS: Final = _SLOTS
_get_ident = _thread.get_ident


def _new_slot(ident: int) -> tuple[Any, ...]:
    buf = (ctypes.c_uint64 * _SLOT_WORDS)()
    _capi.immortalize(buf)
    base = ctypes.addressof(buf)
    legacy = base + 8
    versioned = legacy + len(_USED_LEGACY)
    ctypes.memmove(legacy, _USED_LEGACY, len(_USED_LEGACY))
    ctypes.memmove(versioned, _USED_VERSIONED, len(_USED_VERSIONED))
    slot = _SLOTS[ident] = (
        base, legacy, versioned, ctypes.c_void_p(0), ctypes.c_void_p(base),
        ctypes.c_uint64(legacy), ctypes.c_uint64(versioned),
        ctypes.c_uint64(0), _pack_ptr_bytes(legacy), _pack_ptr_bytes(versioned),
    )
    return slot


def thread_slot() -> tuple[Any, ...]:
    """This thread's claim slot (see ``_SLOTS``)."""
    ident = _get_ident()
    return _SLOTS.get(ident) or _new_slot(ident)


# --------------------------------------------------------------------------------------------
# Names

# name pointer -> (the bytes it held, NUL included; kind). Producers name capsules with static
# strings, so few addresses ever appear; each hit is re-verified against the bytes (a heap
# string freed and reused for another name must not be trusted).
_KINDS: dict[int, tuple[bytes, int]] = {}
#: name pointer -> (the bytes it held, NUL included; kind): read-only for callers that inline
#: the cached path of :func:`classify`.
KINDS: Final = _KINDS
#: Capsule names a consumer may claim, and their kinds.
FRESH_KINDS: Final = {NAME_DLTENSOR: KIND_LEGACY, NAME_DLTENSOR_VERSIONED: KIND_VERSIONED}


def name_error(value: bytes | None) -> ValueError:
    """The error for a capsule named ``value`` that cannot be claimed."""
    if value is not None and value.startswith(b"used_"):
        return ValueError(
            f"DLPack capsule was already consumed: name={value.decode(errors='replace')!r}"
        )
    return ValueError(
        f"not a DLPack capsule: name={value!r}, expected {NAME_DLTENSOR!r} or "
        f"{NAME_DLTENSOR_VERSIONED!r}"
    )


def classify(name: int) -> int:
    """The kind of a fresh DLPack capsule name at address ``name``.

    Raises:
        ValueError: the capsule was already consumed (``used_...``), or is not a DLPack capsule.
    """
    found = _KINDS.get(name)
    if found is not None:
        expected, kind = found
        if _MEM[name:name + len(expected)] == expected:
            return kind
    value = ctypes.string_at(name) if name else None
    kind_of = FRESH_KINDS.get(value) if value is not None else None
    if kind_of is None:
        raise name_error(value)
    if len(_KINDS) > 1024:
        _KINDS.clear()
    _KINDS[name] = (cast(bytes, value) + b"\0", kind_of)
    return kind_of


# --------------------------------------------------------------------------------------------
# The compare-and-swap


#: The memory order argument (``__ATOMIC_SEQ_CST``), as a ready ctypes object.
SEQ_CST: Final = ctypes.c_int(5)
_capi.immortalize(SEQ_CST)


def _load_cas() -> Any:
    # Called without argtypes, with ctypes objects only: a third cheaper than converting ints.
    # The library object is private to this module, so setting restype touches nobody else's.
    for lib in (None, "libatomic.so.1", "libatomic.dylib"):
        try:
            fn = ctypes.PyDLL(lib).__atomic_compare_exchange_8  # the GIL stays held
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_bool
        _capi.immortalize(fn)
        return fn
    return None


def _self_check(cas: Any) -> bool:
    # Run the exact claim on a probe capsule: a successful swap, then a failing one that must
    # leave the field alone and report what it found.
    if NAME_OFFSET is None or sys.implementation.name != "cpython":
        return False
    first, second = _capi.ADDR_DLTENSOR, _capi.ADDR_USED_DLTENSOR
    capsule = _capi.PyCapsule_New(first, first, None)
    field = ctypes.c_void_p(id(capsule) + NAME_OFFSET)
    cell = (ctypes.c_uint64 * 1)()
    addr = ctypes.addressof(cell)
    expected = ctypes.c_void_p(addr)
    _pack_ptr(_MEM, addr, first)
    if not cas(field, expected, ctypes.c_uint64(second), SEQ_CST, SEQ_CST) or (
        _capi.PyCapsule_GetName(capsule) != b"used_dltensor"
    ):
        return False
    _pack_ptr(_MEM, addr, first)
    if cas(field, expected, ctypes.c_uint64(first), SEQ_CST, SEQ_CST) or (
        _unpack_ptr(_MEM, addr)[0] != second
    ):
        return False
    return bool(_capi.PyCapsule_GetPointer(capsule, second) == first)


def _choose() -> tuple[Any, str]:
    cas = _load_cas()
    if cas is not None and _self_check(cas):
        return cas, "cas"
    return None, "lock"


_cas, _mode = _choose()
#: ``__atomic_compare_exchange_8(field, expected cell, desired, SEQ_CST, SEQ_CST)`` taking
#: ctypes objects (``c_void_p``, ``c_void_p``, ``c_uint64``, :data:`SEQ_CST` twice), or None.
CAS: Final[Any] = _cas
#: ``"cas"`` (atomic claims) or ``"lock"`` (claims serialised among this package's consumers).
MODE: Final[str] = _mode
thread_slot()  # the importing thread's slot exists before any claim can run short of memory
