"""Futex waits on 32-bit words of shared memory (Linux), for ranks that wait on each other there.

A process that waits for another to publish a counter in a shared mapping can spin (fast, but it holds a
core), sleep in short naps (each nap's end costs a wake-up, and the last one comes late), or ask the
kernel to put it to sleep until the word changes: ``FUTEX_WAIT`` sleeps only while the word still holds
the value the caller last saw (no lost wake-up), ``FUTEX_WAKE`` wakes the sleepers of a word. The words
of a ``MAP_SHARED`` file mapping are the same futex in every process that maps the file.

Called through ``ctypes`` (which releases the interpreter lock for the call); :func:`available` says
whether this machine has it (Linux on x86-64), else callers keep their own waiting.

A waker that calls ``FUTEX_WAKE`` only when a sleeper has said so (a flag word) saves the system call,
but needs :func:`fence` on both sides (the sleeper: flag, fence, read the counter; the waker: counter,
fence, read the flags): x86 lets a load pass an earlier store, so without it each could miss the
other's store and the sleeper would sleep until its timeout. Python has no fence instruction; a lock's
acquire and release are atomic read-modify-writes, which x86 orders as full barriers (hence x86-64
only: other architectures' lock operations are one-way barriers).
"""

from __future__ import annotations

import ctypes
import platform
import sys
import threading

__all__ = ["available", "fence", "wait", "wake"]

_SYS_FUTEX = {"x86_64": 202, "amd64": 202}.get(platform.machine().lower())
_FUTEX_WAIT = 0           # not the _PRIVATE variants: the words are shared between processes
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall = None
if sys.platform.startswith("linux") and _SYS_FUTEX is not None and sys.byteorder == "little":
    try:
        _syscall = ctypes.CDLL(None, use_errno=True).syscall
        _syscall.restype = ctypes.c_long
    except (OSError, AttributeError):  # pragma: no cover - a libc without syscall()
        _syscall = None


_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier (see the module doc): stores before it are visible before loads after it."""
    _FENCE.acquire()
    _FENCE.release()


def available() -> bool:
    """Whether :func:`wait` and :func:`wake` work here."""
    return _syscall is not None


def _s32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def wait(addr: int, seen: int, timeout: float) -> None:
    """Sleep until the 32-bit word at ``addr`` is woken, for at most ``timeout`` seconds, unless it no
    longer holds ``seen`` (its low 32 bits: an int64 counter's low half on a little-endian machine).
    Returns early on any wake-up or signal: the caller re-reads the word."""
    assert _syscall is not None
    timeout = max(0.0, timeout)
    ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAIT, ctypes.c_int(_s32(seen)), ctypes.byref(ts),
             None, 0)


def wake(addr: int) -> None:
    """Wake every process sleeping in :func:`wait` on the word at ``addr``."""
    assert _syscall is not None
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
