"""The POSIX shared-memory segment under a pool: naming, creation, opening, mapping (private).

Segments are files under ``/dev/shm`` opened with ``os.open``, which is what ``shm_open`` does
on Linux. :class:`multiprocessing.shared_memory.SharedMemory` is not used on purpose: it
registers every segment with ``multiprocessing``'s ``resource_tracker``, which unlinks
segments other processes still use (cpython#82300; ``track=False`` exists only from 3.13).

*Sealed* segments cannot shrink: a process that truncates a segment under the others' mappings
makes their next access a SIGBUS, and only a file seal (``F_SEAL_SHRINK``, on a ``memfd``)
makes truncation impossible. ``tmpfs`` files under ``/dev/shm`` cannot be sealed, so a sealed
segment is a ``memfd`` published by name as a symbolic link ``/dev/shm/<name>`` ->
``/proc/<creator pid>/fd/<fd>``: opening the name opens the memfd, for as long as the creator
holds it. Attaching checks that the link still leads to the memfd of that name (not to a
descriptor of an unrelated process that reused the pid).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import re
import secrets
import stat
import sys
from typing import Final

import numpy as np
import numpy.typing as npt

from pb_tensor.errors import TritonModelException
from pb_tensor.shm import _heap as heap

SHM_DIR: Final = "/dev/shm"
"""Where POSIX shared-memory objects live on Linux (``shm_open`` opens files here)."""

DOCKER_HINT: Final = (
    "If you are running inside docker, use the '--shm-size' flag to control the shared "
    "memory region size."
)
PAGE: Final = mmap.PAGESIZE
_MAP_POPULATE: Final = int(getattr(mmap, "MAP_POPULATE", 0))
# MADV_POPULATE_WRITE (Linux >= 5.14) pre-faults a range writable. Python has no constant for
# it; older kernels answer EINVAL and the pages fault in on first touch instead.
_MADV_POPULATE_WRITE: Final = 23
_NAME_MAX: Final = 200  # leaves room for the temporary ".<name>.<token>" under NAME_MAX (255)
_MEMFD_PREFIX: Final = "pb_tensor:"
_F_ADD_SEALS: Final = int(getattr(fcntl, "F_ADD_SEALS", 0))
_F_GET_SEALS: Final = int(getattr(fcntl, "F_GET_SEALS", 0))
_F_SEAL_SHRINK: Final = int(getattr(fcntl, "F_SEAL_SHRINK", 0))
_F_SEAL_SEAL: Final = int(getattr(fcntl, "F_SEAL_SEAL", 0))
_PROC_FD = re.compile(r"/proc/([0-9]+)/fd/([0-9]+)")


def sealing_supported() -> bool:
    """Whether this system can make sealed segments (Linux: memfd, seals and ``/proc``)."""
    return bool(_F_ADD_SEALS and hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"))


def round_up(value: int, step: int) -> int:
    """``value`` rounded up to a multiple of ``step``."""
    return -(-value // step) * step


def shm_available() -> int:
    """Bytes an unprivileged process can still allocate in ``/dev/shm``."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def check_name(name: str) -> str:
    """``name`` if it is usable as a segment name.

    Raises:
        TritonModelException: not a str, empty, too long, or containing '/' or NUL, or
            starting with '.' (reserved for segments being created).
    """
    if not isinstance(name, str):
        raise TritonModelException(f"Shared memory pool name must be a str, not {type(name)!r}")
    if (
        not name
        or name.startswith(".")
        or "/" in name
        or "\x00" in name
        or len(name.encode("utf-8", "surrogateescape")) > _NAME_MAX
    ):
        raise TritonModelException(
            f"Invalid shared memory pool name {name!r}: use 1 to {_NAME_MAX} bytes, no '/', "
            "no NUL and no leading '.'"
        )
    return name


