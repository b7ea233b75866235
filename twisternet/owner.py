"""Who owns a file a process leaves on the machine, and whether that owner is gone.

The names of shared-memory segments and spill directories carry their creator's pid and a *namespace
tag*: 8 hex digits of a hash of the host name and the pid namespace. A pid means something only in the
pid namespace (and on the host) it came from, and ``/dev/shm`` or a spill directory may be shared with
other containers or hosts (``--ipc=host``, a spill directory on NFS). So a sweep judges only names with
its own tag, and removes them only when no process with that pid exists here.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
from collections.abc import Callable


@functools.lru_cache(maxsize=1)
def namespace_tag() -> str:
    """8 hex digits naming this host and pid namespace (the same for every process of both)."""
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = "?"
    return hashlib.sha256(f"{socket.gethostname()}:{ns}".encode()).hexdigest()[:8]


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists in this pid namespace (of any user: one we may not signal is
    alive too). Pids that cannot be a process's count as alive (never removed)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def owner_gone(pid: int, tag: str | None) -> bool:
    """Whether the owner named by ``pid`` and ``tag`` is a process of this host and pid namespace that
    no longer exists (``tag`` None: a name from before tags, judged by the pid alone)."""
    if tag is not None and tag != namespace_tag():
        return False
    return not pid_alive(pid)


def remove_orphans(directory: str, owner_of: Callable[[str], tuple[int, str | None] | None],
                   is_kind: Callable[[int], bool], remove: Callable[[str], None]) -> list[str]:
    """Remove the entries of ``directory`` whose name says (``owner_of``: pid and tag, or None for a
    name that is not ours) that their owner is gone, that belong to this user and whose mode passes
    ``is_kind`` (e.g. ``stat.S_ISREG``); links are never followed. Returns the removed paths."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    me = os.geteuid()
    for name in names:
        who = owner_of(name)
        if who is None or not owner_gone(*who):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_uid == me and is_kind(st.st_mode):
            remove(path)
            removed.append(path)
    return removed


__all__ = ["namespace_tag", "pid_alive", "owner_gone", "remove_orphans"]
