"""Triton's schedulers for a loaded model: its instances (:class:`InstanceSet`), the dynamic
batcher (:class:`DynamicBatcher`), the sequence batcher (:class:`SequenceBatcher`) and the
statistics they record (:class:`Statistics`)."""

from __future__ import annotations

from pb_tensor.runtime._scheduling._batch_policy import BatchPolicy, batch_policy
from pb_tensor.runtime._scheduling._batcher import DynamicBatcher
from pb_tensor.runtime._scheduling._instances import Instance, InstanceFactory, InstanceSet
from pb_tensor.runtime._scheduling._scheduler import Scheduler, unloaded_error
from pb_tensor.runtime._scheduling._sequence import SequenceBatcher
from pb_tensor.runtime._scheduling._sequence_policy import SequencePolicy, sequence_policy
from pb_tensor.runtime._scheduling._stats import Statistics, merge_metrics

__all__ = [
    "BatchPolicy",
    "DynamicBatcher",
    "Instance",
    "InstanceFactory",
    "InstanceSet",
    "Scheduler",
    "SequenceBatcher",
    "SequencePolicy",
    "Statistics",
    "batch_policy",
    "merge_metrics",
    "sequence_policy",
    "unloaded_error",
]
