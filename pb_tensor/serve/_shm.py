"""Triton's system shared-memory extension: regions of POSIX shared memory a client registers
by name; inputs are read from them and outputs written into them instead of travelling through
the socket (Triton's texts for every refusal)."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import Any

from pb_tensor.serve._errors import ALREADY_EXISTS, INTERNAL, INVALID_ARG, NOT_FOUND, ServeError

__all__ = ["Regions", "shm_input", "shm_output", "shm_target"]

_RESERVED = "pb_tensor_"  # the runtime's own pools: never a client's region


class _Region:
    __slots__ = ("byte_size", "key", "map", "offset")

    def __init__(self, key: str, offset: int, byte_size: int, mapped: mmap.mmap) -> None:
        self.key = key
        self.offset = offset
        self.byte_size = byte_size
        self.map = mapped


class Regions:
    """The registered system shared-memory regions (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, _Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes at ``offset`` of the shared memory object ``key``.

        Raises:
            ServeError: the name is taken, the object cannot be opened, or is too small.
        """
        if not name:
            raise ServeError("'region name' is necessary to register system shared memory "
                             "region")
        if key.lstrip("/").startswith(_RESERVED):
            raise ServeError(f"failed to register shared memory region '{name}': key '{key}' "
                             "is reserved for pb-tensor's own pools")
        with self._lock:
            if name in self._regions:
                raise ServeError(f"shared memory region '{name}' already in manager",
                                 ALREADY_EXISTS)
            path = os.path.join("/dev/shm", key.lstrip("/"))
            if "/" in key.lstrip("/"):
                raise ServeError(f"Unable to open shared memory region: '{key}'", INTERNAL)
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                raise ServeError(f"Unable to open shared memory region: '{key}'",
                                 INTERNAL) from None
            try:
                size = os.fstat(fd).st_size
                if offset < 0 or byte_size <= 0 or offset + byte_size > size:
                    raise ServeError(f"failed to register shared memory region '{name}': "
                                     "invalid args")
                mapped = mmap.mmap(fd, offset + byte_size)
            finally:
                os.close(fd)
            self._regions[name] = _Region(key, offset, byte_size, mapped)

    def status(self, name: str) -> list[dict[str, Any]]:
        """Triton's status entries: every region (``name`` "") or one.

        Raises:
            ServeError: no region of that name.
        """
        with self._lock:
            if name and name not in self._regions:
                raise ServeError(f"Unable to find system shared memory region: '{name}'",
                                 NOT_FOUND)
            names = [name] if name else sorted(self._regions)
            return [{"name": n, "key": self._regions[n].key, "offset": self._regions[n].offset,
                     "byte_size": self._regions[n].byte_size} for n in names]

    def unregister(self, name: str) -> None:
        """Forget one region (``name`` "": every region); an unknown name is no error."""
        with self._lock:
            names = [name] if name else list(self._regions)
            regions = [self._regions.pop(n) for n in names if n in self._regions]
        for region in regions:
            with contextlib.suppress(BufferError):  # still read: unmapped when it lets go
                region.map.close()

    def view(self, name: str, offset: int, byte_size: int) -> memoryview:
        """``byte_size`` bytes at ``offset`` of region ``name`` (Triton's checks).

        Raises:
            ServeError: no such region, or the range is outside it.
        """
        with self._lock:
            region = self._regions.get(name)
            if region is None:
                raise ServeError(f"Unable to find shared memory region: '{name}'", NOT_FOUND)
            if offset >= region.byte_size:
                raise ServeError(f"Invalid offset for shared memory region: '{name}'",
                                 INVALID_ARG)
            if offset + byte_size > region.byte_size:
                raise ServeError(
                    f"Invalid offset + byte size for shared memory region: '{name}'",
                    INVALID_ARG)
            start = region.offset + offset
            return memoryview(region.map)[start:start + byte_size]

    def close(self) -> None:
        """Unregister every region."""
        self.unregister("")


def shm_input(regions: Regions, name: str, region: Any, offset: Any, byte_size: Any
              ) -> bytearray:
    """The bytes of input ``name`` from a region, copied (the model may write into its
    input; the client's region stays as it sent it).

    Raises:
        ServeError: malformed parameters, or Triton's region errors.
    """
    if not isinstance(region, str):
        raise ServeError("Unable to parse 'shared_memory_region': attempt to access JSON "
                         "non-string as string")
    for what, value in (("shared_memory_offset", offset), ("shared_memory_byte_size",
                                                           byte_size)):
        if type(value) is not int or value < 0:
            raise ServeError(f"Unable to parse '{what}': attempt to access JSON "
                             "non-unsigned-integer as unsigned-integer")
    return bytearray(regions.view(region, offset, byte_size))


def shm_output(regions: Regions, name: str, target: tuple[str, int, int],
               blob: bytes | memoryview) -> dict[str, Any]:
    """Write output ``name`` into its region; the output's response parameters.

    Raises:
        ServeError: the region is too small for the output (Triton's text), or gone.
    """
    region, offset, byte_size = target
    if len(blob) > byte_size:
        raise ServeError(
            f"shared memory size specified with the request for output '{name}' ({byte_size} "
            f"bytes) should be at least {len(blob)} bytes to hold the results", INTERNAL)
    view = regions.view(region, offset, byte_size)
    view[:len(blob)] = blob
    view.release()
    parameters: dict[str, Any] = {"shared_memory_region": region,
                                  "shared_memory_byte_size": len(blob)}
    if offset:
        parameters["shared_memory_offset"] = offset
    return parameters


def shm_target(params: Any, name: str) -> tuple[str, int, int] | None:
    """The (region, offset, byte size) an output's parameters name, if any.

    Raises:
        ServeError: malformed parameters.
    """
    if "shared_memory_region" not in params:
        return None
    region = params["shared_memory_region"]
    offset = params.get("shared_memory_offset", 0)
    byte_size = params.get("shared_memory_byte_size", 0)
    if not isinstance(region, str):
        raise ServeError("Unable to parse 'shared_memory_region': attempt to access JSON "
                         "non-string as string")
    for what, value in (("shared_memory_offset", offset), ("shared_memory_byte_size",
                                                           byte_size)):
        if type(value) is not int or value < 0:
            raise ServeError(f"Unable to parse '{what}': attempt to access JSON "
                             "non-unsigned-integer as unsigned-integer")
    return region, offset, byte_size