def positive_int(value: object, what: str) -> int:
    """``value`` if it is a positive int (not a bool).

    Raises:
        TritonModelException: it is not.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TritonModelException(f"{what} must be an int, not {type(value).__name__}")
    if value <= 0:
        raise TritonModelException(f"{what} must be positive, got {value}")
    return value


def create_segment(name: str, size: int, growth: int, max_size: int, sealed: bool) -> int:
    """Create and initialise segment ``name`` of ``size`` bytes; its descriptor.

    The segment is built under a temporary name (or as an anonymous memfd when ``sealed``)
    and linked into place once initialised, so an attacher never sees a half-written header
    (the link also fails if the name exists).

    Raises:
        TritonModelException: ``/dev/shm`` lacks the room (requested and available sizes in
            the message), or the name is taken.
    """
    available = shm_available()
    if size > available:
        raise TritonModelException(
            f"Unable to initialize shared memory key '{name}' to requested size ({size} "
            f"bytes): only {available} bytes are available in {SHM_DIR}. " + DOCKER_HINT
        )
    if sealed:
        return _create_sealed(name, size, growth, max_size)
    path = os.path.join(SHM_DIR, name)
    tmp = os.path.join(SHM_DIR, f".{name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            raise TritonModelException(
                f"Unable to initialize shared memory key '{name}' to requested size ({size} "
                f"bytes): {exc.strerror}. " + DOCKER_HINT
            ) from exc
        heap.init_heap(fd, size, growth, max_size)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise TritonModelException(f"Shared memory pool '{name}' already exists") from None
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(tmp)
    return fd


def _create_sealed(name: str, size: int, growth: int, max_size: int) -> int:
    fd = os.memfd_create(_MEMFD_PREFIX + name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            raise TritonModelException(
                f"Unable to initialize shared memory key '{name}' to requested size ({size} "
                f"bytes): {exc.strerror}. " + DOCKER_HINT
            ) from exc
        heap.init_heap(fd, size, growth, max_size)
        # F_SEAL_SEAL too: nobody may add F_SEAL_GROW or F_SEAL_WRITE later.
        fcntl.fcntl(fd, _F_ADD_SEALS, _F_SEAL_SHRINK | _F_SEAL_SEAL)
        _publish(name, f"/proc/{os.getpid()}/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _publish(name: str, target: str) -> None:
    # Exclusive: symlink() fails if anything is at the name. An entry already there is never
    # removed, not even a link that looks like one of ours left by a dead creator: nothing in a
    # link proves who made it, and a check of it followed by an unlink could remove an entry
    # someone else put there in between.
    path = os.path.join(SHM_DIR, name)
    try:
        os.symlink(target, path)
    except FileExistsError:
        raise TritonModelException(
            f"Shared memory pool '{name}' already exists{_stale_hint(name, path)}"
        ) from None


def _stale_hint(name: str, path: str) -> str:
    """What to say about the entry at ``path`` when it blocks creating pool ``name``."""
    try:
        target = os.readlink(path)
    except OSError:  # not a link (or gone already): nothing more to say
        return ""
    match = _PROC_FD.fullmatch(target)
    if match is None or _sealed_target(name, target) is not None:
        return ""
    return (
        f": {path} is a link left by a sealed pool whose creator (pid {match[1]}) has exited; "
        "it is not removed automatically (remove it, or use another name)"
    )


def _sealed_target(name: str, target: str) -> str | None:
    """``target`` if it is the live memfd of sealed pool ``name``, else ``None``."""
    if _PROC_FD.fullmatch(target) is None:
        return None
    try:
        link = os.readlink(target)
    except OSError:
        return None
    return target if link == f"/memfd:{_MEMFD_PREFIX}{name} (deleted)" else None


def is_sealed(fd: int) -> bool:
    """Whether the file behind ``fd`` can no longer shrink."""
    if not _F_GET_SEALS:
        return False
    try:
        return bool(fcntl.fcntl(fd, _F_GET_SEALS) & _F_SEAL_SHRINK)
    except OSError:  # not a memfd: no seals
        return False


def extend_segment(
    fd: int, name: str, total: int, extra: int, growth: int, max_size: int, nbytes: int
) -> int:
    """Grow segment ``fd`` from ``total`` bytes by whole ``growth`` steps covering ``extra``.

    Returns the new size. Every limit is checked before the segment changes, and the pages are
    reserved with ``posix_fallocate``: running out shows up here, never as SIGBUS later.
    ``nbytes`` (the allocation that needs the room) only goes into the messages.

    Raises:
        TritonModelException: the pool maximum (``max_size``, 0 for none) or the free space
            of ``/dev/shm`` does not allow it ("Failed to increase the shared memory pool size
            to <N> bytes: ..." with the requested and available sizes); nothing changed then.
    """
    grow_by = growth * -(-extra // growth)
    new_total = total + grow_by
    if max_size and new_total > max_size:
        capped = (max_size - total) // PAGE * PAGE  # whatever room is left may be enough
        if capped < extra:
            raise TritonModelException(
                f"Failed to increase the shared memory pool size to {new_total} bytes: an "
                f"allocation of {nbytes} bytes needs {extra} more bytes, but pool '{name}' is "
                f"limited to {max_size} bytes and already holds {total} ({max_size - total} "
                "available)."
            )
        grow_by, new_total = capped, total + capped
    available = shm_available()
    if grow_by > available:
        raise TritonModelException(
            f"Failed to increase the shared memory pool size to {new_total} bytes: requested "
            f"{grow_by} more bytes for an allocation of {nbytes} bytes, but only {available} "
            f"bytes are available in {SHM_DIR}. " + DOCKER_HINT
        )
    try:
        os.posix_fallocate(fd, total, grow_by)
    except OSError as exc:
        raise TritonModelException(
            f"Failed to increase the shared memory pool size to {new_total} bytes: requested "
            f"{grow_by} more bytes for an allocation of {nbytes} bytes. Error: {exc.strerror}. "
            + DOCKER_HINT
        ) from exc
    return new_total


def open_segment(name: str) -> tuple[int, int]:
    """Open the existing pool segment ``name``; its descriptor and total size.

    Raises:
        TritonModelException: no such segment, or it is not a pb_tensor pool of this layout.
    """
    path = os.path.join(SHM_DIR, name)
    try:
        if os.path.islink(path):  # a sealed pool: the link leads to the creator's memfd
            target = os.readlink(path)
            found = _sealed_target(name, target)
            if found is None:
                match = _PROC_FD.fullmatch(target)
                if match is None:
                    raise TritonModelException(f"'{name}' is not a pb_tensor shared memory pool")
                raise TritonModelException(
                    f"Unable to attach to shared memory pool '{name}': its creator (pid "
                    f"{match[1]}) has exited or does not let this process open its "
                    "descriptors (a sealed pool is reached through the creator's /proc entry; "
                    "create it with sealed=False to share it across PID namespaces)"
                )
            fd = os.open(found, os.O_RDWR | os.O_CLOEXEC)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise TritonModelException(f"Unable to find shared memory pool '{name}'") from None
    except OSError as exc:
        raise TritonModelException(
            f"Unable to open shared memory pool '{name}': {exc.strerror}"
        ) from exc
    try:
        # The header first, the size second: a grower extends the file before it writes the
        # new total (the commit point), so a size read after the header covers that total.
        head = os.pread(fd, heap.POOL_HEAD.size, 0)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or len(head) < heap.POOL_HEAD.size:
            raise TritonModelException(f"'{name}' is not a pb_tensor shared memory pool")
        magic, version, header_size, total, _, _ = heap.POOL_HEAD.unpack(head)
        if magic != heap.POOL_MAGIC or header_size != heap.HEADER_SIZE:
            raise TritonModelException(f"'{name}' is not a pb_tensor shared memory pool")
        if version != heap.LAYOUT_VERSION:
            raise TritonModelException(
                f"Shared memory pool '{name}' has layout version {version}, this pb_tensor "
                f"reads version {heap.LAYOUT_VERSION}"
            )
        if total > st.st_size or total < heap.HEADER_SIZE + 2 * heap.ALIGN or total % PAGE:
            raise TritonModelException(
                f"Shared memory pool '{name}' is corrupted: header size {total} bytes, "
                f"segment {st.st_size} bytes"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, int(total)


def reopen(fd: int, path: str) -> int:
    """A new open file description of the file behind ``fd``.

    ``flock`` locks belong to an open file description; the pool locks a description of its
    own that no other process can inherit, so the kernel drops the lock when we die.

    Raises:
        TritonModelException: without ``/proc``, the file at ``path`` is no longer ``fd``'s.
        OSError: the file cannot be opened.
    """
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        new = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        a, b = os.fstat(fd), os.fstat(new)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            os.close(new)
            raise TritonModelException(
                f"Shared memory segment '{path}' was replaced while opening it"
            ) from None
        return new


class Mapping:
    """One ``mmap`` of the segment at a given size, plus what views need to point into it.

    Views hold a reference to their ``Mapping`` (through ``base`` or their owner), so a
    mapping lives, and stays mapped, exactly as long as something can still read it.
    """

    __slots__ = ("addr", "base", "mm", "mv", "size")

    def __init__(self, fd: int, size: int, populate: bool, populate_from: int) -> None:
        flags = mmap.MAP_SHARED
        if populate and populate_from == 0:
            flags |= _MAP_POPULATE
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        if sys.version_info >= (3, 13):
            # No dup() per mapping: old mappings kept alive by views cost no descriptor.
            self.mm = mmap.mmap(fd, size, flags=flags, prot=prot, trackfd=False)
        else:
            self.mm = mmap.mmap(fd, size, flags=flags, prot=prot)
        if populate and populate_from > 0:
            # After growth only the new range needs faulting in.
            start = populate_from - populate_from % PAGE
            with contextlib.suppress(OSError):
                self.mm.madvise(_MADV_POPULATE_WRITE, start, size - start)
        # A uint8 array over the whole mapping: a buffer export that keeps the mmap open while
        # any view references this object, and the base address for owned views.
        self.base: npt.NDArray[np.uint8] = np.frombuffer(self.mm, dtype=np.uint8)
        # (Not base.__array_interface__: numpy crashes building it when an allocation fails.)
        self.addr: int = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        # The buffer owned views are built on: a memoryview is not an ndarray, so numpy stops
        # collapsing a view's base chain at the owner built on it (see _pool._Held).
        self.mv = memoryview(self.mm)
        self.size = size
