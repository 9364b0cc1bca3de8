"""Benchmark of ``pb_tensor.runtime`` against baselines measured in the same run.

Targets (issue 11):

* in-process ``infer`` on add_sub, two (16,) float32 inputs: at most 10 us over calling the
  model's ``execute`` directly with prebuilt requests;
* isolated ``infer`` with 4 KiB inputs: at most 2x a ``multiprocessing.Pipe`` round trip that
  pickles the same inputs and outputs; with 64 MiB inputs at most 0.2x of it (zero-copy wins);
* requests per second for a stream of add_sub requests, isolated and in-process (reported);
* scheduling (issue 19): add_sub with ``dynamic_batching`` and 16 concurrent callers, stub
  process, at least 4x the throughput of the same model without it (mean batch size, and
  the CPU time per request of the runtime's process and of the stub, printed; in the same
  rounds, for comparison without targets: the bare pattern of a model's queue with nothing
  of pb-tensor in it, and one thread keeping 16 requests in flight with ``infer_async``);
  two instances of a model that sleeps 10 ms at least 1.8x the throughput of one.
* an ensemble of two add_sub steps: at most 1.2x calling the two models in sequence from
  Python (issue 19), isolated and in-process.

Usage: ``python benchmarks/bench_runtime.py [--quick] [--only SECTION ...]`` (sections:
``inprocess``, ``isolated``, ``ensemble``, ``scheduling``). Medians of repeated runs; ratios are
computed within the run from interleaved rounds, so machine speed and load changes cancel
out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import pickle
import queue
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from machine_load import Meter, Share, contended_note

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from pb_tensor.runtime import ModelRepository  # noqa: E402
from pb_tensor.runtime._model_import import load_model_module  # noqa: E402
from pb_tensor.utils import Tensor  # noqa: E402
from pb_tensor.utils._context import make_request  # noqa: E402

EXAMPLES = os.path.join(ROOT, "examples", "model_repository")

_TWICE = """
platform: "ensemble"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "add_sub" model_version: -1
    input_map { key: "INPUT0" value: "INPUT0" } input_map { key: "INPUT1" value: "INPUT1" }
    output_map { key: "OUTPUT0" value: "sum" } output_map { key: "OUTPUT1" value: "diff" } },
  { model_name: "add_sub" model_version: -1
    input_map { key: "INPUT0" value: "sum" } input_map { key: "INPUT1" value: "diff" }
    output_map { key: "OUTPUT0" value: "OUTPUT0" } output_map { key: "OUTPUT1" value: "OUTPUT1" } }
] }
"""


def _ensemble_rows(
    report: Callable[..., None], lines: list[str], repeat: int, min_time: float
) -> None:
    """An ensemble of two add_sub steps against calling add_sub twice from Python."""
    a16 = np.arange(16, dtype=np.float32)
    b16 = np.ones(16, dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(os.path.join(EXAMPLES, "add_sub"), os.path.join(tmp, "add_sub"))
        os.makedirs(os.path.join(tmp, "add_sub_twice", "1"))
        with open(os.path.join(tmp, "add_sub_twice", "config.pbtxt"), "w") as f:
            f.write(_TWICE)
        with ModelRepository(tmp) as repo:
            for label, isolated in (("stub processes", True), ("in-process", False)):
                ensemble = repo.load("add_sub_twice", isolated=isolated)
                model = repo.shared_model("add_sub", -1, isolated)

                def sequence(model: Any = model) -> Any:
                    first = model.infer({"INPUT0": a16, "INPUT1": b16})
                    return model.infer({"INPUT0": first["OUTPUT0"], "INPUT1": first["OUTPUT1"]})

                def ensembled(ensemble: Any = ensemble) -> Any:
                    return ensemble.infer({"INPUT0": a16, "INPUT1": b16})

                np.testing.assert_array_equal(ensembled()["OUTPUT0"], sequence()["OUTPUT0"])
                seq_us, ens_us, ratio = _paired_us(sequence, ensembled, repeat, min_time)
                lines.append(f"ensemble of two add_sub steps, {label}, two (16,) float32 inputs")
                report("  add_sub called twice from Python", f"{seq_us:9.1f} us")
                report("  the ensemble (target <= 1.2x)", f"{ens_us:9.1f} us", ratio, 1.2)
                ensemble.unload()


def _calls_for(fn: Callable[[], object], min_time: float) -> int:
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        if time.perf_counter() - start >= min_time:
            return number
        number *= 2


def _per_call_us(fn: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number * 1e6


def _paired_us(
    base: Callable[[], object], ours: Callable[[], object], repeat: int, min_time: float
) -> tuple[float, float, float]:
    """Medians of (baseline us, ours us, ours/baseline) over ``repeat`` interleaved rounds:
    each round times both back to back, so load changes on a shared machine hit both."""
    n_base = _calls_for(base, min_time)
    n_ours = _calls_for(ours, min_time)
    rounds = [(_per_call_us(base, n_base), _per_call_us(ours, n_ours)) for _ in range(repeat)]
    return (
        statistics.median(b for b, _ in rounds),
        statistics.median(o for _, o in rounds),
        statistics.median(o / b for b, o in rounds),
    )


def _echo_server(conn: Connection) -> None:
    """The baseline peer: unpickles the inputs, computes add_sub, pickles the outputs back."""
    while True:
        msg = conn.recv()
        if msg is None:
            return
        a, b = msg
        conn.send((a + b, a - b))


_SLEEP_MODEL = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            time.sleep(0.01)
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(request, "IN")
                                 .as_numpy())]))
        return out
"""


