"""The consumer's registry: how a consumed DLPack tensor owns its producer's tensor (shared
privately by the consumer, the exchange import and the sweeps).

A consumed DLPackTensor owns its producer's tensor through one :data:`OWNED` entry: a weak
reference to the tensor (:class:`Ref`) -> the producer's deleter. Every release takes the entry
out by subscripts and calls the deleter next (:func:`release`): CPython runs signal handlers and
switches threads only at a function's entry, after a call returns and at backward jumps, so no
asynchronous exception can land between taking the entry and the call, and of two threads only
one finds the entry (``del`` is the gate). The weak reference's callback is ``DEAD.append``, a
builtin: when a tensor dies without its finaliser completing (an exception raised at the
finaliser's first bytecode is lost by CPython), the reference still reaches :data:`DEAD` in C,
and the next sweep (:func:`release_dead`: the next import, garbage collection, ``flush()`` or
the exit flush) releases it. OWNED is immortal, so the references are always reachable and the
collector calls their callbacks for tensors in garbage cycles too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from dlpack_ctypes import _capi

__all__ = ["DEAD", "OWNED", "Ref", "arm", "owns", "release", "release_dead"]


class Ref(weakref.ref):  # type: ignore[type-arg]
    """The weak reference that keys a consumed tensor's :data:`OWNED` entry (``ptr``: the
    address of its managed tensor, for the sweep of :data:`DEAD`)."""

    __slots__ = ("ptr",)

    ptr: int


#: Ref to a consumed DLPackTensor -> its producer's deleter (called with ``Ref.ptr``).
OWNED: dict[Ref, Callable[[int], object]] = {}
#: Refs whose tensor died (appended by their callback, in C).
DEAD: list[Ref] = []
_capi.immortalize(OWNED)
_capi.immortalize(DEAD)


def release(ref: Ref, ptr: int, _owned: Any = OWNED) -> None:
    """Run the deleter of the tensor ``ref`` refers to, unless it already ran (exactly once).

    Taking the entry out of :data:`OWNED` and calling its deleter are subscripts and one call:
    CPython runs signal handlers (and switches threads) only at a function's entry, after a
    call returns and at backward jumps, so nothing can run between the removal and the call.
    """
    try:
        fn = _owned[ref]
        del _owned[ref]  # the gate: of two threads here, one raises KeyError
    except KeyError:  # released already
        return
    fn(ptr)


def release_dead(_owned: Any = OWNED, _dead: Any = DEAD) -> None:
    """Release the tensors whose Ref reached :data:`DEAD`.

    Safe to interrupt and resume: a Ref leaves DEAD only after its entry was released (taken
    out of OWNED and its deleter called with nothing in between, as in :func:`release`), so an
    interruption at any point leaves it to the next sweep, which finds it released or not.
    """
    while _dead:
        try:
            ref = _dead[-1]
        except IndexError:  # emptied by another thread
            return
        try:
            fn = _owned[ref]
            del _owned[ref]
        except (KeyError, TypeError):
            # Released already, or never owned: arm() was interrupted before the entry (such
            # a reference may lack ptr, and its hash, never computed, cannot be any more).
            pass
        else:
            fn(ref.ptr)
        # contextlib.suppress would be a Python call, where a signal handler can run.
        try:  # noqa: SIM105
            _dead.remove(ref)
        except ValueError:  # removed by another thread
            pass


def arm(
    tensor: Any,
    fn: Callable[[int], object],
    ptr: int,
    _new_ref: Any = Ref,
    _dead: Any = DEAD.append,
    _owned: Any = OWNED,
) -> None:
    """Make ``tensor`` own the managed tensor at ``ptr``: ``fn(ptr)`` runs exactly once, when
    the tensor is released or dies. Ownership starts with the registry entry (the last step):
    :func:`owns` tells a caller interrupted around here whether it was reached.
    """
    ref = _new_ref(tensor, _dead)
    ref.ptr = ptr
    tensor._fn = ref
    _owned[ref] = fn


def owns(tensor: Any) -> bool:
    """``tensor`` owns its managed tensor (:func:`arm` completed, or it has no deleter)."""
    ref = getattr(tensor, "_fn", None)
    return ref is False or (ref is not None and ref in OWNED)
