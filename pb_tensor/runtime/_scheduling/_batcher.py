"""Triton's dynamic batcher (core's ``dynamic_batch_scheduler.cc`` and the priority queue of
``scheduler_utils.cc``): concurrent requests wait in a queue per priority level and leave it
together, as one ``execute(requests)`` call on an idle instance.

A batch grows while the next queued request fits: its batch size (first dimension) keeps the
total within ``max_batch_size``, and its inputs that Triton requires to match (variable-size
inputs not marked ``allow_ragged_batch``; the set of inputs, for optional ones) have the
shapes of the batch's first request. A batch that reaches a preferred batch size leaves at
once; otherwise it waits until its oldest request waited ``max_queue_delay_microseconds``.
Queue policies reject requests whose queue timeout passed (``timeout_action: REJECT``) and
requests beyond ``max_queue_size``, with Triton's messages.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from pb_tensor.runtime._errors import InferenceError, RequestRefused
from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._scheduling._batch_policy import BatchPolicy
from pb_tensor.runtime._scheduling._instances import Instance, InstanceSet, Lease
from pb_tensor.runtime._scheduling._stats import Statistics
from pb_tensor.runtime._seam import TritonError
from pb_tensor.runtime._tracker import FINAL, Cancellation, Reply, cancelled_error

__all__ = ["DynamicBatcher", "Item", "RunBatch", "Sink", "gather_replies", "unloaded_error"]

class RunBatch(Protocol):
    """``run(instance, batch, timeout, cancels, returned, on_sent)``: the replies of one
    ``execute`` call; ``returned`` is called once a decoupled model's ``execute`` returned
    while replies may still come, ``on_sent`` once the batch is on its way to the model
    (before waiting for its replies)."""

    def __call__(
        self, instance: Instance, batch: list[RequestData], timeout: float | None,
        cancels: list[Cancellation | None], returned: Callable[[], None] | None,
        on_sent: Callable[[], None] | None = None, /,
    ) -> Iterable[Reply]: ...


Item = Reply | None | list[Reply | None]
"""What a caller's queue carries: a reply, None (the end of one of its requests), or a
request's replies and end together (a non-decoupled request's, handed over at once: one
hand-over, and one wake-up of its caller, per request)."""


class Sink(Protocol):
    """Where a request's replies go: ``put`` takes each item (see ``Item``) in the thread
    that ends its batch (a ``queue.SimpleQueue``, or what completes a future there)."""

    def put(self, item: Item, /) -> None: ...


# What the instance thread hands to the callers: each caller's queue and an item for it.
_Delivery = list[tuple[Sink, Item]]


_END = None


class Pending:
    """A request waiting in the queue, and where its replies go (its caller's queue, with
    the index the caller knows it by)."""

    __slots__ = ("cancel", "data", "deadline_ns", "failed", "out", "replies", "shape_key",
                 "size", "start_ns", "timeout", "where")  # fmt: skip

    def __init__(
        self, data: RequestData, where: int, size: int, shape_key: object, start_ns: int,
        deadline_ns: int, timeout: float | None, cancel: Cancellation, out: Sink,
    ) -> None:
        self.data = data
        self.where = where
        self.size = size
        self.shape_key = shape_key
        self.start_ns = start_ns
        self.deadline_ns = deadline_ns
        self.timeout = timeout
        self.cancel = cancel
        self.out = out
        self.failed = False
        # A non-decoupled request's replies while its batch runs (handed over at its end).
        self.replies: list[Reply | None] = []

    def end(self, error: InferenceError, stats: Statistics) -> None:
        """Leave the queue without running: ``error`` is the request's reply."""
        self.out.put([Reply(self.where, [], error, "{}", FINAL, False), _END])
        stats.failure(self.start_ns, time.monotonic_ns())


_Work = tuple[Instance, list[Pending]]


