"""The dataflow of one request to an ensemble with decoupled steps, run as core's ensemble
scheduler runs it: every response of a step that completes the inputs of another step sends
that step its request at once (core enqueues it from the response callback), so requests to
a step with a dynamic batcher queue up there while earlier ones run, and its
``max_queue_size`` refuses those past the limit as in Triton. Steps whose model has no
batcher take their requests one at a time, in the order they were made; the replies of each
step are read in a thread of their own. The first error ends the run: no further step is
started, the steps in flight finish, and the ensemble answers with that error.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from pb_tensor import Tensor
from pb_tensor.runtime._ensemble_steps import Override, Step, Value, sequence_override, step_request
from pb_tensor.runtime._errors import InferenceError
from pb_tensor.runtime._host import RequestData
from pb_tensor.runtime._seam import TritonError
from pb_tensor.runtime._tracker import Cancellation, Reply, cancelled_error

__all__ = ["Flow", "RunState"]

# How often a wait for the next response wakes up (keeps it interruptible).
_POLL_S = 0.1


class RunState(Protocol):
    """The state of one request to an ensemble that the flow updates (core's
    ``EnsembleContext``)."""

    data: RequestData
    priority: int
    values: dict[str, dict[int, Value]]
    pooled: set[int]
    owned: frozenset[str]
    error: InferenceError | None

    def add(
        self, name: str, tensor: Tensor | None, batch_size: int, override: Override = None
    ) -> tuple[str, int]: ...

    def release(self, tensors: Iterable[str], iteration: int) -> None: ...

    def ready_steps(self, updated: Iterable[tuple[str, int]]) -> list[tuple[int, int]]: ...

    def response(self, updated: Iterable[tuple[str, int]]) -> Reply | None: ...


_Launch = tuple[int, Step, RequestData, int]
_Detach = Callable[[], None]


def _no_detach() -> None:
    return None


def _canceller(cancellation: Cancellation) -> Callable[[], None]:
    def cancel() -> None:
        cancellation.cancel()

    return cancel


def _queues_at_once(model: Any) -> bool:
    """Whether ``model`` queues a request when it is made (a model with a dynamic batcher)
    rather than when its replies are first read."""
    scheduler = getattr(model, "_scheduler", None)
    return getattr(scheduler, "batcher", None) is not None


def _value_of(values: dict[str, dict[int, Value]], name: str, *, iteration: int) -> Value:
    return values[name][iteration]


class Flow:
    """Runs the steps of one request as their inputs appear; :meth:`replies` gives the
    ensemble's responses as they complete."""

    def __init__(
        self, run: RunState, steps: list[Step], timeout: float | None,
        cancel: Cancellation | None,
    ) -> None:  # fmt: skip
        self._run = run
        self._steps = steps
        self._timeout = timeout
        self._cancel = cancel
        self._lock = threading.Lock()
        self._out: queue.SimpleQueue[Reply | None] = queue.SimpleQueue()
        self._active = 0
        # step index -> the replies still to read, in request order (models without batcher)
        self._waiting: dict[int, list[tuple[_Launch, Iterable[Reply], _Detach]]] = {}

    def replies(self, updated: list[tuple[str, int]]) -> Iterator[Reply]:
        """The ensemble's responses after the request's own tensors ``updated``, until no
        step runs any more (``run.error`` then holds the first error, if any)."""
        self._enter()
        try:
            with self._lock:
                launches = self._advance(updated)
            self._start(launches)
        finally:
            self._leave()
        while True:
            try:
                item = self._out.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            yield item

    # -- bookkeeping --------------------------------------------------------------------------
    def _enter(self) -> None:
        with self._lock:
            self._active += 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._out.put(None)

    def _fail(self, error: InferenceError) -> None:
        with self._lock:
            if self._run.error is None:
                self._run.error = error

    def _advance(self, updated: list[tuple[str, int]]) -> list[_Launch]:
        """(Lock held.) Send the response an update completed; the steps it made ready."""
        run = self._run
        response = run.response(updated)
        if response is not None:
            self._out.put(response)
        launches: list[_Launch] = []
        if run.error is not None:
            return launches
        for index, iteration in run.ready_steps(updated):
            step = self._steps[index]
            read = functools.partial(_value_of, run.values, iteration=iteration)
            request, batch_size = step_request(step, read, run.pooled, run.data, run.owned)
            run.release((t for _, t, _ in step.inputs), iteration)
            launches.append((index, step, request, batch_size))
        return launches

    # -- running steps ------------------------------------------------------------------------
    def _start(self, launches: list[_Launch]) -> None:
        for launch in launches:
            if self._cancel is not None and self._cancel.cancelled:
                self._fail(cancelled_error())
                return
            index, step, request, _ = launch
            # The step request's own cancellation, set by the ensemble request's: closing a
            # step's replies early (after an error) cancels that step only, not the caller.
            own = Cancellation()
            detach = _no_detach if self._cancel is None else self._cancel.subscribe(_canceller(own))
            self._enter()
            try:
                replies = step.model._replies([request], self._timeout, own, self._run.priority)
            except BaseException:
                detach()
                self._leave()
                raise
            if isinstance(replies, list):
                self._read(launch, replies, detach)
            elif _queues_at_once(step.model):
                threading.Thread(target=self._read, args=(launch, replies, detach), daemon=True,
                                 name=f"pb-tensor-ensemble-{step.model.name}").start()  # fmt: skip
            else:
                with self._lock:
                    waiting = self._waiting.get(index)
                    if waiting is not None:
                        waiting.append((launch, replies, detach))
                        continue
                    self._waiting[index] = [(launch, replies, detach)]
                threading.Thread(target=self._serve, args=(index,), daemon=True,
                                 name=f"pb-tensor-ensemble-{step.model.name}").start()  # fmt: skip

    def _serve(self, index: int) -> None:
        """Read the replies of step ``index``'s requests one request after another."""
        while True:
            with self._lock:
                waiting = self._waiting[index]
                if not waiting:
                    del self._waiting[index]
                    return
                launch, replies, detach = waiting.pop(0)
            self._read(launch, replies, detach)

    def _read(self, launch: _Launch, replies: Iterable[Reply], detach: _Detach) -> None:
        """Feed each response of one step request into the run; ends the request's count."""
        try:
            self._consume(launch, replies)
        except Exception as exc:  # a failure of the runtime itself: the run fails with it
            self._fail(InferenceError(f"{type(exc).__name__}: {exc}", TritonError.INTERNAL))
        finally:
            close = getattr(replies, "close", None)
            if close is not None:
                close()
            detach()
            self._leave()

    def _consume(self, launch: _Launch, replies: Iterable[Reply]) -> None:
        _, step, request, batch_size = launch
        run = self._run
        for reply in replies:
            if reply.error is not None:
                self._fail(reply.error)
                return
            if not reply.has_response:
                continue
            try:
                override = sequence_override(reply.parameters, request.correlation_id)
            except InferenceError as exc:
                self._fail(exc)
                return
            with self._lock:
                if run.error is not None:
                    return
                produced = {t.name(): t for t in reply.tensors}
                if step.pooled_outputs:
                    run.pooled.update(id(t) for t in reply.tensors)
                updated = [
                    run.add(tensor_name, produced.get(output), batch_size, override)
                    for output, tensor_name in step.outputs.items()
                ]
                launches = self._advance(updated)
            self._start(launches)
