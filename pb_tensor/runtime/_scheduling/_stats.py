"""A model's statistics as Triton's core records them (``InferenceStatsAggregator``) and as
its statistics extension reports them (one ``model_stats`` entry)."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

__all__ = ["Statistics", "merge_metrics"]


class Statistics:
    """Counters and durations (nanoseconds) of one loaded model version.

    Per request (``success`` / ``failure``): its count and duration, the time it waited for
    an instance or a batch (``queue``), and its batch's compute times, as the Python backend
    reports them (``compute_input``: from the batch leaving the queue to ``execute`` being
    called, ``compute_infer``: ``execute`` and its responses, ``compute_output``: from the
    last response to the batch's end). ``inference_count`` adds each successful request's
    batch size (its first dimension for a batching model, else 1); ``execution_count`` counts
    ``execute`` calls, and ``batch_stats`` groups them by the batch's total batch size.
    Thread-safe.
    """

    __slots__ = (
        "_batches",
        "_compute_infer",
        "_compute_input",
        "_compute_output",
        "_execution_count",
        "_fail_count",
        "_fail_ns",
        "_inference_count",
        "_last_inference_ms",
        "_lock",
        "_queue_ns",
        "_success_count",
        "_success_ns",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inference_count = 0
        self._execution_count = 0
        self._last_inference_ms = 0
        self._success_count = 0
        self._success_ns = 0
        self._fail_count = 0
        self._fail_ns = 0
        self._queue_ns = 0
        self._compute_input = 0
        self._compute_infer = 0
        self._compute_output = 0
        # batch size -> [count, compute_input ns, compute_infer ns, compute_output ns]
        self._batches: dict[int, list[int]] = {}

    def execution(
        self, batch_size: int, exec_start: int, compute_start: int, compute_end: int,
        exec_end: int,
    ) -> None:
        """One ``execute`` call of ``batch_size`` (total over its requests); the times are
        ``time.monotonic_ns()`` values (core's ``UpdateInferBatchStats``)."""
        now_ms = time.time_ns() // 1_000_000
        with self._lock:
            self._execution_count += 1
            self._last_inference_ms = max(self._last_inference_ms, now_ms)
            entry = self._batches.get(batch_size)
            if entry is None:
                entry = self._batches[batch_size] = [0, 0, 0, 0]
            entry[0] += 1
            entry[1] += compute_start - exec_start
            entry[2] += compute_end - compute_start
            entry[3] += exec_end - compute_end

    def success(
        self, batch_size: int, request_start: int, exec_start: int, compute_start: int,
        compute_end: int, exec_end: int, request_end: int,
    ) -> None:
        """A request that succeeded (core's ``UpdateSuccess``); ``request_start`` is when it
        arrived and was queued."""
        with self._lock:
            self._inference_count += batch_size
            self._success_count += 1
            self._success_ns += request_end - request_start
            self._queue_ns += exec_start - request_start
            self._compute_input += compute_start - exec_start
            self._compute_infer += compute_end - compute_start
            self._compute_output += exec_end - compute_end

    def batch(self, exec_start: int, exec_end: int, requests: list[tuple[int, int, bool]]
              ) -> None:  # fmt: skip
        """A batch that ran from ``exec_start`` to ``exec_end`` (compute spanning the whole
        execution), and each of its requests' outcome (``(batch_size, request_start,
        failed)``): what :meth:`execution` and then :meth:`success` or :meth:`failure` for
        each request record, under one lock acquisition."""
        now_ms = time.time_ns() // 1_000_000
        infer_ns = exec_end - exec_start
        with self._lock:
            self._execution_count += 1
            self._last_inference_ms = max(self._last_inference_ms, now_ms)
            total = sum(size for size, _, _ in requests)
            entry = self._batches.get(total)
            if entry is None:
                entry = self._batches[total] = [0, 0, 0, 0]
            entry[0] += 1
            entry[2] += infer_ns
            for size, start, failed in requests:
                if failed:
                    self._fail_count += 1
                    self._fail_ns += exec_end - start
                else:
                    self._inference_count += size
                    self._success_count += 1
                    self._success_ns += exec_end - start
                    self._queue_ns += exec_start - start
                    self._compute_infer += infer_ns

    def one_request(
        self, batch_size: int, failed: bool, request_start: int, exec_start: int, exec_end: int
    ) -> None:
        """An ``execute`` call of one request, and that request's success or failure: what
        :meth:`execution` and then :meth:`success` (or :meth:`failure`) record for a batch of
        one whose compute spans the whole execution, under one lock acquisition."""
        now_ms = time.time_ns() // 1_000_000
        infer_ns = exec_end - exec_start
        with self._lock:
            self._execution_count += 1
            self._last_inference_ms = max(self._last_inference_ms, now_ms)
            entry = self._batches.get(batch_size)
            if entry is None:
                entry = self._batches[batch_size] = [0, 0, 0, 0]
            entry[0] += 1
            entry[2] += infer_ns
            if failed:
                self._fail_count += 1
                self._fail_ns += exec_end - request_start
                return
            self._inference_count += batch_size
            self._success_count += 1
            self._success_ns += exec_end - request_start
            self._queue_ns += exec_start - request_start
            self._compute_infer += infer_ns

    def failure(self, request_start: int, request_end: int) -> None:
        """A request that failed, whether it was refused before running or its model
        answered with an error (core's ``UpdateFailure``)."""
        with self._lock:
            self._fail_count += 1
            self._fail_ns += request_end - request_start

    def entry(self, name: str, version: int) -> dict[str, Any]:
        """One ``model_stats`` entry of Triton's statistics extension."""
        with self._lock:
            batches = sorted(self._batches.items())
            return {
                "name": name,
                "version": str(version),
                "last_inference": self._last_inference_ms,
                "inference_count": self._inference_count,
                "execution_count": self._execution_count,
                "inference_stats": {
                    "success": {"count": self._success_count, "ns": self._success_ns},
                    "fail": {"count": self._fail_count, "ns": self._fail_ns},
                    "queue": {"count": self._success_count, "ns": self._queue_ns},
                    "compute_input": {"count": self._success_count, "ns": self._compute_input},
                    "compute_infer": {"count": self._success_count, "ns": self._compute_infer},
                    "compute_output": {"count": self._success_count,
                                       "ns": self._compute_output},
                    "cache_hit": {"count": 0, "ns": 0},
                    "cache_miss": {"count": 0, "ns": 0},
                },
                "response_stats": {},
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": {"count": c, "ns": ci},
                        "compute_infer": {"count": c, "ns": cf},
                        "compute_output": {"count": c, "ns": co},
                    }
                    for size, (c, ci, cf, co) in batches
                ],
                "memory_usage": [],
            }


def _add(into: dict[str, Any], metric: dict[str, Any], kind: str) -> None:
    if kind == "GAUGE":
        into["value"] = metric["value"]
    elif kind == "HISTOGRAM":
        into["count"] += metric["count"]
        into["sum"] += metric["sum"]
        for le, n in metric["buckets"].items():
            into["buckets"][le] = into["buckets"].get(le, 0) + n
    else:
        into["value"] += metric["value"]


def merge_metrics(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The custom metrics of several instances (each stub's ``metric_snapshot()``) as one
    registry holds them in Triton: families by name, a metric per label set, counters and
    histograms summed."""
    merged: dict[str, Any] = {}
    for snapshot in snapshots:
        for name, family in snapshot.items():
            into = merged.setdefault(name, {"description": family["description"],
                                            "kind": family["kind"], "metrics": []})
            for metric in family["metrics"]:
                same = next((m for m in into["metrics"] if m["labels"] == metric["labels"]),
                            None)  # fmt: skip
                if same is None:
                    into["metrics"].append(copy.deepcopy(metric))
                else:
                    _add(same, metric, family["kind"])
    return merged
