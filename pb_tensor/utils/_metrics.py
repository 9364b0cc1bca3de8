"""Custom metrics: ``pb_utils.MetricFamily`` and its ``Metric`` s, kept in a process registry
that the runtime reads (:func:`metric_snapshot`)."""

from __future__ import annotations

import bisect
import enum
import itertools
import json
import math
import re
import threading
from collections.abc import Mapping
from typing import Any, ClassVar, Final

from pb_tensor.errors import TritonModelException

__all__ = ["Metric", "MetricFamily", "MetricKind", "metric_snapshot", "reset_metrics"]


class MetricKind(enum.IntEnum):
    """``c_python_backend_utils.MetricKind`` (upstream's values)."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2

    def __str__(self) -> str:
        return self.name


# Prometheus' rules (prometheus-cpp CheckMetricName / CheckLabelName).
_METRIC_NAME: Final = re.compile(r"(?!__)[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

_lock = threading.RLock()
_families: dict[str, MetricFamily] = {}


class MetricFamily:
    """A named metric of one kind: ``MetricFamily(name, description, kind)``; its
    ``Metric(labels=None, buckets=None)`` creates one labelled series.

    Raises:
        TypeError: an argument is None or of the wrong type (upstream's pybind signature).
        TritonModelException: ``"Error when creating MetricFamily: ..."`` for a name that is
            not a Prometheus metric name, or a family of that name with another kind (one of
            the same kind is shared, as Prometheus merges them).
    """

    COUNTER: ClassVar[MetricKind] = MetricKind.COUNTER
    GAUGE: ClassVar[MetricKind] = MetricKind.GAUGE
    HISTOGRAM: ClassVar[MetricKind] = MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: MetricKind) -> None:
        if not isinstance(name, str):
            raise TypeError(f"MetricFamily(): name must be a str, got {type(name).__name__}")
        if not isinstance(description, str):
            raise TypeError(
                f"MetricFamily(): description must be a str, got {type(description).__name__}"
            )
        if not isinstance(kind, MetricKind):
            raise TypeError(f"MetricFamily(): kind must be a MetricKind, got {kind!r}")
        self._name = name
        self._description = description
        self._kind = kind
        self._metrics: dict[str, Metric] = {}
        if not _METRIC_NAME.fullmatch(name):
            raise TritonModelException("Error when creating MetricFamily: Invalid metric name")
        with _lock:
            existing = _families.get(name)
            if existing is not None:
                if existing._kind is not kind:
                    raise TritonModelException(
                        "Error when creating MetricFamily: "
                        "Family name already exists with different type"
                    )
                # Prometheus merges same-name families of one kind: the new object reaches
                # the same series, and the first description stays.
                self._description = existing._description
                self._metrics = existing._metrics
            else:
                _families[name] = self

    @property
    def name(self) -> str:
        """The family's name. Typed extra."""
        return self._name

    @property
    def description(self) -> str:
        """The family's description. Typed extra."""
        return self._description

    @property
    def kind(self) -> MetricKind:
        """The family's kind. Typed extra."""
        return self._kind

    def Metric(
        self,
        labels: Mapping[str, str] | None = None,
        buckets: list[float] | None = None,
    ) -> Metric:
        """Create (or reach) the series with ``labels``; histograms need ``buckets``.

        Raises:
            TritonModelException: upstream's "Failed to create metric. ..." messages (labels
                not a dict, buckets not a list, buckets for a counter or gauge, no buckets
                for a histogram), or a label value that is not a str;
                ``"Error when creating Metric: Bucket Boundaries must be strictly sorted"``
                for buckets not in strictly ascending order (prometheus-cpp's rule).
        """
        if labels is not None and not isinstance(labels, dict):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        if buckets is not None:
            if not isinstance(buckets, list):
                raise TritonModelException("Failed to create metric. Buckets must be a list.")
            if self._kind is not MetricKind.HISTOGRAM:
                raise TritonModelException("Failed to create metric. Unexpected buckets found.")
            bounds = [_to_float(b, "Metric(): buckets item") for b in buckets]
            if any(low >= high for low, high in itertools.pairwise(bounds)):
                # prometheus-cpp's Histogram refuses these; Triton wraps its text.
                raise TritonModelException(
                    "Error when creating Metric: Bucket Boundaries must be strictly sorted"
                )
        else:
            if self._kind is MetricKind.HISTOGRAM:
                raise TritonModelException("Failed to create metric. Missing required buckets.")
            bounds = []
        label_map: dict[str, str] = {}
        for key, value in (labels or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                # Upstream fails inside its JSON reader with a less telling text.
                raise TritonModelException(
                    f"Error when creating Metric: label {key!r}: {value!r} must map a str to a str"
                )
            if not _LABEL_NAME.fullmatch(key) or key.startswith("__"):
                raise TritonModelException("Error when creating Metric: Invalid label name")
            label_map[key] = value
        key = json.dumps(label_map, sort_keys=True)
        with _lock:
            metric = self._metrics.get(key)
            if metric is None:
                metric = Metric(_Token.TOKEN, self, label_map, bounds)
                self._metrics[key] = metric
            return metric

    def __repr__(self) -> str:
        return f"MetricFamily({self._name!r}, {self._description!r}, {self._kind.name})"


class _Token(enum.Enum):
    TOKEN = 0


def _to_float(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    return float(value)


class Metric:
    """One labelled series of a :class:`MetricFamily` (made by ``family.Metric(...)``).

    Counters: ``increment``; gauges: ``increment``, ``set``; histograms: ``observe``;
    ``value()`` for counters and gauges.
    """

    def __init__(
        self, token: _Token, family: MetricFamily, labels: dict[str, str], buckets: list[float]
    ) -> None:
        if token is not _Token.TOKEN:
            raise TypeError("Metric objects are created by MetricFamily.Metric(...)")
        self._family = family
        self._labels = labels
        self._buckets = buckets
        self._value = 0.0
        self._sum = 0.0
        self._count = 0
        self._bucket_counts = [0] * (len(buckets) + 1)

    @property
    def labels(self) -> dict[str, str]:
        """The series' labels. Typed extra."""
        return dict(self._labels)

    def increment(self, value: float) -> None:
        """Add ``value`` (counters: not negative).

        Raises:
            TritonModelException: ``"Failed to increment metric value: ..."`` for a histogram
                or a negative counter increment.
        """
        amount = _to_float(value, "Metric.increment(): value")
        kind = self._family.kind
        if kind is MetricKind.HISTOGRAM:
            raise TritonModelException(
                "Failed to increment metric value: "
                "TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Increment"
            )
        if kind is MetricKind.COUNTER and amount < 0:
            raise TritonModelException(
                "Failed to increment metric value: TRITONSERVER_METRIC_KIND_COUNTER can only "
                "be incremented monotonically by non-negative values."
            )
        with _lock:
            self._value += amount

    def set(self, value: float) -> None:
        """Set the value (gauges only).

        Raises:
            TritonModelException: ``"Failed to set metric value: ..."`` for other kinds.
        """
        amount = _to_float(value, "Metric.set(): value")
        if self._family.kind is not MetricKind.GAUGE:
            raise TritonModelException(
                f"Failed to set metric value: TRITONSERVER_METRIC_KIND_{self._family.kind.name} "
                "does not support Set"
            )
        with _lock:
            self._value = amount

    def observe(self, value: float) -> None:
        """Record one observation (histograms only).

        Raises:
            TritonModelException: ``"Failed to observe metric value: ..."`` for other kinds.
        """
        amount = _to_float(value, "Metric.observe(): value")
        if self._family.kind is not MetricKind.HISTOGRAM:
            raise TritonModelException(
                "Failed to observe metric value: "
                f"TRITONSERVER_METRIC_KIND_{self._family.kind.name} does not support Observe"
            )
        with _lock:
            self._count += 1
            self._sum += amount
            # Prometheus buckets are upper-inclusive: value <= bound.
            self._bucket_counts[bisect.bisect_left(self._buckets, amount)] += 1

    def value(self) -> float:
        """The current value (counters and gauges).

        Raises:
            TritonModelException: ``"Failed to get metric value: ..."`` for histograms.
        """
        if self._family.kind is MetricKind.HISTOGRAM:
            raise TritonModelException(
                "Failed to get metric value: TRITONSERVER_METRIC_KIND_HISTOGRAM does not support "
                "Value"
            )
        with _lock:
            return self._value

    def _snapshot(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"labels": dict(self._labels)}
        if self._family.kind is MetricKind.HISTOGRAM:
            cumulative: list[int] = []
            running = 0
            for n in self._bucket_counts:
                running += n
                cumulative.append(running)
            entry["count"] = self._count
            entry["sum"] = self._sum
            entry["buckets"] = {
                **{_bound(b): c for b, c in zip(self._buckets, cumulative, strict=False)},
                "+Inf": cumulative[-1],
            }
        else:
            entry["value"] = self._value
        return entry

    def __repr__(self) -> str:
        return f"Metric(family={self._family.name!r}, labels={self._labels!r})"


def _bound(b: float) -> str:
    return "+Inf" if math.isinf(b) and b > 0 else repr(b)


def metric_snapshot() -> dict[str, dict[str, Any]]:
    """Every family's current values (JSON-ready)::

    {name: {"description": str, "kind": "COUNTER"|"GAUGE"|"HISTOGRAM",
            "metrics": [{"labels": {...}, "value": float}                      # counter, gauge
                        | {"labels": {...}, "count": int, "sum": float,
                           "buckets": {"<le>": cumulative count, ..., "+Inf": n}}]}}
    """
    with _lock:
        return {
            name: {
                "description": family.description,
                "kind": family.kind.name,
                "metrics": [m._snapshot() for m in family._metrics.values()],
            }
            for name, family in _families.items()
        }


def reset_metrics() -> None:
    """Forget every family (the runtime calls it when a model is unloaded in-process)."""
    with _lock:
        _families.clear()
