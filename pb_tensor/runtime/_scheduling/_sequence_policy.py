"""The configuration of Triton's sequence batcher (the ``sequence_batching`` section, as
core's ``sequence_batch_scheduler.cc`` reads it): strategy, slots, delays, control inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Control", "SequencePolicy", "sequence_policy"]

_DEFAULT_IDLE_US = 1_000_000  # model_config_utils.cc: max_sequence_idle_microseconds 0


@dataclass(frozen=True)
class Control:
    """One control input: its tensor name, kind (``CONTROL_SEQUENCE_START`` ...), numpy
    dtype and the (false, true) values (CORRID: the correlation id's type)."""

    name: str
    kind: str
    dtype: Any
    values: tuple[Any, Any]


@dataclass(frozen=True)
class SequencePolicy:
    """What the ``sequence_batching`` section of a configuration asks for."""

    oldest: bool
    slots: int
    max_batch: int
    batching: bool
    preferred: frozenset[int]
    delay_ns: int
    min_utilization: float  # Direct's minimum_slot_utilization
    idle_ns: int
    iterative: bool
    controls: tuple[Control, ...]
    equal_shape: frozenset[str]  # inputs whose shapes the requests of a batch share
    corrid_type: str | None  # the CORRID control's data_type, when configured


_CORRID_DTYPES = {
    "TYPE_UINT64": np.uint64, "TYPE_INT64": np.int64, "TYPE_UINT32": np.uint32,
    "TYPE_INT32": np.int32, "TYPE_STRING": np.object_,
}  # fmt: skip


def _control(name: str, spec: dict[str, Any]) -> Control:
    kind = str(spec.get("kind", "CONTROL_SEQUENCE_START"))
    if kind == "CONTROL_SEQUENCE_CORRID":
        data_type = str(spec.get("data_type", "TYPE_UINT64"))
        return Control(name, kind, _CORRID_DTYPES.get(data_type, np.uint64), (data_type, None))
    for key, dtype in (("int32_false_true", np.int32), ("fp32_false_true", np.float32),
                       ("bool_false_true", np.bool_)):  # fmt: skip
        pair = spec.get(key)
        if pair:
            return Control(name, kind, dtype, (dtype(pair[0]), dtype(pair[1])))
    return Control(name, kind, np.int32, (np.int32(0), np.int32(1)))


def sequence_policy(config: dict[str, Any]) -> SequencePolicy | None:
    """The sequence batcher's policy for a completed configuration (JSON form); None
    without ``sequence_batching``."""
    section = config.get("sequence_batching")
    if not isinstance(section, dict):
        return None
    max_batch_size = int(config.get("max_batch_size", 0) or 0)
    oldest = isinstance(section.get("oldest"), dict)
    strategy: dict[str, Any] = section.get("oldest" if oldest else "direct") or {}
    if oldest:
        slots = int(strategy.get("max_candidate_sequences", 0) or 0) or 1
    else:
        slots = max(1, max_batch_size)
    controls: list[Control] = []
    for item in section.get("control_input", ()) or ():
        for spec in item.get("control", ()) or ():
            controls.append(_control(str(item["name"]), spec))
    corrid = [c for c in controls if c.kind == "CONTROL_SEQUENCE_CORRID"]
    idle = int(section.get("max_sequence_idle_microseconds", 0) or 0) or _DEFAULT_IDLE_US
    equal = frozenset(
        str(io["name"]) for io in config.get("input", ())
        if io.get("is_shape_tensor")
        or (-1 in [int(d) for d in io.get("dims", ())] and not io.get("allow_ragged_batch"))
    )
    return SequencePolicy(
        oldest=oldest,
        slots=slots,
        max_batch=max(1, max_batch_size),
        batching=max_batch_size > 0,
        preferred=frozenset(int(s) for s in strategy.get("preferred_batch_size", ()) or ()),
        delay_ns=int(strategy.get("max_queue_delay_microseconds", 0) or 0) * 1000,
        min_utilization=float(strategy.get("minimum_slot_utilization", 0) or 0),
        idle_ns=idle * 1000,
        iterative=bool(section.get("iterative_sequence", False)),
        controls=tuple(controls),
        equal_shape=equal,
        corrid_type=str(corrid[0].values[0]) if corrid else None,
    )
