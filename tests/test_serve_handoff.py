"""``pb_tensor.serve._handoff``: an event loop hands a request's blocking part to a worker
thread and gets its outcome back (results, exceptions, cancellation, thread reuse and
limit, nothing kept after a call, closing); ``await_future`` for ``infer_async``'s future."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# serve's core reaches the model runtime, which reads config.pbtxt with protobuf (the
# [runtime] extra); the numpy-only checks have neither.
pytest.importorskip("google.protobuf")

from pb_tensor.serve._core import Core, Options
from pb_tensor.serve._handoff import Handoff, await_future


def test_run_gives_the_result_and_reuses_an_idle_thread() -> None:
    handoff = Handoff(max_workers=4, name="test-handoff")

    async def main() -> list[threading.Thread]:
        return [await handoff.run(threading.current_thread) for _ in range(5)]

    try:
        threads = asyncio.run(main())
    finally:
        handoff.close()
    assert len(set(threads)) == 1
    assert threads[0] is not threading.current_thread()
    assert threads[0].name == "test-handoff-1"


def test_run_raises_what_the_call_raised() -> None:
    handoff = Handoff(max_workers=1, name="test-handoff")

    def fail() -> None:
        raise KeyError("the call's own error")

    async def main() -> None:
        with pytest.raises(KeyError, match="the call's own error"):
            await handoff.run(fail)
        assert await handoff.run(lambda: 7) == 7  # the worker survived

    try:
        asyncio.run(main())
    finally:
        handoff.close()


def test_calls_beyond_the_limit_wait_their_turn() -> None:
    """With two workers, four blocking calls run two at a time, all to completion."""
    handoff = Handoff(max_workers=2, name="test-handoff")
    lock = threading.Lock()
    running = 0
    most = 0
    gate = threading.Event()

    def call(i: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        gate.wait(60)
        with lock:
            running -= 1
        return i

    async def main() -> list[int]:
        tasks = [asyncio.ensure_future(handoff.run(lambda i=i: call(i))) for i in range(4)]
        while True:  # both workers busy
            await asyncio.sleep(0.01)
            with lock:
                if running == 2:
                    break
        gate.set()
        return list(await asyncio.gather(*tasks))

    try:
        assert asyncio.run(main()) == [0, 1, 2, 3]
    finally:
        handoff.close()
    assert most == 2


def test_a_cancelled_wait_drops_the_outcome() -> None:
    """A client that went away cancels the awaiting task: the call still ends (the caller
    cancels the request itself), and its outcome goes nowhere."""
    handoff = Handoff(max_workers=1, name="test-handoff")
    started, release, ended = threading.Event(), threading.Event(), threading.Event()

    def call() -> int:
        started.set()
        release.wait(60)
        ended.set()
        return 1

    async def main() -> None:
        task = asyncio.ensure_future(handoff.run(call))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        assert await handoff.run(lambda: 2) == 2  # after the cancelled call ended

    try:
        asyncio.run(main())
    finally:
        handoff.close()
    assert ended.is_set()


def test_a_worker_keeps_nothing_of_a_finished_call() -> None:
    """What a call holds (the request's tensors) is freed once its outcome is on its way,
    not when the worker's next call comes. Fails if the worker keeps the call while idle."""
    handoff = Handoff(max_workers=1, name="test-handoff")
    freed = threading.Event()

    class Call:
        def __call__(self) -> int:
            return 3

    async def main() -> int:
        call = Call()
        weakref.finalize(call, freed.set)
        return await handoff.run(call)

    try:
        assert asyncio.run(main()) == 3
        assert freed.wait(60)
    finally:
        handoff.close()


def test_closed_handoff_refuses_calls_and_its_workers_end() -> None:
    handoff = Handoff(max_workers=1, name="test-handoff")

    async def main() -> threading.Thread:
        return await handoff.run(threading.current_thread)

    worker = asyncio.run(main())
    handoff.close()
    worker.join(60)
    assert not worker.is_alive()
    with pytest.raises(RuntimeError, match="test-handoff: closed, no new calls"):
        asyncio.run(main())


def test_handoff_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="Handoff needs max_workers >= 1, not 0"):
        Handoff(max_workers=0, name="test-handoff")


def test_await_future_gives_the_outcome_and_cancels_on_cancellation() -> None:
    async def main() -> None:
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        threading.Timer(0.01, done.set_result, (5,)).start()
        assert await await_future(done) == 5

        failed: concurrent.futures.Future[int] = concurrent.futures.Future()
        failed.set_exception(LookupError("already failed"))
        with pytest.raises(LookupError, match="already failed"):
            await await_future(failed)

        pending: concurrent.futures.Future[int] = concurrent.futures.Future()
        task = asyncio.ensure_future(await_future(pending))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pending.cancelled()  # the request's future was cancelled too

    asyncio.run(main())


_GATE = '''
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            path = pb_utils.get_input_tensor_by_name(request, "PATH").as_numpy()[0].decode()
            while not os.path.exists(path):
                time.sleep(0.01)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([1], np.int32))]))
        return responses
'''
_GATE_CONFIG = """
name: "gate"
backend: "python"
input [ { name: "PATH" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def test_a_request_cancelled_while_queued_for_a_worker_is_counted_out(tmp_path: Path) -> None:
    """With every worker thread busy, a request waits for one; a client that goes away
    then cancels it. Its request still ends through the worker (cancelled before it runs),
    so serve no longer counts it in flight and shutdown's drain does not wait for it.
    Fails with run_in_executor, whose cancelled work item never ran and so never counted
    the request out."""
    (tmp_path / "gate" / "1").mkdir(parents=True)
    (tmp_path / "gate" / "1" / "model.py").write_text(_GATE)
    (tmp_path / "gate" / "config.pbtxt").write_text(_GATE_CONFIG)
    gate = tmp_path / "open"
    core = Core(Options(model_repositories=[str(tmp_path)], in_process=True))
    try:
        core.startup()
        model = core.model("gate")
        inputs = {"PATH": np.array([str(gate).encode()], dtype=object)}
        workers = 64  # serve's worker threads

        async def main() -> list[Any]:
            tasks = [asyncio.ensure_future(core.infer(model, inputs, None, {}, "", 0, 0))
                     for _ in range(workers + 1)]  # fmt: skip
            while core.pending(core.model("gate")) < workers + 1:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # every worker holds a request: the last one waits
            tasks[-1].cancel()
            gate.touch()
            return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(main())
        assert isinstance(results[-1], asyncio.CancelledError)
        assert all(list(r.keys()) == ["OUT"] for r in results[:-1])
        assert core.drain(30)
        assert core.pending(core.model("gate")) == 0
    finally:
        core.close()
