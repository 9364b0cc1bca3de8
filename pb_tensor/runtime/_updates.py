"""When a load of a loaded model reloads a version and when it only updates its instances
(core's ``ModelLifeCycle::AsyncLoad``): per-entry timestamps of a model directory
(``ModelTimestamp``) and the configuration changes that need a reload
(``ConfigChangeRequiresReload``)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

__all__ = [
    "config_change_requires_reload",
    "instance_groups",
    "model_timestamp",
    "model_timestamps",
    "newest_time",
    "version_modified",
]

_CONFIG = "config.pbtxt"


def _newest(path: str) -> int:
    """The newest modification time (ns) of ``path`` and everything under it."""
    newest = os.stat(path).st_mtime_ns
    for root, dirs, files in os.walk(path):
        for entry in (*dirs, *files):
            with contextlib.suppress(OSError):
                newest = max(newest, os.stat(os.path.join(root, entry)).st_mtime_ns)
    return newest


def model_timestamps(path: str) -> dict[str, int]:
    """The timestamps of model directory ``path`` as core's ``ModelTimestamp`` keeps them:
    the directory's own (key ``""``) and, for each entry in it, the newest modification
    time (ns) of the entry and everything under it. Empty when the directory cannot be
    read (every time then counts as 0, as in core)."""
    try:
        stamps = {"": os.stat(path).st_mtime_ns}
        for entry in os.listdir(path):
            with contextlib.suppress(OSError):
                stamps[entry] = _newest(os.path.join(path, entry))
    except OSError:
        return {}
    return stamps


def newest_time(stamps: dict[str, int]) -> int:
    """The newest of :func:`model_timestamps`' times (core's ``GetModifiedTime``): a loaded
    model is reloaded (or updated) only when it grew since it loaded; -1 for none."""
    return max(stamps.values(), default=-1)


def model_timestamp(path: str) -> int:
    """The newest modification time (ns) of model directory ``path`` and everything under
    it: ``newest_time(model_timestamps(path))``; -1 when it cannot be read."""
    return newest_time(model_timestamps(path))


def _version_time(stamps: dict[str, int], version: int) -> int:
    """The newest time of version ``version``'s directory and of the entries that are no
    version directory and not the configuration (core's ``IsModelVersionModified``)."""
    newest = stamps.get(str(version), 0)
    for entry, stamp in stamps.items():
        if entry and not entry.isdigit() and entry != _CONFIG:
            newest = max(newest, stamp)
    return newest


def version_modified(old: dict[str, int], new: dict[str, int], version: int) -> bool:
    """Whether version ``version`` changed between the timestamps ``old`` and ``new``: its
    directory, or a file of the model directory that is no version and not
    ``config.pbtxt`` (a change of the configuration alone does not count)."""
    return _version_time(new, version) > _version_time(old, version)


def config_change_requires_reload(old: Any, new: Any) -> bool:
    """Whether configuration ``new`` differs from ``old`` (both ``ModelConfig`` messages
    as the repository gives them) in more than ``instance_group`` and ``version_policy``:
    only those two change without a reload."""
    a, b = type(old)(), type(new)()
    a.CopyFrom(old)
    b.CopyFrom(new)
    for config in (a, b):
        config.ClearField("instance_group")
        config.ClearField("version_policy")
    return bool(a != b)


def instance_groups(config: Any) -> list[dict[str, Any]]:
    """The ``instance_group`` of ``config`` (a ``ModelConfig`` message) in the
    configuration's JSON form, as ``LoadedModel.update_instance_group`` takes it."""
    from google.protobuf import json_format

    return [json_format.MessageToDict(group, preserving_proto_field_name=True)
            for group in config.instance_group]  # fmt: skip
