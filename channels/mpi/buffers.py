"""Reuse of rendezvous buffers: fresh memory costs a page fault per page on first touch, which halves
large-message bandwidth, so released (and no longer referenced) buffers are kept, bounded."""

from __future__ import annotations

from typing import Any

import numpy as np

#: Most rendezvous buffers kept for reuse.
_BULK_CACHE_MAX = 8


class BulkCache:
    """Recycled rendezvous buffers (uint8 numpy arrays), newest last, at most ``_BULK_CACHE_MAX`` of
    them and ``cap`` bytes in total; ``stats["rndv_buffers_reused"]`` counts the buffers reused."""

    __slots__ = ("_arrays", "_bytes", "_cap", "_stats")

    def __init__(self, cap: int, stats: dict[str, int]) -> None:
        self._arrays: list[Any] = []
        self._bytes = 0
        self._cap = cap
        self._stats = stats

    def take(self, size: int) -> Any:
        """A buffer of at least ``size`` bytes for a rendezvous payload: the most recently recycled one
        of the best fit (at most twice as big), else a fresh uninitialised one (no memset; MPI writes
        every byte)."""
        best = -1
        cache = self._arrays
        for i in range(len(cache) - 1, -1, -1):  # newest first: likely still in the CPU cache
            n = cache[i].nbytes
            if size <= n <= 2 * size and (best < 0 or n < cache[best].nbytes):
                best = i
        if best >= 0:
            arr = cache.pop(best)
            self._bytes -= arr.nbytes
            self._stats["rndv_buffers_reused"] += 1
            return arr
        return np.empty(size, dtype=np.uint8)

    def put(self, arr: Any) -> None:
        """Keep ``arr`` (nobody else refers to it any more) for a later :meth:`take`; the oldest
        buffers go when the cache is over its bounds."""
        cache = self._arrays
        cache.append(arr)
        self._bytes += arr.nbytes
        while self._bytes > self._cap or len(cache) > _BULK_CACHE_MAX:
            self._bytes -= cache.pop(0).nbytes

    def __len__(self) -> int:
        return len(self._arrays)

    @property
    def nbytes(self) -> int:
        """Bytes held for reuse."""
        return self._bytes
