"""A model's instances (``instance_group``) and who is using each: requests go to an idle
instance, and a thread that would wait for an instance only it (or a request it serves) holds
is refused instead of deadlocking."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pb_tensor.runtime._engines import Engine
from pb_tensor.runtime._errors import InferenceError, RequestRefused
from pb_tensor.runtime._host import HostInfo
from pb_tensor.runtime._readiness import ReadinessCheck
from pb_tensor.runtime._seam import TritonError
from pb_tensor.runtime._tracker import acts_for

__all__ = ["Instance", "InstanceFactory", "InstanceSet", "Lease"]

# How long a thread whose own request holds every instance waits for one to come free before
# it is refused (a wait that would otherwise be a deadlock); see InstanceSet.acquire.
_SELF_WAIT_GRACE = 1.0


class Instance:
    """One instance: its engine (a stub process or an in-process model object), Triton's
    name for it, the thread using it (None while idle), its readiness checks and its
    ``signature``: what an instance update matches it by (core's
    ``TritonModelInstance::Signature``: its group's configuration but for name and count,
    and its device)."""

    __slots__ = ("engine", "name", "owner", "readiness", "signature")

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.owner: int | None = None
        self.signature: object = None  # (set by whoever made it, from its group)
        self.readiness = ReadinessCheck()


@dataclass(frozen=True)
class InstanceFactory:
    """How a loaded model makes instances for an instance update: ``plan`` gives the
    instances a completed configuration asks for (each one's host information and
    signature, in Triton's order), ``start`` starts instances (raising as a load does),
    ``retire`` stops a removed instance in the background, ``gpu_count`` counts the GPUs a
    ``KIND_GPU`` group may use."""

    plan: Callable[[Any], list[tuple[HostInfo, object]]]
    start: Callable[[list[HostInfo]], list[Instance]]
    retire: Callable[[Instance], None]
    gpu_count: Callable[[], int]


class InstanceSet:
    """The instances of one loaded model; :meth:`acquire` gives an idle one."""

    def __init__(self, model_name: str, instances: list[Instance]) -> None:
        self._model_name = model_name
        self._all = list(instances)
        self._idle: deque[Instance] = deque(self._all)
        # Held directly (``with self._lock``) where threading.Condition's Python-level
        # __enter__/__exit__ would only add calls; the condition waits on the same lock.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Threads waiting in acquire(): a release with none of them (and no watcher) skips
        # Condition.notify(), which costs a Python-level ownership check even then.
        self._waiting = 0
        self._closed = False
        # The threads reading batches that no longer hold their instance (a decoupled
        # model's execute returned, its responses still come): unloading waits for them.
        self._background: list[int] = []
        # Threads waiting in hold() or close(), which a release must wake whatever happens;
        # without them a release wakes one waiter in acquire() (any of them can take the
        # idle instance), not every one of them.
        self._watchers = 0
        # Instances an update removed while they ran a batch: they take no other and go to
        # their callback (which stops them) once that batch released them.
        self._retiring: dict[int, tuple[Instance, Callable[[Instance], None]]] = {}

    @property
    def instances(self) -> list[Instance]:
        """Every instance, in Triton's order (group by group)."""
        return list(self._all)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def _self_wait(self) -> InferenceError | None:
        """The refusal for a thread whose wait no other thread would end: every instance is
        busy with this thread's own request (a BLS request to itself, or a request made
        while iterating the model's stream)."""
        if self._idle or not all(i.owner is not None and acts_for(i.owner) for i in self._all):
            return None
        if len(self._all) == 1:
            text = (
                f"model '{self._model_name}' has one instance and this thread is already "
                "using it (a BLS request to itself, or a request made while iterating its "
                "stream)"
            )
        else:
            text = (
                f"model '{self._model_name}' has {len(self._all)} instances and this thread "
                "is already using all of them (BLS requests to itself nested deeper than its "
                "instance count, or requests made while iterating its streams)"
            )
        return RequestRefused(text, TritonError.UNAVAILABLE)

    def would_self_wait(self) -> InferenceError | None:
        """:meth:`acquire`'s refusal for the current thread if it asked now (after the same
        grace period for a release), else None."""
        # First without the lock (this runs for every request a batcher queues): an idle
        # instance, or one used by another thread's request, says no. Only this thread's
        # own requests can make every instance this thread's, and it makes none meanwhile:
        # a None found here stays true.
        if self._idle:
            return None
        for instance in self._all:
            owner = instance.owner
            if owner is None or not acts_for(owner):
                return None
        grace = time.monotonic() + _SELF_WAIT_GRACE
        with self._lock:
            while True:
                refusal = self._self_wait()
                now = time.monotonic()
                if refusal is None or now >= grace or self._closed:
                    return refusal
                self._watch(grace - now)

    def acquire(self, owner: int | None = None) -> Instance | None:
        """An idle instance, now used by ``owner`` (default: the current thread); waits for
        one. None once the model is unloaded.

        Raises:
            InferenceError: UNAVAILABLE, every instance is used by this thread's requests.
        """
        grace: float | None = None
        with self._lock:
            while not self._closed:
                if self._idle:
                    instance = self._idle.popleft()
                    instance.owner = threading.get_ident() if owner is None else owner
                    return instance
                refusal = self._self_wait()
                if refusal is None:
                    self._waiting += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._waiting -= 1
                    continue
                # An instance this thread's own request holds may still come free without
                # it: an in-process decoupled execute runs, and returns, on a thread of its
                # own (a coroutine gathering two BLS streams of one instance asks for the
                # second while the first execute is returning). Refuse only once no release
                # came within the grace period.
                now = time.monotonic()
                if grace is None:
                    grace = now + _SELF_WAIT_GRACE
                if now >= grace:
                    raise refusal
                self._watch(grace - now)
            return None

    def try_acquire(self, owner: int) -> Instance | None:
        """An idle instance, now used by ``owner``, if one is idle now (else None: never
        waits, never refuses)."""
        with self._lock:
            if self._closed or not self._idle:
                return None
            instance = self._idle.popleft()
            instance.owner = owner
            return instance

    def hold(self, instance: Instance) -> bool | None:
        """Wait until ``instance`` is idle and use it (to ask its stub something between
        requests): True (release it after), False when the current thread's own request
        uses it (shared: nothing to release), None once the model is unloaded or an update
        removed the instance."""
        with self._lock:
            while not self._closed:
                if all(i is not instance for i in self._all):
                    return None  # an update removed it
                if instance.owner is not None and acts_for(instance.owner):
                    return False
                if instance in self._idle:
                    self._idle.remove(instance)
                    instance.owner = threading.get_ident()
                    return True
                self._watch()
            return None

    def _watch(self, timeout: float | None = None) -> None:
        """Wait (condition held) for any release, not only the one a waiter in acquire()
        would take (at most ``timeout`` seconds)."""
        self._watchers += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._watchers -= 1

    def release(self, instance: Instance) -> None:
        """``instance`` is idle again (or, removed by an update meanwhile, goes to the
        update's callback)."""
        with self._lock:
            instance.owner = None
            retired = self._retiring.pop(id(instance), None) if self._retiring else None
            if retired is None:
                self._idle.append(instance)
            if self._watchers or self._closed:
                self._cond.notify_all()
            elif self._waiting:
                self._cond.notify()
        if retired is not None:
            retired[1](instance)

    def retiring(self, instance: Instance) -> bool:
        """Whether an update removed ``instance`` while it ran a batch (it takes no other)."""
        return id(instance) in self._retiring

    def update(
        self, instances: list[Instance], removed: list[Instance],
        retire: Callable[[Instance], None],
    ) -> list[Instance] | None:
        """An instance update (core's ``CommitInstances``): ``instances`` are the model's
        instances from now on (the new ones idle); of ``removed``, the idle ones are given
        back now (for the caller to stop), the busy ones go to ``retire`` once their batch
        released them. None, changing nothing, once the set is closed (the model unloads:
        the caller stops the new instances it made).
        """
        now: list[Instance] = []
        with self._lock:
            if self._closed:
                return None
            known = {id(i) for i in self._all}
            for instance in removed:
                if instance in self._idle:
                    self._idle.remove(instance)
                    now.append(instance)
                else:
                    self._retiring[id(instance)] = (instance, retire)
            self._idle.extend(i for i in instances if id(i) not in known)
            self._all = list(instances)
            self._cond.notify_all()
        return now

    def detach(self, instance: Instance) -> int:
        """``instance`` is idle again while its user (the thread that took it) still reads
        its batch's replies (Triton's instance takes its next batch once ``execute``
        returned); the token for :meth:`finish`."""
        with self._lock:
            owner = instance.owner if instance.owner is not None else threading.get_ident()
            self._background.append(owner)
            instance.owner = None
            retired = self._retiring.pop(id(instance), None) if self._retiring else None
            if retired is None:
                self._idle.append(instance)
            self._cond.notify_all()
        if retired is not None:
            retired[1](instance)
        return owner

    def finish(self, token: int) -> None:
        """The batch :meth:`detach` gave ``token`` for ended."""
        with self._lock:
            self._background.remove(token)
            self._cond.notify_all()

    def close(self) -> list[Instance]:
        """Refuse further requests, wait until every instance is idle and every batch ended
        (but those the current thread's own requests use), and give them all, for
        stopping."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()
            while any(
                i.owner is not None and not acts_for(i.owner)
                for i in (*self._all, *(r[0] for r in self._retiring.values()))
            ) or any(not acts_for(owner) for owner in self._background):
                self._watch()
            self._idle.clear()
            # (an instance that retired meanwhile went to its callback, which stops it)
            retiring = [r[0] for r in self._retiring.values()]
            self._retiring.clear()
            return [*self._all, *retiring]


class Lease:
    """One batch's use of an instance, ended once: :meth:`returned` (from any thread, when a
    decoupled ``execute`` returned) frees the instance for its next batch while the batch
    goes on; :meth:`end` releases it, or ends the detached batch."""

    __slots__ = ("_instance", "_instances", "_lock", "_state", "_token")

    def __init__(self, instances: InstanceSet, instance: Instance) -> None:
        self._instances = instances
        self._instance = instance
        self._lock = threading.Lock()
        self._state = "held"
        self._token = 0

    def returned(self) -> None:
        """Free the instance (once, while held)."""
        with self._lock:
            if self._state == "held":
                self._state = "detached"
                self._token = self._instances.detach(self._instance)

    def end(self) -> None:
        """The batch ended: release the instance, or say the detached batch ended."""
        with self._lock:
            state, self._state = self._state, "ended"
            if state == "held":
                self._instances.release(self._instance)
            elif state == "detached":
                self._instances.finish(self._token)
