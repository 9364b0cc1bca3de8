"""``LoadedModel.infer_async``'s worker threads (``runtime/_calls.py``): a request runs in a
long-lived worker thread, not in a thread started for it; calls never wait for a free thread;
idle threads end; a worker keeps nothing of a finished call; a forked child starts afresh."""

from __future__ import annotations

import subprocess
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from pb_tensor.runtime import ModelRepository
from pb_tensor.runtime._calls import _Workers

_THREAD_ID = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", np.array([threading.get_native_id()], np.int64))]) for r in requests]
"""
_THREAD_ID_CONFIG = """
name: "thread_id"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT64 dims: [ 1 ] } ]
"""


@pytest.fixture
def repository(tmp_path: Path) -> Iterator[ModelRepository]:
    (tmp_path / "thread_id" / "1").mkdir(parents=True)
    (tmp_path / "thread_id" / "1" / "model.py").write_text(_THREAD_ID)
    (tmp_path / "thread_id" / "config.pbtxt").write_text(_THREAD_ID_CONFIG)
    repo = ModelRepository(tmp_path)
    yield repo
    repo.close()


def test_consecutive_requests_run_in_one_worker_thread(repository: ModelRepository) -> None:
    """In-process, ``execute`` runs in the thread that runs the request: a second request
    made after the first ended runs in the same (idle) worker, not in a new thread (Linux
    gives every new thread a new id). Fails with a thread started per call."""
    with repository.load("thread_id", isolated=False) as model:
        request = {"IN": np.array([1], np.int32)}
        ids = [int(model.infer_async(request).result(timeout=60)["OUT"][0]) for _ in range(5)]
    assert len(set(ids)) == 1, ids
    assert ids[0] != threading.get_native_id()


def _nothing() -> None:
    return None


def _job(fn: Callable[[], object]) -> Callable[[], Callable[[], None]]:
    """A worker's call that runs ``fn`` and has no outcome to give away."""

    def call() -> Callable[[], None]:
        fn()
        return _nothing

    return call


def test_a_call_made_once_an_outcome_is_out_finds_the_idle_worker() -> None:
    """A worker is idle before it gives its call's outcome away: the caller's next call,
    made while the outcome is still being given, goes to the same thread. Fails (a second
    thread starts) if the worker registers as idle after the outcome is out."""
    workers = _Workers(idle_s=60.0)
    out, submitted, second_ran = threading.Event(), threading.Event(), threading.Event()
    threads: list[threading.Thread] = []

    def give_outcome() -> None:
        out.set()
        assert submitted.wait(60)

    def first() -> Callable[[], None]:
        threads.append(threading.current_thread())
        return give_outcome

    def second() -> None:
        threads.append(threading.current_thread())
        second_ran.set()

    workers.submit(first, "first")
    assert out.wait(60)
    workers.submit(_job(second), "second")
    submitted.set()
    assert second_ran.wait(60)
    assert threads[0] is threads[1]


def test_calls_in_flight_each_get_a_thread() -> None:
    """A call that waits for a later call's outcome does not wait for a free thread: every
    call in flight has a thread of its own (no pool bound to deadlock on)."""
    workers = _Workers(idle_s=5.0)
    count = 8
    released = [threading.Event() for _ in range(count)]
    finished = threading.Barrier(count + 1, timeout=60)
    names: list[str] = []

    def waiter(i: int) -> Callable[[], Callable[[], None]]:
        def call() -> None:
            names.append(threading.current_thread().name)
            if i + 1 < count:
                released[i + 1].wait(60)  # the next call must run while this one waits
            released[i].set()
            finished.wait()

        return _job(call)

    for i in range(count):
        workers.submit(waiter(i), f"call-{i}")
    finished.wait()
    assert all(e.is_set() for e in released)
    assert sorted(names) == sorted(f"call-{i}" for i in range(count))


def test_an_idle_worker_ends_and_a_new_one_starts() -> None:
    workers = _Workers(idle_s=0.05)
    threads: list[threading.Thread] = []
    ran = threading.Event()

    def call() -> None:
        threads.append(threading.current_thread())
        ran.set()

    workers.submit(_job(call), "first")
    assert ran.wait(60)
    threads[0].join(60)
    assert not threads[0].is_alive()
    ran.clear()
    workers.submit(_job(call), "second")  # no idle worker left: a new thread
    assert ran.wait(60)
    assert threads[1] is not threads[0]
    assert threads[1].name == "second"


def test_a_worker_keeps_nothing_of_a_finished_call() -> None:
    """What a call holds (a request's tensors and pool allocations, its future) is freed
    when it returns, not when the worker's next call comes. Fails if the worker keeps the
    call while it waits idle."""
    workers = _Workers(idle_s=60.0)
    freed = threading.Event()

    class Call:
        def __call__(self) -> Callable[[], None]:
            return _nothing

    call = Call()
    weakref.finalize(call, freed.set)
    workers.submit(call, "held")
    del call
    assert freed.wait(60)


def test_a_forked_child_starts_with_no_idle_worker(
    run_python: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    """The parent's idle workers do not exist in a forked child: a call there starts a
    thread instead of waiting for one of them for ever. (Python 3.12+ warns about forking
    a process with threads: warnings are not errors here.)"""
    code = (
        "import os, threading\n"
        "from pb_tensor.runtime._calls import _Workers\n"
        "workers = _Workers(idle_s=60.0)\n"
        "ran = threading.Event()\n"
        "workers.submit(lambda: (ran.set(), lambda: None)[1], 'parent')\n"
        "assert ran.wait(60)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    done = threading.Event()\n"
        "    workers.submit(lambda: (done.set(), lambda: None)[1], 'child')\n"
        "    os._exit(0 if done.wait(30) else 1)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "raise SystemExit(os.waitstatus_to_exitcode(status))\n"
    )
    result = run_python(code, timeout=120, warnings_as_errors=False)
    assert result.returncode == 0, result.stderr
