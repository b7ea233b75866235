"""Large receive buffers kept for reuse, for every channel (TCP/UDS payloads, MPI rendezvous and
pre-posted receives).

Fresh large buffers cost a page fault per page on first touch, about as much time as receiving into
them, which halves large-message bandwidth. A received message's memory is handed to the core, and
views of it (zero-copy numpy arrays) may outlive the message, so a cached buffer is handed out again
only when nothing but the cache refers to it: its reference count says so. A channel may therefore
:meth:`BufferCache.put` a buffer as soon as it has filled it (TCP) or when its consumer releases it
(MPI); either way :meth:`BufferCache.take` never returns memory that something else still reads.
"""

from __future__ import annotations

import sys

import numpy as np

#: Most buffers a cache keeps.
MAX_BUFFERS = 8
#: Smaller buffers are not kept: their first touch is cheap, and they would push out large ones.
MIN_KEPT = 1 << 16

__all__ = ["BufferCache", "MAX_BUFFERS", "MIN_KEPT"]


class BufferCache:
    """Receive buffers (uint8 numpy arrays) kept for reuse: at most ``max_buffers`` of them and ``cap``
    bytes in total, the oldest dropped first. ``reused`` counts the buffers handed out again, and so
    does ``stats[stat]`` when a channel's statistics dict is given."""

    __slots__ = ("_arrays", "_bytes", "cap", "max_buffers", "reused", "_stats", "_stat")

    def __init__(self, cap: int, max_buffers: int = MAX_BUFFERS, *, stats: dict[str, int] | None = None,
                 stat: str = "buffers_reused") -> None:
        self._arrays: list[np.ndarray] = []
        self._bytes = 0
        self.cap = cap
        self.max_buffers = max_buffers
        self.reused = 0
        self._stats = stats
        self._stat = stat

    def take(self, size: int) -> np.ndarray:
        """A buffer of at least ``size`` bytes: the newest of the best-fitting idle cached ones (at most
        twice as big), else a fresh uninitialised one (the receiver writes every byte it reads)."""
        cache = self._arrays
        best = -1
        best_n = 0
        for i in range(len(cache) - 1, -1, -1):      # newest first: likely still in the CPU cache
            n = cache[i].nbytes
            # references of an idle buffer: the list slot and getrefcount's argument
            if size <= n <= 2 * size and (best < 0 or n < best_n) and sys.getrefcount(cache[i]) <= 2:
                best, best_n = i, n
                if n == size:
                    break       # no better fit (the usual case: a stream of messages of one size)
        if best >= 0:
            arr = cache.pop(best)
            self._bytes -= arr.nbytes
            self.reused += 1
            if self._stats is not None:
                self._stats[self._stat] += 1
            return arr
        return np.empty(size, dtype=np.uint8)

    def put(self, arr: np.ndarray) -> None:
        """Keep ``arr`` for a later :meth:`take` (it is handed out only once nothing else refers to it);
        the oldest buffers go when the cache is over its bounds. A buffer smaller than ``MIN_KEPT`` or
        larger than ``cap`` is not kept."""
        if not MIN_KEPT <= arr.nbytes <= self.cap:
            return
        cache = self._arrays
        cache.append(arr)
        self._bytes += arr.nbytes
        while self._bytes > self.cap or len(cache) > self.max_buffers:
            self._bytes -= cache.pop(0).nbytes

    def __len__(self) -> int:
        return len(self._arrays)

    @property
    def nbytes(self) -> int:
        """Bytes held for reuse (some may still be in use elsewhere, see :meth:`put`)."""
        return self._bytes