class DynamicBatcher:
    """The batcher of one loaded model: :meth:`submit` queues requests, a thread of its own
    forms batches whenever an instance is idle, and each batch runs in a thread that hands
    every reply to its request's caller."""

    def __init__(
        self, model_name: str, policy: BatchPolicy, instances: InstanceSet, run: RunBatch,
        stats: Statistics, decoupled: bool = False,
    ) -> None:
        self._name = model_name
        # A non-decoupled request ends when its batch ends (its caller reads until then):
        # its replies are handed over together, after the next batch left for the model.
        self._hold = not decoupled
        self._policy = policy
        self._instances = instances
        self._run = run
        self._stats = stats
        self._queues: list[deque[Pending]] = [deque() for _ in policy.levels]
        self._cond = threading.Condition(threading.Lock())
        # Threads waiting on the condition: a request queued with none of them notifies
        # nobody (Condition.notify_all costs Python-level work even then).
        self._waiting = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        # One thread per instance runs its batches (started on its first batch).
        self._workers: dict[int, queue.SimpleQueue[_Work | None]] = {}

    # -- callers ------------------------------------------------------------------------------
    def _batch_size(self, data: RequestData) -> int:
        if not self._policy.batching or not data.inputs:
            return 1
        shape = data.inputs[0].shape()
        return max(1, int(shape[0])) if shape else 1

    def _shape_key(self, data: RequestData) -> object:
        policy = self._policy
        if not policy.equal_shape and not policy.optional_inputs:
            return None
        skip = 1 if policy.batching else 0
        names = tuple(sorted(t.name() for t in data.inputs)) if policy.optional_inputs else ()
        shapes = tuple(sorted(
            (t.name(), tuple(t.shape()[skip:])) for t in data.inputs
            if t.name() in policy.equal_shape
        ))  # fmt: skip
        return names, shapes

    def submit(
        self, batch: list[RequestData], where: list[int], start_ns: int, timeout: float | None,
        cancel: Cancellation | None, priority: int = 0, *, here: bool = True,
    ) -> Iterator[Reply]:
        """Queue ``batch`` (its requests' indexes for the caller: ``where``); the replies
        of each, as they come, ending with each request's final one. ``here=False``: never
        run a batch in the calling thread (the replies are read in another).

        A cancelled ``cancel`` takes the requests out of the queue (Triton's CANCELLED
        error), or reaches the model when they already run."""
        out: queue.SimpleQueue[Item] = queue.SimpleQueue()
        # The caller waits for its replies anyway: a batch of its own requests that an idle
        # instance can take now runs in this thread (no hand-over to the instance's thread
        # and back: two thread wake-ups less per request for a caller alone, which cost a
        # third of a stub model's round trip). Decoupled batches keep the instance's thread
        # (the instance takes its next batch while this one's responses still come).
        cancels, work = self._enqueue(batch, where, start_ns, timeout, cancel, priority, out,
                                      here and self._hold)  # fmt: skip
        if work is not None:
            self._run_here(*work)
        return gather_replies(out, len(batch), cancels)

    def enqueue(
        self, batch: list[RequestData], where: list[int], start_ns: int, timeout: float | None,
        cancel: Cancellation | None, priority: int, out: Sink,
    ) -> list[Cancellation]:
        """Queue ``batch`` as :meth:`submit` does, its replies for ``out`` (what
        :func:`gather_replies` reads, from whichever thread ends each batch); the
        cancellation of each request."""
        return self._enqueue(batch, where, start_ns, timeout, cancel, priority, out, False)[0]

    def _enqueue(
        self, batch: list[RequestData], where: list[int], start_ns: int, timeout: float | None,
        cancel: Cancellation | None, priority: int, out: Sink, here: bool,
    ) -> tuple[list[Cancellation], _Work | None]:
        """:meth:`enqueue`, and (``here``) the batch for the calling thread to run when an
        idle instance took one made of these requests only."""
        level = self._policy.level_of(priority)
        level_policy = self._policy.levels[level]
        entries: list[Pending] = []
        for data, index in zip(batch, where):
            entry_cancel = cancel if cancel is not None else Cancellation()
            entries.append(Pending(
                data, index, self._batch_size(data), self._shape_key(data), start_ns,
                level_policy.deadline_ns(data, start_ns), timeout, entry_cancel, out,
            ))  # fmt: skip
        with self._cond:
            if self._closed:
                error = unloaded_error(self._name, refused=True)
                for entry in entries:
                    entry.end(error, self._stats)
                entries = []
            lane = self._queues[level]
            for entry in entries:
                if level_policy.max_queue_size and len(lane) >= level_policy.max_queue_size:
                    entry.end(RequestRefused(
                        f"[request id: {entry.data.request_id or '<id_unknown>'}] Exceeds "
                        "maximum queue size", TritonError.UNAVAILABLE,
                    ), self._stats)  # fmt: skip
                else:
                    lane.append(entry)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._loop, name=f"pb-tensor-batcher-{self._name}", daemon=True
                )
                self._thread.start()
            # The batcher's thread waits (for a request, or a batch's queue delay): an idle
            # instance takes the batch now, from this thread, rather than after that thread
            # woke (one thread wake-up less per request when requests come one at a time).
            work: _Work | None = None
            if self._waiting:
                went = False
                if not self._closed:
                    went, work = self._dispatch(out if here else None)
                if self._closed or not went or any(self._queues):
                    self._cond.notify_all()
        return [e.cancel for e in entries], work

    def _dispatch(self, own: Sink | None) -> tuple[bool, _Work | None]:
        """Hand the queue's next batch to an idle instance's thread now, as the batcher's
        thread does once it has the instance, or, when every request of it goes to ``own``,
        give it back for the calling thread to run; whether one went (called with the
        condition held)."""
        instance = self._instances.try_acquire(owner=0)
        if instance is None:
            return False, None
        batch = self._form(wait=False)
        if not batch:
            self._instances.release(instance)
            return False, None
        if own is not None and all(e.out is own for e in batch):
            return True, (instance, batch)
        self._hand(instance, batch)
        return True, None

    def _run_here(self, instance: Instance, batch: list[Pending]) -> None:
        """Run ``batch`` (the calling thread's own requests, not decoupled) on ``instance``
        in this thread, then hand the instance its next batch, if one can leave now, in the
        instance's thread (else release it)."""
        lease = Lease(self._instances, instance)
        held: _Delivery = []
        handed = False
        try:
            self._execute(instance, batch, lease, [], held)
            del batch  # (the caller's data is not kept while the next batch runs)
            with self._cond:
                if (not self._closed and any(self._queues)
                        and not self._instances.retiring(instance)):  # fmt: skip
                    following = self._form(wait=False)
                    if following:
                        self._hand(instance, following)
                        handed = True
        finally:
            _deliver(held)
            if not handed:
                lease.end()

    def close(self) -> None:
        """Fail every queued request (the model is unloading) and stop forming batches."""
        with self._cond:
            self._closed = True
            entries = [e for lane in self._queues for e in lane]
            for lane in self._queues:
                lane.clear()
            self._cond.notify_all()
            for work in self._workers.values():
                work.put(None)  # after the batches it holds
        error = unloaded_error(self._name, refused=False)
        for entry in entries:
            entry.end(error, self._stats)

    # -- the batcher's thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not any(self._queues):
                    self._wait(None)
                if self._closed:
                    return
            try:
                # Owner 0 (no thread): the instance waits for its batch, which runs in the
                # instance's own thread (that then owns it).
                instance = self._instances.acquire(owner=0)
            except InferenceError:  # unreachable: no instance is this thread's
                instance = None
            if instance is None:
                self.close()
                return
            with self._cond:
                batch = self._form()
                if batch:
                    self._hand(instance, batch)
                    # Not kept while this thread waits: the batch holds its requests' data.
                    del batch
                    continue
            self._instances.release(instance)

    def _wait(self, timeout: float | None) -> None:
        """Wait on the condition (held), counted in ``_waiting``."""
        self._waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def _hand(self, instance: Instance, batch: list[Pending]) -> None:
        """Give ``batch`` to ``instance``'s thread (called with the condition held). The
        instance is nobody's until that thread runs it (owner 0): a caller that ran its own
        batch on it and hands it over must not look like its user, or its next request
        would wait in the self-wait check until a release or the grace period's end."""
        instance.owner = 0
        self._worker(instance).put((instance, batch))

    def _worker(self, instance: Instance) -> queue.SimpleQueue[_Work | None]:
        """The queue of ``instance``'s thread (called with the condition held)."""
        work = self._workers.get(id(instance))
        if work is None:
            work = self._workers[id(instance)] = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(work,), daemon=True,
                             name=f"pb-tensor-batch-{instance.name}").start()  # fmt: skip
        return work

    def _work(self, work: queue.SimpleQueue[_Work | None]) -> None:
        while True:
            item = work.get()
            if item is None:
                return
            instance, batch = item
            del item  # (not kept while this thread waits for its next batch)
            previous: _Delivery = []
            held: _Delivery = []
            lease: Lease | None = None
            try:
                while batch:
                    previous, held = held, []
                    lease = Lease(self._instances, instance)
                    if self._execute(instance, batch, lease, previous, held):
                        return  # detached: this thread ends with its batch
                    # The batch ended with the instance still this thread's: it forms the
                    # next batch itself when one is ready (no hand-off to the batcher's
                    # thread and back); one that must wait for the queue delay is left to
                    # the batcher's thread.
                    batch = self._ready(instance)
            finally:
                _deliver(previous)  # delivered already, unless the engine's run raised early
                _deliver(held)
                if lease is not None:
                    lease.end()  # releases the instance (nothing if the batch detached)

    def _ready(self, instance: Instance) -> list[Pending]:
        """The next batch for ``instance`` when one can leave the queue now, else nothing
        (always nothing for an instance an update removed)."""
        with self._cond:
            if self._closed or not any(self._queues) or self._instances.retiring(instance):
                return []
            return self._form(wait=False)

    def retire(self, instance: Instance) -> None:
        """An update removed ``instance``: its thread ends after the batch it runs (if any),
        and a batch formed from now on goes to another instance."""
        with self._cond:
            work = self._workers.pop(id(instance), None)
            if work is not None:
                work.put(None)

    def _expire(self, now_ns: int) -> None:
        """Drop cancelled requests and reject timed-out ones (``ApplyPolicyAtCursor``)."""
        for level, lane in enumerate(self._queues):
            if not lane:
                continue
            reject = self._policy.levels[level].reject
            if not any(e.cancel.cancelled or (reject and e.deadline_ns and now_ns >= e.deadline_ns)
                       for e in lane):  # fmt: skip
                continue  # the usual case: nothing leaves, the lane stays as it is
            kept: deque[Pending] = deque()
            for entry in lane:
                if entry.cancel.cancelled:
                    entry.end(cancelled_error(), self._stats)
                elif reject and entry.deadline_ns and now_ns >= entry.deadline_ns:
                    entry.end(InferenceError("Request timeout expired",
                                             TritonError.UNAVAILABLE), self._stats)  # fmt: skip
                else:
                    kept.append(entry)
            self._queues[level] = kept

    def _form(self, wait: bool = True) -> list[Pending]:
        """The next batch (``GetDynamicBatch``), waiting for the queue delay as long as it
        asks (``wait=False``: nothing instead of waiting); called with the condition held."""
        policy = self._policy
        while not self._closed:
            now = time.monotonic_ns()
            self._expire(now)
            ordered = [e for lane in self._queues for e in lane]
            if not ordered:
                return []
            pending = 0
            count = 0
            best = 0
            best_count = 0
            send_now = False
            key = ordered[0].shape_key
            for count, entry in enumerate(ordered):
                if count:
                    total = pending + entry.size
                    if total > policy.max_preferred and best == 0:
                        best, best_count = pending, count
                    if total > policy.max_batch_size or entry.shape_key != key:
                        send_now = True
                        break
                pending += entry.size
                if pending in policy.preferred:
                    best, best_count = pending, count + 1
            else:
                count = len(ordered)
            oldest = min(e.start_ns for e in ordered)
            exceeded = policy.delay_ns != 0 and now - oldest >= policy.delay_ns
            if best and not exceeded:
                count = best_count
            elif not (send_now or pending >= policy.max_preferred or exceeded
                      or policy.delay_ns == 0):
                if not wait:
                    return []
                wait_ns = policy.delay_ns - (now - oldest)
                deadlines = [e.deadline_ns for e in ordered if e.deadline_ns]
                if deadlines:
                    wait_ns = min(wait_ns, max(1000, min(deadlines) - now))
                self._wait(wait_ns / 1e9)
                continue
            return self._take(ordered[:count])
        return []

    def _take(self, batch: list[Pending]) -> list[Pending]:
        """Take ``batch`` out of the queue: it is the head of the lanes in level order (what
        ``_form`` orders and cuts)."""
        left = len(batch)
        for lane in self._queues:
            if not left:
                break
            n = min(left, len(lane))
            for _ in range(n):
                lane.popleft()
            left -= n
        return batch

    def _execute(
        self, instance: Instance, batch: list[Pending], lease: Lease, previous: _Delivery,
        held: _Delivery,
    ) -> bool:
        """Run ``batch`` on ``instance`` and hand each reply to its caller: as it comes
        (decoupled), or into ``held`` for the calling thread to deliver. ``previous`` (the
        previous batch's replies) goes to its callers once this batch is on its way, so that
        waking them overlaps with the model's work. Once a decoupled model's ``execute``
        returned, the instance takes its next batch (as in Triton), run by a new thread of
        the instance, while this one reads the rest of this batch's replies; True then (this
        thread ends with the batch, and ``lease`` with it)."""
        instance.owner = threading.get_ident()
        exec_start = time.monotonic_ns()
        timeouts = [e.timeout for e in batch]
        timeout = None if None in timeouts else max(t for t in timeouts if t is not None)
        detached: list[bool] = []

        def returned() -> None:
            with self._cond:  # the instance's next batches go to a new thread
                if not detached and self._workers.get(id(instance)) is not None:
                    del self._workers[id(instance)]
                detached.append(True)
            lease.returned()

        def flush() -> None:
            _deliver(previous)

        hold = self._hold
        try:
            for reply in self._run(instance, [e.data for e in batch], timeout,
                                   [e.cancel for e in batch], returned, flush):  # fmt: skip
                entry = batch[reply.index]
                if reply.error is not None:
                    entry.failed = True
                reply.index = entry.where
                if hold:
                    entry.replies.append(reply)
                else:
                    entry.out.put(reply)
        except Exception as exc:  # the engine itself failed: every request fails with it
            self._failed(batch, exc)
        flush()
        self._ended(batch, exec_start, held if self._hold else None)
        if detached:
            lease.end()
        return bool(detached)

    def _failed(self, batch: list[Pending], exc: Exception) -> None:
        error = exc if isinstance(exc, InferenceError) else InferenceError(
            f"Failed to process the request(s) for model '{self._name}', message: {exc}",
            TritonError.INTERNAL,
        )
        for entry in batch:
            entry.failed = True
            reply = Reply(entry.where, [], error, "{}", FINAL, False)
            if self._hold:
                entry.replies.append(reply)
            else:
                entry.out.put(reply)

    def _ended(self, batch: list[Pending], exec_start: int, held: _Delivery | None) -> None:
        """Record the batch's statistics and end each request: its end goes to its caller
        now, or (``held``) with its replies, as one item."""
        end = time.monotonic_ns()
        self._stats.batch(exec_start, end, [(e.size, e.start_ns, e.failed) for e in batch])
        for entry in batch:
            if held is None:
                entry.out.put(_END)
            else:
                replies = entry.replies
                replies.append(_END)
                entry.replies = []
                held.append((entry.out, replies))


