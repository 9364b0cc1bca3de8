"""Triton's sequence batcher (core's ``sequence_batch_scheduler/``): the requests of a
sequence (one correlation id, from its START request to its END request) all run on the
instance whose sequence slot the sequence got, one request of a sequence per ``execute``
call, in order; the control inputs the configuration names (START, END, READY, CORRID) are
added to each request.

Each instance has ``max_batch_size`` slots (Direct; one for a model that does not batch) or
``max_candidate_sequences`` slots (Oldest). A sequence without a free slot waits in the
backlog until one frees. A batch leaves for its instance when it holds ``max_batch_size``
requests (or a preferred batch size, Oldest) or when its oldest request waited the
strategy's ``max_queue_delay_microseconds``. A sequence that gets no request for
``max_sequence_idle_microseconds`` loses its slot (a later request without START is refused).
With ``iterative_sequence``, a request without a correlation id starts a sequence of its own
that ends when the model releases the request without the RESCHEDULE flag; a rescheduled
request runs again in a later batch.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from pb_tensor import Tensor
from pb_tensor.runtime._errors import InferenceError, RequestRefused
from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._scheduling._batcher import gather_replies, unloaded_error
from pb_tensor.runtime._scheduling._instances import Instance, InstanceSet
from pb_tensor.runtime._scheduling._sequence_policy import SequencePolicy
from pb_tensor.runtime._scheduling._stats import Statistics
from pb_tensor.runtime._seam import TritonError
from pb_tensor.runtime._tracker import FINAL, Cancellation, Reply, cancelled_error

__all__ = ["SequenceBatcher"]

log = logging.getLogger("pb_tensor.runtime")

_START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
_END = 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_END

RunBatch = Callable[[Instance, list[RequestData], float | None, list[Cancellation | None]],
                    Iterable[Reply]]


class _Pending:
    """A request waiting in its sequence's queue, and where its replies go."""

    __slots__ = ("cancel", "data", "failed", "out", "start_ns", "timeout", "where")

    def __init__(self, data: RequestData, where: int, start_ns: int, timeout: float | None,
                 cancel: Cancellation, out: queue.SimpleQueue[Reply | None]) -> None:  # fmt: skip
        self.data = data
        self.where = where
        self.start_ns = start_ns
        self.timeout = timeout
        self.cancel = cancel
        self.out = out
        self.failed = False

    def end(self, error: InferenceError, stats: Statistics) -> None:
        self.out.put(Reply(self.where, [], error, "{}", FINAL, False))
        self.out.put(None)
        stats.failure(self.start_ns, time.monotonic_ns())


class _Sequence:
    """A sequence: its slot's instance (None while in the backlog) and its queued requests."""

    __slots__ = ("corrid", "ending", "expires_ns", "in_flight", "instance", "last_ns", "queue",
                 "slot")  # fmt: skip

    def __init__(self, corrid: int | str, now: int) -> None:
        self.corrid = corrid
        self.instance: int | None = None
        self.slot = 0  # its slot's index on the instance (Direct batches keep it)
        self.queue: deque[_Pending] = deque()
        self.in_flight = False
        self.ending = False  # its END request was queued: no request joins it any more
        self.last_ns = now
        self.expires_ns = 0  # in the backlog: when its requests' timeout expires (0: never)


