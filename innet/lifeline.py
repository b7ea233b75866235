"""Helper processes (switch, PS) end with the process that started them, however it ends.

A rank that starts a switch and a PS and is then killed (SIGKILL, OOM) must not leave them running.
Three mechanisms, any of which stops the helper:

* the **stdin pipe**: the parent keeps the write end of the child's stdin; when the parent dies the kernel
  closes it and the child reads EOF (``--lifeline``);
* **PR_SET_PDEATHSIG** (Linux, through ctypes ``prctl``): the kernel sends SIGTERM when the parent dies.
  It fires when the parent *thread* that forked ends, so it is only asked for when the parent started
  the helper from its main thread (``--parent-death-signal``);
* a **parent-pid watchdog**: a thread that notices ``getppid()`` change (the helper was re-parented).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
from typing import TextIO
from collections.abc import Callable

__all__ = ["set_parent_death_signal", "watch_parent", "watch_stdin"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) dies; False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
            return False
    except (OSError, AttributeError) as e:
        log.warning("prctl unavailable: %s", e)
        return False
    return True


def watch_parent(parent_pid: int, on_death: Callable[[], None], interval: float = 0.5) -> threading.Thread:
    """Call ``on_death`` once when this process's parent is no longer ``parent_pid`` (checked every
    ``interval`` s, and at once: the parent may have died before the death signal was set)."""
    def run() -> None:
        stop = threading.Event()
        while os.getppid() == parent_pid:
            stop.wait(interval)
        log.warning("parent process %d is gone; stopping", parent_pid)
        on_death()

    t = threading.Thread(target=run, name="parent-watchdog", daemon=True)
    t.start()
    return t


def watch_stdin(on_eof: Callable[[], None], stream: TextIO | None = None) -> threading.Thread:
    """Call ``on_eof`` once ``stream`` (default stdin) reaches end of file: the parent closed the pipe or died."""
    src = sys.stdin if stream is None else stream

    def run() -> None:
        try:
            while src.readline():
                pass
        except (OSError, ValueError):
            pass
        log.info("lifeline pipe closed; stopping")
        on_eof()

    t = threading.Thread(target=run, name="stdin-lifeline", daemon=True)
    t.start()
    return t
