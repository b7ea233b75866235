"""Shared-memory segments: files in ``/dev/shm`` that ranks on one host map, created and attached safely.

Both users of shared memory, the MPI channel's landing slots (:mod:`channels.shm_slots`) and the
shared-memory allreduce (:mod:`collectives.allreduce.shm`), get their segments here, so they share one
set of rules:

* one name pattern, ``twisternet-shm-<pid>-<tag>-<kind>-<16 hex>``: the owner's pid and namespace tag
  (:mod:`twisternet.owner`) in the name let the start-up sweep (:func:`sweep_stale`) find the
  segments of processes that are gone;
* created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode ``0600`` (never someone else's file, never
  through a symlink, readable by this user only);
* reserved in full with ``posix_fallocate`` before anything maps them: a page a full tmpfs cannot
  supply would otherwise kill the process with SIGBUS when first touched; here it is an ``OSError``
  at creation, and nothing is left behind;
* a random nonce written at a place the user chooses: :func:`attach` maps a file only if it is a
  regular file of this user with the expected size and that nonce (so a rank that does not really
  share ``/dev/shm``, e.g. in another container, finds out instead of using a different file).

The creator unlinks a segment as soon as every peer has it mapped; a process killed before that
leaves the file behind, and the next Context started on the machine removes it (:func:`sweep_stale`,
called from :func:`twisternet.leftovers.sweep`).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
import sys

import numpy as np

from . import owner

log = logging.getLogger(__name__)

#: Where segments live (a tmpfs on Linux).
SHM_DIR = "/dev/shm"
#: Name prefix of every segment (followed by ``<pid>-<tag>-<kind>-<16 hex>``).
PREFIX = "twisternet-shm-"
#: Kinds of segment: landing slots of the MPI channel, shared-memory allreduce.
KINDS = ("slot", "ar")
_NAME = re.compile(r"twisternet-shm-(\d+)-([0-9a-f]{8})-(" + "|".join(KINDS) + r")-[0-9a-f]{16}")
#: Names older versions used (``twisternet-<pid>-…``, ``twisternet-slot-<pid>-…``): swept the same way.
_LEGACY = re.compile(r"twisternet-(?:slot-)?(\d+)-[0-9a-f]{16}")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def supported() -> bool:
    """Whether this machine has shared memory to offer: Linux with a directory at :data:`SHM_DIR`."""
    return sys.platform.startswith("linux") and os.path.isdir(SHM_DIR)


class Segment:
    """One mapped segment: ``mm`` is the mapping, ``array`` the whole of it as uint8."""

    __slots__ = ("path", "size", "nonce", "mm", "array", "_refs")

    def __init__(self, path: str, size: int, nonce: bytes, mm: mmap.mmap) -> None:
        self.path = path
        self.size = size
        self.nonce = nonce
        self.mm: mmap.mmap | None = mm
        self.array: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8)
        # What getrefcount says with no view alive, measured the way viewed() asks (so it holds
        # whether or not the interpreter counts the argument).
        self._refs = sys.getrefcount(self.array)

    def viewed(self) -> bool:
        """Whether anything but this segment refers to ``array`` (a view handed out and still alive:
        every numpy slice or memoryview of it keeps a reference to ``array``)."""
        return self.array is not None and sys.getrefcount(self.array) > self._refs

    def close(self) -> None:
        """Drop this mapping (idempotent). Views still alive keep the memory mapped until they go."""
        self.array = None
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:     # a view outlives us: the mapping goes when it does
                pass


def segment_name(kind: str, pid: int | None = None) -> str:
    """A new random file name for a segment of ``kind`` owned by ``pid`` (default: this process)."""
    if kind not in KINDS:
        raise ValueError(f"unknown shared-memory segment kind {kind!r} (one of {KINDS})")
    pid = os.getpid() if pid is None else pid
    return f"{PREFIX}{pid}-{owner.namespace_tag()}-{kind}-{secrets.token_hex(8)}"


def owner_of(name: str) -> tuple[int, str | None] | None:
    """``(pid, namespace tag)`` from a segment's file name (tag None for the older, untagged names), or
    None if ``name`` is not a segment's."""
    m = _NAME.fullmatch(name)
    if m:
        return int(m.group(1)), m.group(2)
    m = _LEGACY.fullmatch(name)
    return (int(m.group(1)), None) if m else None


def create(kind: str, size: int, *, nonce_at: int = 0, nonce_bytes: int = 16,
           populate: bool = False) -> Segment:
    """A new segment of ``size`` bytes, reserved in full and mapped, with a random nonce of
    ``nonce_bytes`` at offset ``nonce_at``. OSError if the tmpfs cannot hold it (nothing is left)."""
    if size <= 0 or nonce_at < 0 or nonce_at + nonce_bytes > size:
        raise ValueError(f"bad segment size {size} / nonce offset {nonce_at}")
    nonce = secrets.token_bytes(nonce_bytes)
    path = os.path.join(SHM_DIR, segment_name(kind))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)         # whatever the umask: this user only
        # Reserve every page now: a page the tmpfs cannot supply later would be a SIGBUS on touch.
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0))
    except BaseException:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)
    mm[nonce_at:nonce_at + nonce_bytes] = nonce
    return Segment(path, size, nonce, mm)


def check_path(path: object, kind: str) -> None:
    """ValueError unless ``path`` names a segment of ``kind`` directly in :data:`SHM_DIR`."""
    name = path[len(SHM_DIR) + 1:] if isinstance(path, str) and path.startswith(SHM_DIR + "/") else ""
    m = _NAME.fullmatch(name)
    if m is None or m.group(3) != kind:
        raise ValueError(f"not a twisternet shared-memory segment of kind {kind!r}: {path!r}")


def attach(path: str, size: int, nonce: bytes, *, kind: str, nonce_at: int = 0,
           populate: bool = False) -> Segment:
    """Map a segment another process created; ValueError/OSError unless it is that very file: a
    segment name of ``kind``, no symlink, a regular file of this user, ``size`` bytes, ``nonce`` at
    ``nonce_at``."""
    check_path(path, kind)
    if not isinstance(nonce, bytes) or not nonce or nonce_at < 0 or nonce_at + len(nonce) > size:
        raise ValueError(f"bad nonce for segment {path}")
    fd = os.open(path, os.O_RDWR | _NOFOLLOW | _CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ValueError(f"{path} is not a regular file of this user")
        if st.st_size != size:
            raise ValueError(f"{path} has {st.st_size} bytes, expected {size}")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0))
    finally:
        os.close(fd)
    if mm[nonce_at:nonce_at + len(nonce)] != nonce:
        mm.close()
        raise ValueError(f"{path} is not the segment offered (its nonce differs)")
    return Segment(path, size, nonce, mm)


def unlink(path: str) -> None:
    """Remove a segment's name (idempotent); the memory lives on while mappings of it do."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove the segments in ``directory`` whose owner process is gone and that belong to this user
    (a process killed before it unlinked its segment leaves one behind); returns their paths. Segments
    of live processes, of other hosts or pid namespaces (see twisternet.owner) and other users' files
    are left alone."""
    removed = owner.remove_orphans(directory, owner_of, stat.S_ISREG, unlink)
    if removed:
        log.info("removed %d shared-memory segments left in %s by processes that are gone",
                 len(removed), directory)
    return removed


__all__ = ["SHM_DIR", "PREFIX", "KINDS", "Segment", "supported", "segment_name", "owner_of", "create",
           "attach", "check_path", "unlink", "sweep_stale"]
