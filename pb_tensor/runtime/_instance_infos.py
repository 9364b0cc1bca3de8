"""A model's instances as Triton's core creates them from ``instance_group``: their names,
kinds, devices and the CPUs of their host policies."""

from __future__ import annotations

from typing import Any

from pb_tensor.runtime import _schema
from pb_tensor.runtime._host import HostInfo
from pb_tensor.runtime._host_policy import HostPolicies, cpu_cores, policy_name

__all__ = ["host_infos", "instance_signatures"]


def host_infos(
    config: Any, name: str, version: int, model_dir: str, model_path: str,
    host_policies: HostPolicies,
) -> list[HostInfo]:
    """One ``HostInfo`` per instance, named and placed as Triton's core creates them: each
    group's ``count`` instances ``<group>_<c>``, a ``KIND_GPU`` group's on each of its
    GPUs, with the CPUs of its host policy."""
    infos = []
    config_json = _schema.config_to_json(config)
    decoupled = _schema.decoupled(config)
    for group in config.instance_group:
        kind_enum = group.DESCRIPTOR.fields_by_name["kind"].enum_type
        kind = kind_enum.values_by_number[group.kind].name.removeprefix("KIND_")
        devices = [int(g) for g in group.gpus] if kind == "GPU" else [0]
        for c in range(group.count):
            for device_id in devices:
                policy = host_policies.get(policy_name(kind, group.host_policy, device_id), {})
                cores = policy.get("cpu-cores")
                infos.append(HostInfo(
                    name=name, version=version, model_dir=model_dir, model_path=model_path,
                    instance_name=f"{group.name}_{c}", instance_kind=kind,
                    device_id=device_id, config_json=config_json, decoupled=decoupled,
                    cpus=cpu_cores(cores) if cores else (),
                ))  # fmt: skip
    return infos


def instance_signatures(config: Any) -> list[tuple[bytes, int]]:
    """The signature of each instance :func:`host_infos` gives for ``config``, in its order:
    what an instance update matches existing instances by (core's
    ``TritonModelInstance::Signature``: the group's configuration but for its name and count,
    and the instance's device)."""
    signatures = []
    for group in config.instance_group:
        kind_enum = group.DESCRIPTOR.fields_by_name["kind"].enum_type
        kind = kind_enum.values_by_number[group.kind].name.removeprefix("KIND_")
        devices = [int(g) for g in group.gpus] if kind == "GPU" else [0]
        normalized = type(group)()
        normalized.CopyFrom(group)
        normalized.name = ""
        normalized.count = 1
        key = normalized.SerializeToString(deterministic=True)
        for _ in range(group.count):
            for device_id in devices:
                signatures.append((key, device_id))
    return signatures