def _scheduling_repository(root: str) -> None:
    """add_sub that batches (16 x (16,) float32), with and without a batcher; a model that
    sleeps 10 ms per request, with one and two instances."""
    io = """
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
"""
    for name, extra in (("add_sub_plain", ""), ("add_sub_batched", "dynamic_batching { }")):
        os.makedirs(os.path.join(root, name, "1"))
        shutil.copy(os.path.join(EXAMPLES, "add_sub", "1", "model.py"),
                    os.path.join(root, name, "1", "model.py"))
        with open(os.path.join(root, name, "config.pbtxt"), "w") as f:
            f.write(f'backend: "python"\nmax_batch_size: 16\n{io}{extra}\n')
    for name, count in (("sleep_one", 1), ("sleep_two", 2)):
        os.makedirs(os.path.join(root, name, "1"))
        with open(os.path.join(root, name, "1", "model.py"), "w") as f:
            f.write(_SLEEP_MODEL)
        with open(os.path.join(root, name, "config.pbtxt"), "w") as f:
            f.write('backend: "python"\n'
                    'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                    'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                    f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n")


def _concurrent_rps(call: Callable[[], object], callers: int, per_caller: int) -> float:
    """Requests per second of ``callers`` threads each making ``per_caller`` calls."""
    barrier = threading.Barrier(callers + 1)

    def work() -> None:
        barrier.wait()
        for _ in range(per_caller):
            call()

    threads = [threading.Thread(target=work) for _ in range(callers)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return callers * per_caller / (time.perf_counter() - start)


def _floor_child(conn: Connection) -> None:
    """The least a stub process does for add_sub: takes a pickled list of (INPUT0, INPUT1)
    pairs, answers with the list of their (sum, difference) pairs; None ends it."""
    while True:
        batch = pickle.loads(conn.recv_bytes())
        if batch is None:
            return
        conn.send_bytes(pickle.dumps([(a + b, a - b) for a, b in batch], 5))


class _Floor:
    """The bare pattern of a stub model's queue, with nothing of pb-tensor in it: caller
    threads append ``(a, b)`` to a list under a condition and wait on a ``SimpleQueue`` of
    their own; one instance thread takes one request (or, batching, every queued one up to
    16), sends them pickled to a child process over a ``Pipe``, and puts each answer in its
    caller's queue. No validation, no request objects, no statistics, no pool: what the
    machine gives the hand-overs themselves."""

    def __init__(self, child_cpus: set[int] | None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_floor_child, args=(theirs,), daemon=True)
        self._proc.start()
        theirs.close()
        if child_cpus is not None and self._proc.pid is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self._proc.pid, child_cpus)

    def rps(self, batched: bool, callers: int, per_caller: int) -> float:
        """Requests per second of ``callers`` threads making ``per_caller`` requests each."""
        cond = threading.Condition()
        pending: list[tuple[Any, queue.SimpleQueue[Any] | None]] = []
        conn = self._conn
        take = 16 if batched else 1

        def instance() -> None:
            while True:
                with cond:
                    while not pending:
                        cond.wait()
                    batch = pending[:take]
                    del pending[:take]
                if batch[0][1] is None:
                    return
                conn.send_bytes(pickle.dumps([x for x, _ in batch], 5))
                for (_, out), y in zip(batch, pickle.loads(conn.recv_bytes())):
                    if out is not None:
                        out.put(y)

        thread = threading.Thread(target=instance, daemon=True)
        thread.start()
        a = np.arange(16, dtype=np.float32)
        b = np.ones(16, dtype=np.float32)

        def call() -> None:
            out: queue.SimpleQueue[Any] = queue.SimpleQueue()
            with cond:
                pending.append(((a, b), out))
                cond.notify()
            out.get()

        try:
            return _concurrent_rps(call, callers, per_caller)
        finally:
            with cond:
                pending.append((None, None))
                cond.notify()
            thread.join(10)

    def close(self) -> None:
        self._conn.send_bytes(pickle.dumps(None))
        self._proc.join(10)


def _in_flight_rps(model: Any, inputs: dict[str, Any], depth: int, total: int) -> float:
    """Requests per second of one thread that keeps ``depth`` requests in flight with
    ``infer_async`` (perf_analyzer's meaning of concurrency), ``total`` in all."""
    futures: deque[Any] = deque()
    start = time.perf_counter()
    for _ in range(depth):
        futures.append(model.infer_async(inputs))
    sent = depth
    while futures:
        futures.popleft().result()
        if sent < total:
            futures.append(model.infer_async(inputs))
            sent += 1
    return total / (time.perf_counter() - start)


def _cpu_us(pid: int | None) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by this process and by the stub ``pid``
    (Linux's /proc; nan elsewhere), in microseconds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    stub = float("nan")
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        stub = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") * 1e6
    except (OSError, ValueError, IndexError):
        pass
    return (usage.ru_utime + usage.ru_stime) * 1e6, stub


def _split_cpus() -> tuple[set[int], str] | None:
    """(the callers' CPU, the stubs' ``cpu-cores``) where this machine can keep them apart:
    Linux's per-thread affinity and two or more CPUs; None elsewhere."""
    if not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc/self/task"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {cpus[0]}, ",".join(f"{c}-{c}" for c in cpus[1:])


@contextlib.contextmanager
def _bound(cpus: set[int]) -> Iterator[None]:
    """Every thread of this process on ``cpus`` (threads started meanwhile inherit it), and
    each thread that is still there back where it was afterwards."""
    before: dict[int, set[int]] = {}
    for name in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            before[int(name)] = os.sched_getaffinity(int(name))
            os.sched_setaffinity(int(name), cpus)
    try:
        yield
    finally:
        for task, was in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(task, was)


def _batching(repo: ModelRepository, quick: bool, report: Callable[..., None],
              lines: list[str], title: str,
              floor_cpus: set[int] | None = None) -> None:  # fmt: skip
    """add_sub with and without ``dynamic_batching``, 16 concurrent callers, alternated with
    the same two ways through the bare pattern (:class:`_Floor`, its child process on
    ``floor_cpus``)."""
    a = np.arange(16, dtype=np.float32)[None, :]
    b = np.ones((1, 16), dtype=np.float32)
    rounds = 2 if quick else 4
    per_caller = 25 if quick else 100
    plain = repo.load("add_sub_plain", isolated=True)
    batched = repo.load("add_sub_batched", isolated=True)
    out = batched.infer({"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    meter = Meter()
    pairs = []
    floors = []
    flights = []
    floor = _Floor(floor_cpus)
    cpu: list[tuple[float, float, float, float]] = []  # host, stub: plain, batched
    for _ in range(rounds):
        floors.append((floor.rps(False, 16, per_caller), floor.rps(True, 16, per_caller)))
        x = {"INPUT0": a, "INPUT1": b}
        flights.append((_in_flight_rps(plain, x, 16, 16 * per_caller),
                        _in_flight_rps(batched, x, 16, 16 * per_caller)))
        before = _cpu_us(plain.pid)
        p = _concurrent_rps(lambda: plain.infer({"INPUT0": a, "INPUT1": b}), 16, per_caller)
        middle = _cpu_us(plain.pid)
        between = _cpu_us(batched.pid)
        q = _concurrent_rps(lambda: batched.infer({"INPUT0": a, "INPUT1": b}), 16,
                            per_caller)  # fmt: skip
        after = _cpu_us(batched.pid)
        pairs.append((p, q))
        n = 16 * per_caller
        cpu.append(((middle[0] - before[0]) / n, (middle[1] - before[1]) / n,
                    (after[0] - between[0]) / n, (after[1] - between[1]) / n))  # fmt: skip
    floor.close()
    stats = batched.statistics()
    mean_batch = stats["inference_count"] / max(1, stats["execution_count"])
    lines.append(title)
    plain_rps = statistics.median(p for p, _ in pairs)
    report("  without dynamic_batching", f"{plain_rps:9.0f} req/s")
    report(f"  dynamic_batching (mean batch {mean_batch:.1f}) (target >= 4x)",
           f"{statistics.median(q for _, q in pairs):9.0f} req/s",
           statistics.median(q / p for p, q in pairs), 4.0, higher_is_worse=False)
    per = [statistics.median(c[i] for c in cpu) for i in range(4)]
    report("  CPU per request, runtime + stub: without / with batching",
           f"{per[0]:.0f}+{per[1]:.0f} / {per[2]:.0f}+{per[3]:.0f} us")
    # Ratios of the medians below (no targets): a single slow round of the bare pattern
    # one at a time would make a median of per-round ratios read high.
    for label, runs in (("the bare pattern (no pb-tensor, the same threads)", floors),
                        ("16 requests in flight from one thread (infer_async)", flights)):
        lines.append(f"  {label}")
        one = statistics.median(p for p, _ in runs)
        many = statistics.median(q for _, q in runs)
        report("    one at a time / batched",
               f"{one:6.0f} / {many:6.0f} req/s", many / one)
    report("  dynamic_batching / the bare pattern batched",
           "", statistics.median(q / f for (_, q), (_, f) in zip(pairs, floors)))
    lines.append(_machine_row(meter))


def _scheduling(quick: bool, report: Callable[..., None], lines: list[str]) -> None:
    root = tempfile.mkdtemp(prefix="pb-tensor-bench-")
    try:
        _scheduling_repository(root)
        with ModelRepository(root) as repo:
            _batching(repo, quick, report, lines,
                      "add_sub (16,) float32 x 16 concurrent callers, stub process")
        split = _split_cpus()
        if split is None:
            lines.append("add_sub x 16 callers, callers and stubs on CPUs of their own: "
                         "skipped (needs Linux and 2+ CPUs)")
        else:
            # The same, with the callers' threads on one CPU and the stubs on the others
            # (--host-policy=cpu,cpu-cores=...): 16 Python threads handing the GIL to each
            # other across CPUs cost several times their work (docs/runtime.md).
            callers, cores = split
            with _bound(callers), ModelRepository(
                root, host_policies={"cpu": {"cpu-cores": cores}}
            ) as repo:
                _batching(repo, quick, report, lines,
                          f"the same, callers on CPU {min(callers)}, stubs on cpu-cores={cores}",
                          set(range(os.cpu_count() or 1)) - callers)
        rounds = 2 if quick else 4
        with ModelRepository(root) as repo:
            one = repo.load("sleep_one", isolated=True)
            two = repo.load("sleep_two", isolated=True)
            x = {"IN": np.ones(1, np.float32)}
            n = 10 if quick else 40
            meter = Meter()
            pairs = [(_concurrent_rps(lambda: one.infer(x), 4, n),
                      _concurrent_rps(lambda: two.infer(x), 4, n)) for _ in range(rounds)]
            lines.append("model sleeping 10 ms per request, 4 concurrent callers, stub process")
            report("  one instance", f"{statistics.median(p for p, _ in pairs):9.0f} req/s")
            report("  two instances (target >= 1.8x)",
                   f"{statistics.median(q for _, q in pairs):9.0f} req/s",
                   statistics.median(q / p for p, q in pairs), 1.8, higher_is_worse=False)
            lines.append(_machine_row(meter))
    finally:
        shutil.rmtree(root, ignore_errors=True)


_shares: list[Share] = []  # the machine's steal during each group of rows


def _machine_row(meter: Meter) -> str:
    """The row that says how much of the machine the rows above had (machine_load.py)."""
    share = meter.share()
    _shares.append(share)
    return _row(f"  (the machine during these rows: {share.text()})", "")


def _row(name: str, value: str, ratio: str = "", verdict: str = "") -> str:
    return f"{name:<58} {value:>14} {ratio:>10} {verdict:>5}"


_SECTIONS = ("inprocess", "isolated", "ensemble", "scheduling")


def _inprocess_rows(
    quick: bool, min_time: float, report: Callable[..., None], lines: list[str],
    verdicts: list[bool],
) -> None:
    """In-process ``infer`` against calling ``execute`` directly, on the default path (inputs
    copied, as Triton does) and with ``share_inputs=True`` (what ``serve`` uses)."""
    a16 = np.arange(16, dtype=np.float32)
    b16 = np.ones(16, dtype=np.float32)
    with ModelRepository(EXAMPLES) as repo, ModelRepository(EXAMPLES, share_inputs=True) as shr:
        model = repo.load("add_sub", isolated=False)
        shared = shr.load("add_sub", isolated=False)
        module = load_model_module(
            os.path.join(EXAMPLES, "add_sub", "1", "model.py"), "add_sub_direct"
        )
        direct = module.TritonPythonModel()
        direct.initialize({"model_config": json.dumps(model.config)})
        requests = [make_request([Tensor("INPUT0", a16), Tensor("INPUT1", b16)],
                                 ["OUTPUT0", "OUTPUT1"], model_name="add_sub")]
        calls: list[Callable[[], object]] = [
            lambda: direct.execute(requests),
            lambda: model.infer({"INPUT0": a16, "INPUT1": b16}),
            lambda: shared.infer({"INPUT0": a16, "INPUT1": b16}),
        ]
        numbers = [_calls_for(call, min_time) for call in calls]
        rounds = []
        # Rounds are short here: more of them keep the median steady on a loaded machine.
        for _ in range(7 if quick else 15):
            d, i, s = (_per_call_us(call, n) for call, n in zip(calls, numbers))
            rounds.append((d, i, i - d, s, s - d))
        direct_us, inproc_us, overhead, shared_us, shared_overhead = (
            statistics.median(r[k] for r in rounds) for k in range(5)
        )
        lines.append("in-process infer, add_sub, two (16,) float32 inputs")
        report("  execute() called directly with prebuilt requests", f"{direct_us:9.1f} us")
        report("  LoadedModel.infer (in-process)", f"{inproc_us:9.1f} us")
        ok = overhead <= 10.0
        verdicts.append(ok)
        lines.append(_row("  overhead (target <= 10 us)", f"{overhead:9.1f} us", "",
                          "PASS" if ok else "MISS"))
        report("  LoadedModel.infer, share_inputs=True (as serve)", f"{shared_us:9.1f} us")
        report("  overhead, share_inputs=True", f"{shared_overhead:9.1f} us")
        n_stream = 200 if quick else 1000
        start = time.perf_counter()
        for _ in range(n_stream):
            model.infer({"INPUT0": a16, "INPUT1": b16})
        inproc_rps = n_stream / (time.perf_counter() - start)
        lines.append("stream of add_sub requests, two (16,) float32 inputs")
        report("  in-process", f"{inproc_rps:9.0f} req/s")


def _isolated_rows(
    quick: bool, repeat: int, big_repeat: int, min_time: float,
    report: Callable[..., None], lines: list[str],
) -> None:
    """Stub-process ``infer`` against a pickling ``multiprocessing.Pipe`` round trip."""
    a16 = np.arange(16, dtype=np.float32)
    b16 = np.ones(16, dtype=np.float32)
    n_stream = 200 if quick else 1000
    with ModelRepository(EXAMPLES) as repo:
        iso = repo.load("add_sub", isolated=True)
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_echo_server, args=(theirs,), daemon=True)
        proc.start()
        try:
            for label, count, target, rep in (
                ("4 KiB", 1024, 2.0, repeat),
                ("64 MiB", 16 << 20, 0.2, big_repeat),
            ):
                a = np.arange(count, dtype=np.float32)
                b = np.ones(count, dtype=np.float32)

                def pipe_call(a: Any = a, b: Any = b) -> Any:
                    ours.send((a, b))
                    return ours.recv()

                def iso_call(a: Any = a, b: Any = b) -> Any:
                    return iso.infer({"INPUT0": a, "INPUT1": b})

                check = iso_call()
                np.testing.assert_array_equal(check["OUTPUT0"], a + b)
                del check
                t = min_time if count < 1 << 20 else 0.0
                pipe_us, iso_us, ratio = _paired_us(pipe_call, iso_call, rep, t)
                lines.append(f"isolated infer, add_sub, two {label} float32 inputs")
                report("  multiprocessing.Pipe round trip, pickled in and out",
                       f"{pipe_us:9.1f} us")
                report(f"  LoadedModel.infer (stub process) (target <= {target}x)",
                       f"{iso_us:9.1f} us", ratio, target)
            start = time.perf_counter()
            for _ in range(n_stream):
                iso.infer({"INPUT0": a16, "INPUT1": b16})
            iso_rps = n_stream / (time.perf_counter() - start)
        finally:
            ours.send(None)
            proc.join(10)
        lines.append("stream of add_sub requests, two (16,) float32 inputs")
        report("  isolated (stub process)", f"{iso_rps:9.0f} req/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (fewer repeats)")
    parser.add_argument("--only", nargs="+", choices=_SECTIONS, metavar="SECTION",
                        help=f"run only these sections ({', '.join(_SECTIONS)})")
    args = parser.parse_args()
    repeat, min_time = (3, 0.05) if args.quick else (7, 0.2)
    big_repeat = 3 if args.quick else 5
    lines: list[str] = []
    verdicts: list[bool] = []

    def report(name: str, value: str, ratio: float | None = None, target: float | None = None,
               higher_is_worse: bool = True) -> None:
        verdict = ""
        ratio_text = ""
        if ratio is not None:
            ratio_text = f"{ratio:.2f}x"
        if target is not None and ratio is not None:
            ok = ratio <= target if higher_is_worse else ratio >= target
            verdicts.append(ok)
            verdict = "PASS" if ok else "MISS"
        lines.append(_row(name, value, ratio_text, verdict))

    sections = set(args.only or _SECTIONS)
    meter = Meter()
    if "inprocess" in sections:
        _inprocess_rows(args.quick, min_time, report, lines, verdicts)
        lines.append(_machine_row(meter))
    if "isolated" in sections:
        meter.restart()
        _isolated_rows(args.quick, repeat, big_repeat, min_time, report, lines)
        lines.append(_machine_row(meter))
    if "ensemble" in sections:
        meter.restart()
        _ensemble_rows(report, lines, repeat, min_time)
        lines.append(_machine_row(meter))
    if "scheduling" in sections:
        _scheduling(args.quick, report, lines)

    sys.stdout.write("\n".join(lines) + "\n")
    passed = sum(verdicts)
    sys.stdout.write(f"{passed}/{len(verdicts)} targets met\n")
    note = contended_note(_shares)
    if note is not None:
        sys.stdout.write(note + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
