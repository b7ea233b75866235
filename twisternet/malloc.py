"""glibc's allocator told to keep freed memory for reuse, in a process that moves data.

A poll hands a burst of received messages to their handlers at once, and the records they carry are
decoded into fresh arrays (arrays below the zero-copy threshold travel in band and are copied out).
When their consumer drops them, glibc returns the freed top of its heap to the system as soon as it
exceeds its trim threshold (twice its dynamic mmap threshold: a few hundred KB), and the next burst
faults every page in again, about 1-2 us a page on a virtual machine. p2p bandwidth at 64-128 KB
records was 1.6-2.0 GB/s over Unix sockets and MPI for that; with the thresholds below, 4.5-5.3
(``python -m benchmarks --suite p2p --set p2p.sizes=64K,128K``, docs/performance.md).

:func:`tune` sets ``M_MMAP_THRESHOLD`` to 32 MB (the largest value glibc's dynamic threshold reaches
by itself) and ``M_TRIM_THRESHOLD`` to 64 MB: allocations below 32 MB come from the heap, and up to
64 MB of freed heap stays in the process for the next ones. The cost is resident memory: a process
keeps up to that much free heap after a burst instead of returning it. Once per process, on glibc only,
and not when the environment already tunes malloc (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``malloc`` tunables in ``GLIBC_TUNABLES``); a Context calls it unless its
configuration says ``malloc_tuning=False`` (``TWISTERNET_MALLOC_TUNING=0``).
"""

from __future__ import annotations

import ctypes
import os
import threading

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "glibc", "state", "tune"]

#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: What :func:`tune` sets.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
#: Environment variables through which a user (or a launcher) already tunes glibc's malloc.
_USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_lock = threading.Lock()
_state: str | None = None


def glibc() -> bool:
    """Whether this process runs on glibc (whose ``mallopt`` thresholds :func:`tune` sets)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):     # no such name here (not glibc, not Unix)
        return False


def state() -> str | None:
    """What :func:`tune` found: None (not called yet), "tuned", "environment" (the user's settings
    were left alone), "not glibc", or "failed" (mallopt refused)."""
    return _state


def tune() -> bool:
    """Set glibc's mmap and trim thresholds (see the module doc) unless done already, the environment
    tunes malloc, or the C library is not glibc. Whether this process runs with twisternet's values."""
    global _state
    with _lock:
        if _state is None:
            _state = _tune()
        return _state == "tuned"


def _tune() -> str:
    if any(k in os.environ for k in _USER_ENV) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "environment"
    if not glibc():
        return "not glibc"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "not glibc"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # (the trim threshold first: setting either turns glibc's dynamic thresholds off)
    if mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1 or mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return "failed"
    return "tuned"
