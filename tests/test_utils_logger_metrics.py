"""pb_tensor.utils: Logger (records in Python logging) and custom metrics."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from pb_tensor import utils as pb_utils
from pb_tensor.utils import _context

# -- Logger -------------------------------------------------------------------------------------


def test_log_levels_values() -> None:
    assert [int(v) for v in pb_utils.LogLevel] == [0, 1, 2, 3]
    assert pb_utils.Logger.LogLevel is pb_utils.LogLevel
    assert pb_utils.Logger.VERBOSE is pb_utils.LogLevel.VERBOSE


def test_logger_records(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=_context.LOGGER_NAME)
    logger = pb_utils.Logger
    logger.log_info("info msg")
    logger.log_warn("warn msg")
    logger.log_error("error msg")
    logger.log_verbose("verbose msg")
    logger.log("default level")
    logger.log("explicit", logger.LogLevel.ERROR)
    logger.log("kw", level=pb_utils.LogLevel.WARNING)
    logger.log("class constant", logger.VERBOSE)  # upstream models write logger.INFO etc.
    got = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    name = _context.LOGGER_NAME
    assert got == [
        (name, logging.INFO, "info msg"),
        (name, logging.WARNING, "warn msg"),
        (name, logging.ERROR, "error msg"),
        (name, logging.DEBUG, "verbose msg"),
        (name, logging.INFO, "default level"),
        (name, logging.ERROR, "explicit"),
        (name, logging.WARNING, "kw"),
        (name, logging.DEBUG, "class constant"),
    ]
    assert [r.triton_log_level for r in caplog.records][:4] == [  # type: ignore[attr-defined]
        pb_utils.LogLevel.INFO,
        pb_utils.LogLevel.WARNING,
        pb_utils.LogLevel.ERROR,
        pb_utils.LogLevel.VERBOSE,
    ]
    # The record names the model's line, as upstream's inspect-based file:line does.
    assert {r.filename for r in caplog.records} == {"test_utils_logger_metrics.py"}
    assert all(r.funcName == "test_logger_records" for r in caplog.records)


def test_logger_child_per_served_model(caplog: pytest.LogCaptureFixture) -> None:
    class Backend:
        def model_name(self) -> str:
            return "add_sub"

    caplog.set_level(logging.INFO, logger=_context.LOGGER_NAME)
    previous = _context.set_backend(Backend())  # type: ignore[arg-type]
    try:
        pb_utils.Logger.log_info("hello")
    finally:
        _context.set_backend(previous)
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        (_context.LOGGER_NAME + ".add_sub", "hello")
    ]


def test_logger_type_errors() -> None:
    with pytest.raises(TypeError) as e:
        pb_utils.Logger.log_info(3)  # type: ignore[arg-type]
    assert str(e.value) == "Logger.log_info(): message must be a str, got int"
    with pytest.raises(TypeError) as e:
        pb_utils.Logger.log("x", 0)  # type: ignore[arg-type]
    assert str(e.value) == "Logger.log(): level must be a Logger.LogLevel, got 0"


# -- metrics ------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_metrics() -> Iterator[None]:
    _context.reset_metrics()
    yield
    _context.reset_metrics()


def _failure(call: Any) -> str:
    with pytest.raises(pb_utils.TritonModelException) as e:
        call()
    return str(e.value)


def test_metric_kinds() -> None:
    assert pb_utils.MetricFamily.COUNTER is pb_utils.MetricKind.COUNTER
    assert [int(k) for k in pb_utils.MetricKind] == [0, 1, 2]


def test_counter() -> None:
    family = pb_utils.MetricFamily("requests_total", "Requests", pb_utils.MetricFamily.COUNTER)
    m = family.Metric(labels={"model": "m", "version": "1"})
    m.increment(2)
    m.increment(0.5)
    assert m.value() == 2.5
    assert family.Metric(labels={"version": "1", "model": "m"}) is m  # same series
    assert family.Metric() is not m
    assert _failure(lambda: m.increment(-1)) == (
        "Failed to increment metric value: TRITONSERVER_METRIC_KIND_COUNTER can only be "
        "incremented monotonically by non-negative values."
    )
    assert _failure(lambda: m.set(1)) == (
        "Failed to set metric value: TRITONSERVER_METRIC_KIND_COUNTER does not support Set"
    )
    assert _failure(lambda: m.observe(1)) == (
        "Failed to observe metric value: TRITONSERVER_METRIC_KIND_COUNTER does not support "
        "Observe"
    )


def test_gauge() -> None:
    m = pb_utils.MetricFamily("queue", "Queue", pb_utils.MetricFamily.GAUGE).Metric()
    m.set(5)
    m.increment(-2)
    assert m.value() == 3.0
    assert _failure(lambda: m.observe(1)) == (
        "Failed to observe metric value: TRITONSERVER_METRIC_KIND_GAUGE does not support Observe"
    )


def test_histogram() -> None:
    family = pb_utils.MetricFamily("latency", "Latency", pb_utils.MetricFamily.HISTOGRAM)
    m = family.Metric(labels={"k": "v"}, buckets=[0.1, 1.0, 10.0])
    for v in (0.05, 0.1, 0.5, 20.0):
        m.observe(v)
    assert _failure(m.value) == (
        "Failed to get metric value: TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Value"
    )
    assert _failure(lambda: m.increment(1)) == (
        "Failed to increment metric value: TRITONSERVER_METRIC_KIND_HISTOGRAM does not support "
        "Increment"
    )
    assert _failure(lambda: m.set(1)) == (
        "Failed to set metric value: TRITONSERVER_METRIC_KIND_HISTOGRAM does not support Set"
    )
    snap = _context.metric_snapshot()["latency"]
    assert snap == {
        "description": "Latency",
        "kind": "HISTOGRAM",
        "metrics": [
            {
                "labels": {"k": "v"},
                "count": 4,
                "sum": pytest.approx(20.65),
                "buckets": {"0.1": 2, "1.0": 3, "10.0": 3, "+Inf": 4},
            }
        ],
    }


def test_metric_creation_errors() -> None:
    counter = pb_utils.MetricFamily("c", "c", pb_utils.MetricFamily.COUNTER)
    hist = pb_utils.MetricFamily("h", "h", pb_utils.MetricFamily.HISTOGRAM)
    assert _failure(lambda: counter.Metric(labels=[("a", "b")])) == (  # type: ignore[arg-type]
        "Failed to create metric. Labels must be a dictionary."
    )
    assert _failure(lambda: hist.Metric(buckets=(1.0,))) == (  # type: ignore[arg-type]
        "Failed to create metric. Buckets must be a list."
    )
    assert _failure(lambda: counter.Metric(buckets=[1.0])) == (
        "Failed to create metric. Unexpected buckets found."
    )
    assert _failure(hist.Metric) == "Failed to create metric. Missing required buckets."
    assert _failure(lambda: counter.Metric(labels={"bad-name": "x"})) == (
        "Error when creating Metric: Invalid label name"
    )
    assert _failure(lambda: counter.Metric(labels={"a": 1})) == (  # type: ignore[dict-item]
        "Error when creating Metric: label 'a': 1 must map a str to a str"
    )


def test_histogram_buckets_must_be_strictly_ascending() -> None:
    # qa custom_metrics' test_histogram_args: unsorted and repeated bounds raise, [] does not.
    hist = pb_utils.MetricFamily("h_order", "h", pb_utils.MetricFamily.HISTOGRAM)
    for buckets in ([2.5, 0.1, 1.0, 10.0, 5.0], [1, 1, 2, 5, 5]):
        assert _failure(lambda b=buckets: hist.Metric(labels={}, buckets=b)) == (
            "Error when creating Metric: Bucket Boundaries must be strictly sorted"
        )
    assert hist.Metric(labels={}, buckets=[]).labels == {}


def test_family_errors_and_sharing() -> None:
    first = pb_utils.MetricFamily("shared", "first", pb_utils.MetricFamily.GAUGE)
    first.Metric().set(4)
    again = pb_utils.MetricFamily("shared", "second", pb_utils.MetricFamily.GAUGE)
    assert again.Metric().value() == 4.0  # Prometheus merges same-name, same-kind families
    assert again.description == "first"
    assert _failure(
        lambda: pb_utils.MetricFamily("shared", "x", pb_utils.MetricFamily.COUNTER)
    ) == "Error when creating MetricFamily: Family name already exists with different type"
    assert _failure(
        lambda: pb_utils.MetricFamily("1bad", "x", pb_utils.MetricFamily.COUNTER)
    ) == "Error when creating MetricFamily: Invalid metric name"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            (None, "d", pb_utils.MetricKind.GAUGE),
            "MetricFamily(): name must be a str, got NoneType",
        ),
        (("n", None, pb_utils.MetricKind.GAUGE),
         "MetricFamily(): description must be a str, got NoneType"),
        (("n", "d", 1), "MetricFamily(): kind must be a MetricKind, got 1"),
    ],
)
def test_family_type_errors(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(TypeError) as e:
        pb_utils.MetricFamily(*args)
    assert str(e.value) == message


def test_metric_value_type_error() -> None:
    m = pb_utils.MetricFamily("g", "g", pb_utils.MetricFamily.GAUGE).Metric()
    with pytest.raises(TypeError) as e:
        m.set("1")  # type: ignore[arg-type]
    assert str(e.value) == "Metric.set(): value must be a number, got str"


def test_metric_not_constructible_directly() -> None:
    family = pb_utils.MetricFamily("g", "g", pb_utils.MetricFamily.GAUGE)
    with pytest.raises(TypeError) as e:
        pb_utils.Metric(None, family, {}, [])  # type: ignore[arg-type]
    assert str(e.value) == "Metric objects are created by MetricFamily.Metric(...)"


def test_snapshot() -> None:
    c = pb_utils.MetricFamily("c_total", "Count", pb_utils.MetricFamily.COUNTER)
    c.Metric(labels={"a": "1"}).increment(3)
    c.Metric(labels={"a": "2"}).increment(1)
    assert _context.metric_snapshot() == {
        "c_total": {
            "description": "Count",
            "kind": "COUNTER",
            "metrics": [
                {"labels": {"a": "1"}, "value": 3.0},
                {"labels": {"a": "2"}, "value": 1.0},
            ],
        }
    }
    _context.reset_metrics()
    assert _context.metric_snapshot() == {}
