"""The metrics endpoint (``/metrics`` on ``--metrics-port``) in Prometheus' text format:
Triton's ``nv_inference_*`` families and the models' own ``pb_utils.MetricFamily`` metrics, as
Triton shows python_backend's custom metrics on the same endpoint."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pb_tensor.serve._core import Core

__all__ = ["MetricsApp", "render_metrics"]

Message = MutableMapping[str, Any]


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(
        f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in sorted(labels.items())
    )
    return "{" + inner + "}"


def render_metrics(core: Core) -> str:
    """Prometheus text: Triton's ``nv_inference_*`` families, then every loaded model's
    custom metric families."""
    from pb_tensor.serve._stats import metric_lines

    lines: list[str] = metric_lines(core)
    families: dict[str, dict[str, Any]] = {}
    for model in core.loaded_models():
        for name, family in model.metrics().items():
            merged = families.setdefault(name, {"kind": family.get("kind"),
                                                "description": family.get("description", ""),
                                                "metrics": []})
            merged["metrics"].extend(family.get("metrics", []))
    for name, family in sorted(families.items()):
        kind = str(family["kind"] or "untyped").lower()
        lines.append(f"# HELP {name} {family['description']}")
        lines.append(f"# TYPE {name} {kind}")
        for metric in family["metrics"]:
            value = metric.get("value")
            lines.append(f"{name}{_labels(metric.get('labels', {}))} {value}")
    return "\n".join(lines) + ("\n" if lines else "")


class MetricsApp:
    """ASGI application serving ``GET /metrics``."""

    def __init__(self, core: Core) -> None:
        self._core = core

    async def __call__(self, scope: MutableMapping[str, Any],
                       receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            status, body, ctype = 404, b"", b"text/plain"
        else:
            import asyncio

            loop = asyncio.get_running_loop()
            text = await loop.run_in_executor(None, render_metrics, self._core)
            status, body, ctype = 200, text.encode(), b"text/plain; version=0.0.4"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