def _deliver(delivery: _Delivery) -> None:
    """Put each reply on its caller's queue, emptying ``delivery`` (each goes once)."""
    delivery.reverse()
    while delivery:
        out, reply = delivery.pop()
        out.put(reply)


def unloaded_error(name: str, *, refused: bool) -> InferenceError:
    """What a request to a model that was unloaded gets (Triton's text): ``refused`` when it
    was submitted (a ``RequestRefused``), else while it waited in a queue."""
    kind = RequestRefused if refused else InferenceError
    return kind(f"Request for unknown model: '{name}' is not found", TritonError.INVALID_ARG)


def gather_replies(
    out: queue.SimpleQueue[Item] | queue.SimpleQueue[Reply | None], count: int,
    cancels: list[Cancellation],
) -> Iterator[Reply]:
    """The replies a batcher's instance thread puts on ``out`` for ``count`` requests (each
    ends with a ``None``; a list carries a request's replies and its end at once), for the
    caller to read; a caller that stops reading early cancels what still runs."""
    ended = 0
    try:
        while ended < count:
            item = out.get()
            if item is None:
                ended += 1
            elif isinstance(item, list):
                for reply in item:
                    if reply is None:
                        ended += 1
                    else:
                        yield reply
            else:
                yield item
    finally:
        if ended < count:  # the caller stopped reading: cancel what still runs
            for c in cancels:
                c.cancel()
