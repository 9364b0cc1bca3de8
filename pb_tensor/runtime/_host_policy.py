"""Triton's host policies: ``--host-policy=<policy_name>,<setting>=<value>`` names a policy,
an instance group's ``host_policy`` (by default ``cpu``, ``gpu_<device>`` or ``model`` by its
kind) picks one, and Triton binds the instance's thread to the policy's ``cpu-cores`` before
the backend creates the instance, so python_backend's stub, started from that thread, runs on
those cores (core's ``numa_utils.cc`` and ``backend_model.cc``). Here a stub process binds
all its threads to them before the model's ``initialize``.

Stricter than Triton: ``numa-node`` (a NUMA memory policy through libnuma) is refused,
``cpu-cores`` bounds must be whole numbers (``std::stoi`` takes ``"3x"`` as 3), and a bound
past 65535 is refused (Triton spells the range out and binds whichever CPUs fall in its
1,024-CPU set).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

__all__ = [
    "HostPolicies",
    "HostPolicyError",
    "bind_this_process",
    "check_binding",
    "check_host_policies",
    "cpu_cores",
    "policy_name",
]

HostPolicies = dict[str, dict[str, str]]

_SETTINGS = ("numa-node", "cpu-cores")
# Past any CPU a kernel numbers (Linux's NR_CPUS is at most 8192): refused before a range
# as large as "0-1000000000" is spelt out.
_CPU_LIMIT = 1 << 16
_REFUSED = "Unable to set NUMA thread affinity: Invalid argument"


class HostPolicyError(ValueError):
    """A host policy Triton (or this runtime) refuses; the message is Triton's."""


def check_host_policies(policies: Mapping[str, Mapping[str, str]] | None) -> HostPolicies:
    """A copy of ``policies`` ({policy name: {setting: value}}) once each setting is one
    Triton knows and this runtime applies, and each ``cpu-cores`` parses.

    Raises:
        HostPolicyError: an unknown setting (Triton's message), ``numa-node``, a malformed
            ``cpu-cores``, or ``cpu-cores`` on a platform without ``os.sched_setaffinity``.
        TypeError: not a mapping of mappings of strings.
    """
    checked: HostPolicies = {}
    for name, settings in (policies or {}).items():
        if not isinstance(name, str) or not isinstance(settings, Mapping):
            raise TypeError(
                f"host policies map a policy name to its settings, got {name!r}: {settings!r}"
            )
        checked[name] = {}
        for setting, value in settings.items():
            if not isinstance(setting, str) or not isinstance(value, str):
                raise TypeError(
                    f"host policy {name!r}: settings and values are strings, got "
                    f"{setting!r}={value!r}"
                )
            if setting not in _SETTINGS:
                raise HostPolicyError(
                    f"Unsupported host policy setting '{setting}' is specified, supported "
                    "settings are 'numa-node', 'cpu-cores'"
                )
            if setting == "numa-node":
                raise HostPolicyError(
                    f"host policy {name!r}: setting 'numa-node' is not supported here (no "
                    "NUMA memory binding); bind to the node's cores with 'cpu-cores'"
                )
            cpu_cores(value)
            if not hasattr(os, "sched_setaffinity"):
                raise HostPolicyError(
                    f"host policy {name!r}: 'cpu-cores' needs os.sched_setaffinity, which "
                    "this platform does not have"
                )
            checked[name][setting] = value
    return checked


def _int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise HostPolicyError(
            f"Parsing 'cpu-cores' value: Can't parse '{text}' to integer"
        ) from None
    if not 0 <= value < _CPU_LIMIT:  # the kernel's answer to such a CPU
        raise HostPolicyError(_REFUSED)
    return value


def cpu_cores(value: str) -> tuple[int, ...]:
    """The CPUs of a ``cpu-cores`` value: comma-separated ``<lower>-<upper>`` ranges, as
    core's ``SetNumaThreadAffinity`` reads them (a lone ``3`` is refused there too).

    Raises:
        HostPolicyError: a part without ``-`` or with a bound that is not a whole number
            (Triton's messages); a negative or enormous bound, or no CPU at all (a range
            whose lower bound is past its upper one): the kernel's refusal, as Triton
            reports it.
    """
    cpus: list[int] = []
    for part in value.split(","):
        lower, dash, upper = part.partition("-")
        if not dash:
            raise HostPolicyError(
                "host policy setting 'cpu-cores' format is "
                f"'<lower_cpu_core_id>-<upper_cpu_core_id>'. Got {part}"
            )
        cpus.extend(range(_int(lower), _int(upper) + 1))
    if not cpus:
        raise HostPolicyError(_REFUSED)
    return tuple(cpus)


def policy_name(kind: str, group_policy: str, device_id: int) -> str:
    """The host policy an instance of an instance group uses: the group's ``host_policy``,
    else ``cpu``, ``gpu_<device>`` or ``model`` by its kind (core's ``backend_model.cc``)."""
    if group_policy:
        return group_policy
    if kind == "GPU":
        return f"gpu_{device_id}"
    return "model" if kind == "MODEL" else "cpu"


def bind_this_process(cpus: tuple[int, ...]) -> None:
    """Bind every thread of this process to ``cpus`` (threads started later inherit it from
    the thread that starts them).

    Raises:
        HostPolicyError: the kernel refused the set (Triton's message with the OS's reason,
            as for a CPU this machine does not have).
    """
    try:
        tasks = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tasks = [0]
    for task in tasks:
        try:
            os.sched_setaffinity(task, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as exc:
            raise HostPolicyError(
                f"Unable to set NUMA thread affinity: {exc.strerror}"
            ) from None


def check_binding(cpus: tuple[int, ...]) -> None:
    """Whether the kernel lets a thread bind to ``cpus``, tried on a short-lived thread of
    its own (an in-process instance is not bound, but a set Triton's binding would fail on
    fails its load here too).

    Raises:
        HostPolicyError: the kernel refused the set (Triton's message with the OS's reason).
    """
    refused: list[str] = []

    def attempt() -> None:
        try:
            os.sched_setaffinity(0, cpus)  # this thread only
        except OSError as exc:
            refused.append(str(exc.strerror))

    thread = threading.Thread(target=attempt, name="pb-tensor-host-policy-check")
    thread.start()
    thread.join()
    if refused:
        raise HostPolicyError(f"Unable to set NUMA thread affinity: {refused[0]}")
