"""How a loaded model runs its validated requests: on an idle instance one call at a time
(Triton's default scheduler), through the dynamic batcher, or through the sequence batcher;
recording the statistics of each."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pb_tensor.runtime._engines import Cancels
from pb_tensor.runtime._errors import InferenceError
from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._scheduling._batch_policy import batch_policy, one_at_a_time
from pb_tensor.runtime._scheduling._batcher import DynamicBatcher, Sink, unloaded_error
from pb_tensor.runtime._scheduling._instances import Instance, InstanceSet, Lease
from pb_tensor.runtime._scheduling._sequence import SequenceBatcher
from pb_tensor.runtime._scheduling._sequence_policy import sequence_policy
from pb_tensor.runtime._scheduling._stats import Statistics
from pb_tensor.runtime._tracker import FINAL, Cancellation, Reply, cancelled_error, serving_bls_here

__all__ = ["Scheduler", "unloaded_error"]


def _ended(where: list[int], error: InferenceError) -> list[Reply]:
    return [Reply(i, [], error, "{}", FINAL, False) for i in where]


class Scheduler:
    """The instances of one loaded model, its dynamic batcher (when configured) and its
    statistics."""

    def __init__(
        self, name: str, config: dict[str, Any], instances: list[Instance], eager: bool,
        decoupled: bool = False,
    ) -> None:
        self.name = name
        self.stats = Statistics()
        self.instances = InstanceSet(name, instances)
        self._batching = int(config.get("max_batch_size", 0) or 0) > 0
        # Replies are complete when the engine's run returns (in-process, not decoupled):
        # they need no generator holding the instance between them.
        self._eager = eager
        policy = batch_policy(config)
        self.batcher = None if policy is None else DynamicBatcher(
            name, policy, self.instances, self._run_batch, self.stats, decoupled
        )
        sequence = sequence_policy(config)
        self.sequencer = None if sequence is None else SequenceBatcher(
            name, sequence, self.instances, self._run_batch, self.stats
        )
        # Triton's default scheduler (neither batcher): requests wait in one queue and each
        # idle instance takes the next, one per execute. With stub processes the instance's
        # own thread takes them, sends each to its stub and hands the replies over, where
        # otherwise every caller's thread would wait for the instance and do that itself:
        # a queued request needs no thread of its own while it waits (infer_async, and so
        # serve; a blocking caller that finds the instance idle and nobody queued runs its
        # request itself: DynamicBatcher.submit). In-process models keep
        # running on the caller's thread, decoupled ones their lazy path (a request with
        # more than one per call, infer_many's, runs as one execute as before).
        self.solo = None if (policy is not None or sequence is not None or eager
                             or decoupled) else DynamicBatcher(
            name, one_at_a_time(config), self.instances, self._run_batch, self.stats
        )  # fmt: skip

    def batch_size(self, data: RequestData) -> int:
        """A request's batch size as Triton counts it (first dimension, or 1)."""
        if not self._batching or not data.inputs:
            return 1
        shape = data.inputs[0].shape()
        return max(1, int(shape[0])) if shape else 1

    @staticmethod
    def _run_batch(
        instance: Instance, batch: list[RequestData], timeout: float | None, cancel: Cancels,
        returned: Callable[[], None] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> Iterable[Reply]:
        return instance.engine.run(batch, timeout, cancel, returned, on_sent)

    def queues(self, count: int = 1) -> bool:
        """Whether :meth:`run` puts ``count`` requests of the calling thread in a queue (the
        sequence batcher's, a dynamic batcher's, a stub model's default scheduler's) rather
        than running them in that thread."""
        return self.sequencer is not None or (
            self.batcher if self._own_thread(count) else self.solo) is not None

    def run(
        self, valid: list[RequestData], where: list[int], timeout: float | None,
        cancel: Cancellation | None, start_ns: int, priority: int = 0, *,
        queued: bool = False,
    ) -> Iterable[Reply]:
        """The replies of ``valid`` (their caller's indexes: ``where``): a list when they
        are complete already, else an iterator that runs them on first ``next``.

        ``queued`` (where :meth:`queues`): put them in the queue now and leave them there,
        whatever thread reads the replies (a batcher runs a batch it could run at once in
        the calling thread otherwise): requests queued one after the other from one thread
        keep that order, as Triton's front ends keep a stream's."""
        if self.sequencer is not None:
            return self.sequencer.submit(valid, where, start_ns, timeout, cancel)
        batcher = self.batcher if self._own_thread(len(valid)) else self.solo
        if batcher is not None:
            refusal = self.instances.would_self_wait()
            if refusal is not None:
                self._failed(len(valid), start_ns)
                return _ended(where, refusal)
            return batcher.submit(valid, where, start_ns, timeout, cancel, priority,
                                  here=not queued)  # fmt: skip
        if self._eager:
            return self._run_now(valid, where, timeout, cancel, start_ns)
        return self._run_lazily(valid, where, timeout, cancel, start_ns)

    def enqueue(
        self, data: RequestData, timeout: float | None, cancel: Cancellation, start_ns: int,
        priority: int, out: Sink,
    ) -> bool:
        """Queue one valid request whose replies go to ``out`` (as :meth:`run` gives them,
        with index 0), when a batcher of this model takes it (the dynamic batcher, or the
        default scheduler's queue of a stub model): then no thread needs to wait for its
        replies. False (nothing done) for every other model.

        A request refused before it is queued (it would wait for its own instance) gets
        its error through ``out`` too."""
        batcher = self.batcher if self._own_thread(1) else self.solo
        if batcher is None or self.sequencer is not None:
            return False
        refusal = self.instances.would_self_wait()
        if refusal is not None:
            self._failed(1, start_ns)
            out.put([*_ended([0], refusal), None])
            return True
        batcher.enqueue([data], [0], start_ns, timeout, cancel, priority, out)
        return True

    def _own_thread(self, count: int) -> bool:
        """Whether ``count`` requests without a batcher run in the calling thread rather
        than the default scheduler's queue: several at once (one execute, as infer_many
        asks), and a stub's BLS request (its thread takes the instance, which is how a
        model calling itself deeper than its instances is refused instead of waiting on
        itself)."""
        return self.solo is None or count != 1 or serving_bls_here()

    def _failed(self, count: int, start_ns: int) -> None:
        end = time.monotonic_ns()
        for _ in range(count):
            self.stats.failure(start_ns, end)

    def _acquire(self, where: list[int], cancel: Cancellation | None, count: int,
                 start_ns: int) -> Instance | list[Reply]:  # fmt: skip
        """An instance for the batch, or the replies that end it without running."""
        try:
            instance = self.instances.acquire()
        except InferenceError as refusal:
            self._failed(count, start_ns)
            return _ended(where, refusal)
        if instance is None:
            self._failed(count, start_ns)
            return _ended(where, unloaded_error(self.name, refused=True))
        if cancel is not None and cancel.cancelled:
            self.instances.release(instance)
            self._failed(count, start_ns)
            return _ended(where, cancelled_error())
        return instance

    def _run_now(
        self, valid: list[RequestData], where: list[int], timeout: float | None,
        cancel: Cancellation | None, start_ns: int,
    ) -> list[Reply]:
        got = self._acquire(where, cancel, len(valid), start_ns)
        if not isinstance(got, Instance):
            return got
        exec_start = time.monotonic_ns()
        failed: set[int] = set()
        try:
            ran = got.engine.run(valid, timeout, cancel)
            replies = ran if type(ran) is list else list(ran)
        finally:
            end = time.monotonic_ns()
            self.instances.release(got)
        for reply in replies:
            if reply.error is not None:
                failed.add(reply.index)
            reply.index = where[reply.index]
        self._record(valid, failed, start_ns, exec_start, end)
        return replies

    def _run_lazily(
        self, valid: list[RequestData], where: list[int], timeout: float | None,
        cancel: Cancellation | None, start_ns: int,
    ) -> Iterator[Reply]:
        got = self._acquire(where, cancel, len(valid), start_ns)
        if not isinstance(got, Instance):
            yield from got
            return
        exec_start = time.monotonic_ns()
        failed: set[int] = set()
        # A decoupled model's execute returned: the instance takes its next batch while this
        # one's responses still come, as in Triton.
        lease = Lease(self.instances, got)
        try:
            for reply in got.engine.run(valid, timeout, cancel, lease.returned):
                if reply.error is not None:
                    failed.add(reply.index)
                reply.index = where[reply.index]
                yield reply
        finally:
            end = time.monotonic_ns()
            lease.end()
            self._record(valid, failed, start_ns, exec_start, end)

    def _record(self, valid: list[RequestData], failed: set[int], start_ns: int,
                exec_start: int, end: int) -> None:  # fmt: skip
        if len(valid) == 1:  # the usual case, in one call
            self.stats.one_request(self.batch_size(valid[0]), 0 in failed, start_ns,
                                   exec_start, end)  # fmt: skip
            return
        sizes = [self.batch_size(d) for d in valid]
        self.stats.execution(sum(sizes), exec_start, exec_start, end, end)
        for i, size in enumerate(sizes):
            if i in failed:
                self.stats.failure(start_ns, end)
            else:
                self.stats.success(size, start_ns, exec_start, exec_start, end, end, end)

    def update(
        self, instances: list[Instance], added: list[Instance], removed: list[Instance],
        stop: Callable[[Instance], None],
    ) -> list[Instance] | None:
        """An instance update (core's ``UpdateInstanceGroup`` once the new instances exist):
        ``instances`` serve from now on (``added`` among them); of ``removed``, those idle
        (with no sequence, under the sequence batcher) are given back for the caller to stop
        now, and ``stop`` gets each other one once its batch (or its last sequence) ended,
        as Triton lets a removed instance finish its work. None, changing nothing, once the
        model is unloading."""
        if self.instances.closed:
            return None
        if self.sequencer is not None:

            def free(instance: Instance) -> None:
                # Its last sequence ended: it leaves the set like a busy instance.
                current = [i for i in self.instances.instances if i is not instance]
                for gone in self.instances.update(current, [instance], stop) or ():
                    stop(gone)

            ready = self.sequencer.update(added, removed, free)
            later = [i for i in removed if i not in ready]
            # The instances still running sequences stay in the set until then.
            return self.instances.update([*instances, *later], ready, stop)
        for batcher in (self.batcher, self.solo):
            if batcher is not None:
                for instance in removed:
                    batcher.retire(instance)
        return self.instances.update(instances, removed, stop)

    def close(self) -> list[Instance]:
        """Fail queued requests, wait for running ones, and give every instance (for
        stopping)."""
        if self.batcher is not None:
            self.batcher.close()
        if self.solo is not None:
            self.solo.close()
        if self.sequencer is not None:
            self.sequencer.close()
        return self.instances.close()
