"""Statistics (Triton's statistics extension) and Triton's ``nv_inference_*`` metrics, from
what the runtime records: ``LoadedModel.statistics()`` gives Triton's statistics entry of one
model version; the front door only exposes it."""

from __future__ import annotations

from typing import Any

from pb_tensor.runtime import LoadedModel
from pb_tensor.serve._core import Core, parse_version

__all__ = ["metric_lines", "statistics"]


def _entry(model: LoadedModel) -> dict[str, Any]:
    return model.statistics()


def statistics(core: Core, name: str, version: str) -> list[dict[str, Any]]:
    """The statistics entries of every loaded model version (``name`` ""), of every version
    of model ``name`` the server serves (``version`` ""), or of one model version.

    Raises:
        ServeError: an unknown model or version (Triton's messages).
    """
    if not name:
        if version:
            parse_version(version)
        return [_entry(m) for m in sorted(core.loaded_models(),
                                          key=lambda m: (m.name, m.version))]  # fmt: skip
    model = core.model(name, version)
    if version:
        return [_entry(model)]
    return [_entry(m) for m in sorted((m for m in core.loaded_models() if m.name == name),
                                      key=lambda m: m.version)]  # fmt: skip


_COUNTERS = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch "
     "sizes", ("inference_stats", "success", "count"), 1),
    ("nv_inference_request_failure", "Number of failed inference requests, all batch sizes",
     ("inference_stats", "fail", "count"), 1),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)",
     ("inference_count",), 1),
    ("nv_inference_exec_count", "Number of model executions performed (does not include "
     "cached requests)", ("execution_count",), 1),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in "
     "microseconds (includes cached requests)", ("inference_stats", "success", "ns"), 1000),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds "
     "(includes cached requests)", ("inference_stats", "queue", "ns"), 1000),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in "
     "microseconds (does not include cached requests)",
     ("inference_stats", "compute_input", "ns"), 1000),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in "
     "microseconds (does not include cached requests)",
     ("inference_stats", "compute_infer", "ns"), 1000),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration "
     "in microseconds (does not include cached requests)",
     ("inference_stats", "compute_output", "ns"), 1000),
)


def _value(entry: dict[str, Any], path: tuple[str, ...]) -> int:
    node: Any = entry
    for key in path:
        node = node.get(key, {}) if isinstance(node, dict) else {}
    return int(node) if isinstance(node, (int, float)) else 0


def metric_lines(core: Core) -> list[str]:
    """Triton's ``nv_inference_*`` families for every loaded model version."""
    models = sorted(core.loaded_models(), key=lambda m: (m.name, m.version))
    entries = [(m, _entry(m)) for m in models]
    lines: list[str] = []
    for family, text, path, divisor in _COUNTERS:
        if not entries:
            break
        lines.append(f"# HELP {family} {text}")
        lines.append(f"# TYPE {family} counter")
        for model, entry in entries:
            reason = ',reason="BACKEND"' if family == "nv_inference_request_failure" else ""
            lines.append(f'{family}{{model="{model.name}"{reason},version="{model.version}"}} '
                         f"{_value(entry, path) // divisor}")
    if models:
        lines.append("# HELP nv_inference_pending_request_count Instantaneous number of "
                     "pending requests awaiting execution per-model.")
        lines.append("# TYPE nv_inference_pending_request_count gauge")
        for model in models:
            lines.append(f'nv_inference_pending_request_count{{model="{model.name}",'
                         f'version="{model.version}"}} {core.pending(model)}')
    return lines