class SequenceBatcher:
    """The sequence batcher of one loaded model: :meth:`submit` routes requests to their
    sequence's slot; a thread per instance forms and runs that instance's batches."""

    def __init__(self, model_name: str, policy: SequencePolicy, instances: InstanceSet,
                 run: RunBatch, stats: Statistics) -> None:  # fmt: skip
        self._name = model_name
        self._policy = policy
        self._instances = instances
        self._all = instances.instances
        self._run = run
        self._stats = stats
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._active: dict[int | str, _Sequence] = {}  # correlation id -> running sequence
        self._slotted: list[list[_Sequence]] = [[] for _ in self._all]
        self._backlog: deque[_Sequence] = deque()
        self._next_id = 1  # iterative sequences' own correlation ids
        self._threads: list[threading.Thread] = []
        # Indexes of the instances an update removed: they take no new sequence, and each
        # goes to ``_retire`` (with its thread) once its last sequence ended.
        self._retired: set[int] = set()
        self._retire: Callable[[Instance], None] | None = None

    # -- callers ------------------------------------------------------------------------------
    def _refusal(self, data: RequestData) -> InferenceError | None:
        """Triton's error for a request this batcher refuses (``Enqueue``'s checks)."""
        policy = self._policy
        corrid_type = policy.corrid_type
        corrid = data.correlation_id
        if corrid_type is not None:
            mismatch = None
            if isinstance(corrid, str) and corrid_type != "TYPE_STRING":
                mismatch = "BYTES"
            elif isinstance(corrid, int) and corrid_type not in (
                "TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32"
            ):
                mismatch = "UINT64"
            if mismatch is not None:
                name = next(c.name for c in policy.controls
                            if c.kind == "CONTROL_SEQUENCE_CORRID")  # fmt: skip
                expects = "BYTES" if corrid_type == "TYPE_STRING" else corrid_type[5:]
                return RequestRefused(
                    f"[request id: {data.request_id or '<id_unknown>'}] sequence batching "
                    f"control '{name}' data-type is '{mismatch}', but model '{self._name}' "
                    f"expects '{expects}'", TritonError.INVALID_ARG,
                )  # fmt: skip
        if policy.batching and data.inputs:
            shape = data.inputs[0].shape()
            if shape and int(shape[0]) > 1:
                return RequestRefused(
                    f"inference request to model '{self._name}' must specify batch-size 1 "
                    "due to requirements of sequence batcher", TritonError.INVALID_ARG,
                )  # fmt: skip
        if corrid in (0, "") and not policy.iterative:
            return RequestRefused(
                f"inference request to model '{self._name}' must specify a non-zero or "
                "non-empty correlation ID", TritonError.INVALID_ARG,
            )  # fmt: skip
        return None

    def submit(
        self, batch: list[RequestData], where: list[int], start_ns: int, timeout: float | None,
        cancel: Cancellation | None,
    ) -> Iterator[Reply]:
        """Queue each request of ``batch`` in its sequence (its caller's indexes: ``where``);
        the replies of each, as they come, ending with each request's final one."""
        out: queue.SimpleQueue[Reply | None] = queue.SimpleQueue()
        cancels: list[Cancellation] = []
        queued: list[_Pending] = []
        with self._cond:
            for data, index in zip(batch, where):
                entry = _Pending(data, index, start_ns, timeout,
                                 cancel if cancel is not None else Cancellation(), out)  # fmt: skip
                cancels.append(entry.cancel)
                if self._closed:
                    entry.end(unloaded_error(self._name, refused=True), self._stats)
                    continue
                refusal = self._refusal(data)
                if refusal is None:
                    refusal = self._enqueue(entry)
                if refusal is not None:
                    entry.end(refusal, self._stats)
                else:
                    queued.append(entry)
            self._start_threads()
            self._cond.notify_all()
        for entry in queued:  # outside the lock: a cancelled one calls back at once
            entry.cancel.subscribe(functools.partial(self._cancelled, entry))
        return gather_replies(out, len(batch), cancels)

    def _cancelled(self, entry: _Pending) -> None:
        """``entry`` was cancelled: if it still waits, its sequence ends (Triton releases
        the slot of a sequence whose next request is cancelled and cancels the rest of its
        queued requests); a request already running sees the cancellation itself."""
        with self._cond:
            sequence = next((s for s in list(self._active.values()) + list(self._backlog)
                             + [q for slots in self._slotted for q in slots]
                             if entry in s.queue), None)  # fmt: skip
            if sequence is None:
                return
            for queued in sequence.queue:
                queued.end(cancelled_error(), self._stats)
            sequence.queue.clear()
            sequence.ending = True
            if self._active.get(sequence.corrid) is sequence:
                del self._active[sequence.corrid]
            if not sequence.in_flight:
                self._release(sequence)
            self._cond.notify_all()

    def _enqueue(self, entry: _Pending) -> InferenceError | None:
        """Put ``entry`` in its sequence (called with the condition held); Triton's error
        for a request that does not start a sequence it belongs to."""
        data = entry.data
        now = time.monotonic_ns()
        self._reap(now)
        if data.correlation_id in (0, ""):  # iterative: a sequence of its own
            data.correlation_id = self._next_id
            data.flags = _START
            self._next_id += 1
        corrid = data.correlation_id
        sequence = self._active.get(corrid)
        if sequence is None:
            if not data.flags & _START:
                return RequestRefused(
                    f"inference request for sequence {corrid} to model '{self._name}' must "
                    "specify the START flag on the first request of the sequence",
                    TritonError.INVALID_ARG,
                )
            sequence = self._active[corrid] = _Sequence(corrid, now)
            self._place(sequence)
        elif data.flags & _START:
            log.warning(
                "sequence %s for model '%s' has a conflict. The previous sequence did not end "
                "before this sequence start. Previous sequence will be terminated early.",
                corrid, self._name,
            )
        sequence.last_ns = now
        sequence.queue.append(entry)
        if sequence.instance is None and data.timeout_us:  # a backlog honours the timeout
            expires = now + data.timeout_us * 1000
            sequence.expires_ns = min(sequence.expires_ns or expires, expires)
        if data.flags & _END and not self._policy.iterative:
            sequence.ending = True
            del self._active[corrid]
        return None

    def update(self, added: list[Instance], removed: list[Instance],
               retire: Callable[[Instance], None]) -> list[Instance]:  # fmt: skip
        """An instance update (core's ``SequenceBatchScheduler::Update``): ``added`` take
        sequences from now on; of ``removed``, those without a sequence are given back now,
        the others keep theirs until each ended and then go to ``retire``."""
        now: list[Instance] = []
        with self._cond:
            self._retire = retire
            for instance in removed:
                index = next(i for i, known in enumerate(self._all) if known is instance)
                self._retired.add(index)
                if not self._slotted[index]:
                    now.append(instance)
            for instance in added:
                self._all.append(instance)
                self._slotted.append([])
                if self._threads:
                    self._start_thread(len(self._all) - 1)
            while self._backlog and self._has_free_slot():
                self._place(self._backlog.popleft())
            self._cond.notify_all()
        return now

    def _has_free_slot(self) -> bool:
        return any(len(s) < self._policy.slots for i, s in enumerate(self._slotted)
                   if i not in self._retired)  # fmt: skip

    def _place(self, sequence: _Sequence) -> None:
        """Give ``sequence`` a free slot (the instance with the most free slots, of those
        no update removed), else put it in the backlog."""
        free = [-1 if i in self._retired else self._policy.slots - len(s)
                for i, s in enumerate(self._slotted)]  # fmt: skip
        best = max(range(len(free)), key=lambda i: (free[i], -i))
        if free[best] > 0:
            used = {s.slot for s in self._slotted[best]}
            sequence.slot = min(i for i in range(self._policy.slots) if i not in used)
            sequence.expires_ns = 0
            sequence.instance = best
            self._slotted[best].append(sequence)
        else:
            self._backlog.append(sequence)

    def _release(self, sequence: _Sequence) -> None:
        """``sequence`` ended: free its slot for the oldest sequence in the backlog."""
        if self._active.get(sequence.corrid) is sequence:
            del self._active[sequence.corrid]
        if sequence.instance is None:
            if sequence in self._backlog:
                self._backlog.remove(sequence)
            return
        index = sequence.instance
        self._slotted[index].remove(sequence)
        sequence.instance = None
        if index in self._retired:
            if not self._slotted[index] and self._retire is not None:
                # (its thread ends at its next look at the queue; the instance goes once the
                # batch that ended the sequence released it)
                self._retire(self._all[index])
        elif self._backlog:
            self._place(self._backlog.popleft())
        self._cond.notify_all()

    def _reap(self, now: int) -> None:  # Triton's reaper: a backlog's timeout every 50 ms
        """End the sequences that got no request for ``max_sequence_idle_microseconds``
        (their slot is released once the requests they hold ran, as Triton's reaper
        enqueues a release behind them), and fail the requests of sequences whose timeout
        expired in the backlog; called with the condition held."""
        for sequence in list(self._backlog):
            if sequence.expires_ns and now >= sequence.expires_ns:
                self._backlog.remove(sequence)
                if self._active.get(sequence.corrid) is sequence:
                    del self._active[sequence.corrid]
                for entry in sequence.queue:
                    entry.end(InferenceError(
                        "timeout of the corresponding sequence has been expired",
                        TritonError.UNAVAILABLE), self._stats)  # fmt: skip
                sequence.queue.clear()
        for slots in self._slotted:
            for sequence in list(slots):
                if sequence.ending or now - sequence.last_ns < self._policy.idle_ns:
                    continue
                log.info("sequence %s of model '%s' got no request for "
                         "max_sequence_idle_microseconds: its slot is released",
                         sequence.corrid, self._name)  # fmt: skip
                sequence.ending = True
                if self._active.get(sequence.corrid) is sequence:
                    del self._active[sequence.corrid]
                if not sequence.queue and not sequence.in_flight:
                    self._release(sequence)

    def close(self) -> None:
        """Fail every queued request (the model is unloading) and stop the threads."""
        with self._cond:
            self._closed = True
            entries = [e for s in self._active.values() for e in s.queue]
            entries += [e for slots in self._slotted for s in slots for e in s.queue
                        if s.ending]  # fmt: skip
            entries += [e for s in self._backlog if s.ending for e in s.queue]
            for sequence in list(self._active.values()) + list(self._backlog):
                sequence.queue.clear()
            for slots in self._slotted:
                for sequence in slots:
                    sequence.queue.clear()
            self._cond.notify_all()
        error = unloaded_error(self._name, refused=False)
        for entry in entries:
            entry.end(error, self._stats)

    # -- the instances' threads ---------------------------------------------------------------
    def _start_threads(self) -> None:
        if self._threads or self._closed:
            return
        for index in range(len(self._all)):
            if index not in self._retired:
                self._start_thread(index)

    def _start_thread(self, index: int) -> None:
        thread = threading.Thread(target=self._loop, args=(index,), daemon=True,
                                  name=f"pb-tensor-sequence-{self._all[index].name}")  # fmt: skip
        self._threads.append(thread)
        thread.start()

    def _form(self, index: int) -> list[tuple[_Sequence, _Pending] | None]:
        """The next batch of instance ``index`` (one request per sequence: oldest first, or,
        Direct, in slot order with None for each empty slot below the last one used: a
        null request), waiting for the queue delay as long as it asks; called with the
        condition held."""
        policy = self._policy
        while not self._closed:
            if index in self._retired and not self._slotted[index]:
                return []  # an update removed the instance and its last sequence ended
            now = time.monotonic_ns()
            self._reap(now)
            ready: list[tuple[_Sequence, _Pending]] = []
            for sequence in self._slotted[index]:
                while sequence.queue and sequence.queue[0].cancel.cancelled:
                    sequence.queue.popleft().end(cancelled_error(), self._stats)
                if sequence.queue and not sequence.in_flight:
                    ready.append((sequence, sequence.queue[0]))
            if not ready:
                longest = 50_000_000 if any(s.expires_ns for s in self._backlog) else 10**9
                self._cond.wait(min(policy.idle_ns, longest) / 1e9)
                continue
            ready.sort(key=lambda pair: pair[1].start_ns)
            if policy.equal_shape:  # the first request's shapes decide (RequiredEqualInputs)
                key = self._shape_key(ready[0][1].data)
                same = [self._shape_key(pair[1].data) == key for pair in ready]
                if policy.oldest:  # the dynamic batcher stops at the first other shape
                    ready = ready[: same.index(False)] if False in same else ready
                else:  # Direct gives the slot a null request instead
                    ready = [pair for pair, ok in zip(ready, same) if ok]
            ready = ready[: policy.max_batch]
            oldest = min(pair[1].start_ns for pair in ready)
            if policy.oldest:
                full = len(ready) >= policy.max_batch or len(ready) in policy.preferred
            else:
                full = (policy.min_utilization == 0.0
                        or len(ready) / policy.max_batch >= policy.min_utilization)  # fmt: skip
            if not full and policy.delay_ns and now - oldest < policy.delay_ns:
                self._cond.wait((policy.delay_ns - (now - oldest)) / 1e9)
                continue
            for sequence, _ in ready:
                sequence.queue.popleft()
                sequence.in_flight = True
            if policy.oldest:
                return list(ready)
            by_slot = {pair[0].slot: pair for pair in ready}
            return [by_slot.get(i) for i in range(max(by_slot) + 1)]
        return []

    def _shape_key(self, data: RequestData) -> object:
        return sorted((t.name(), tuple(t.shape())) for t in data.inputs
                      if t.name() in self._policy.equal_shape)  # fmt: skip

    def _loop(self, index: int) -> None:
        instance = self._all[index]
        while True:
            with self._cond:
                batch = self._form(index)
            if not batch:
                return
            held = self._instances.hold(instance)
            if held is None:
                with self._cond:
                    for sequence, entry in filter(None, batch):
                        sequence.in_flight = False
                        entry.end(unloaded_error(self._name, refused=False), self._stats)
                return
            try:
                self._execute(instance, batch)
            finally:
                if held:
                    self._instances.release(instance)

    def _controls(self, data: RequestData, ready: bool = True) -> list[Tensor]:
        shape = (1, 1) if self._policy.batching else (1,)
        tensors = []
        for control in self._policy.controls:
            if control.kind == "CONTROL_SEQUENCE_CORRID":
                corrid = data.correlation_id if ready else (
                    "" if control.dtype is np.object_ else 0)
                value = np.full(shape, corrid, dtype=control.dtype)
            else:
                on = {"CONTROL_SEQUENCE_START": bool(data.flags & _START),
                      "CONTROL_SEQUENCE_END": bool(data.flags & _END),
                      "CONTROL_SEQUENCE_READY": ready}.get(control.kind, False)  # fmt: skip
                value = np.full(shape, control.values[1 if on else 0], dtype=control.dtype)
            tensors.append(Tensor(control.name, value))
        return tensors

    def _execute(self, instance: Instance,
                 slots: list[tuple[_Sequence, _Pending] | None]) -> None:  # fmt: skip
        """Run a batch on ``instance``; hand each reply to its caller (those of null
        requests to nobody), requeue the requests an iterative sequence rescheduled, and
        free the slots of sequences that ended."""
        exec_start = time.monotonic_ns()
        batch = [pair for pair in slots if pair is not None]
        model = batch[0][1].data
        sent = []
        for pair in slots:
            if pair is None:  # CopyAsNull: the first request's inputs, zeroed, not ready
                null = RequestData([_null(t) for t in model.inputs], model.requested_outputs)
                sent.append(RequestData(null.inputs + self._controls(null, False),
                                        null.requested_outputs, validated=True))  # fmt: skip
                continue
            data = pair[1].data
            controls = self._controls(data)
            sent.append(RequestData(
                data.inputs + controls, data.requested_outputs, data.request_id,
                data.correlation_id, data.flags, data.parameters, data.timeout_us, True,
                None if data.pooled is None else data.pooled + controls,
            ))  # fmt: skip
        timeouts = [e.timeout for _, e in batch]
        timeout = None if None in timeouts else max(t for t in timeouts if t is not None)
        cancels = [None if pair is None else pair[1].cancel for pair in slots]
        again: set[int] = set()
        try:
            for reply in self._run(instance, sent, timeout, cancels):
                pair = slots[reply.index]
                if pair is None:
                    continue
                entry = pair[1]
                if reply.rescheduled and self._policy.iterative:
                    again.add(reply.index)
                    continue
                if reply.error is not None:
                    entry.failed = True
                reply.index = entry.where
                entry.out.put(reply)
        except Exception as exc:  # the engine itself failed: every request fails with it
            error = exc if isinstance(exc, InferenceError) else InferenceError(
                f"Failed to process the request(s) for model '{self._name}', message: {exc}",
                TritonError.INTERNAL,
            )
            for _, entry in batch:
                entry.failed = True
                entry.out.put(Reply(entry.where, [], error, "{}", FINAL, False))
        end = time.monotonic_ns()
        self._stats.execution(len(batch), exec_start, exec_start, end, end)
        with self._cond:
            for i, pair in enumerate(slots):
                if pair is None:
                    continue
                sequence, entry = pair
                sequence.in_flight = False
                if i in again:
                    entry.data.flags = 0  # IterativeSequencer: neither START nor END
                    sequence.last_ns = end  # enqueued again
                    sequence.queue.appendleft(entry)
                    continue
                if entry.failed:
                    self._stats.failure(entry.start_ns, end)
                else:
                    self._stats.success(1, entry.start_ns, exec_start, exec_start, end, end, end)
                entry.out.put(None)
                if self._policy.iterative or (sequence.ending and not sequence.queue):
                    self._release(sequence)
            self._cond.notify_all()


def _null(tensor: Tensor) -> Tensor:
    """A null request's input: ``tensor``'s name, type and shape, zero data (empty strings
    for BYTES)."""
    array = tensor.as_numpy()
    if array.dtype == np.object_:
        return Tensor(tensor.name(), np.full(array.shape, b"", dtype=np.object_))
    return Tensor(tensor.name(), np.zeros_like(array))
