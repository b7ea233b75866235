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


__all__ = ["namespace_tag", "pid_alive", "owner_gone"]
