"""Reuse of rendezvous buffers: fresh memory costs a page fault per page on first touch, which halves
large-message bandwidth, so released (and no longer referenced) buffers are kept, bounded."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


#: Most rendezvous buffers kept for reuse.
_BULK_CACHE_MAX = 8


class BulkCacheMixin:
    """BULKCACHE"""

    def _bulk_cache_take(self, size: int) -> Any:
        """A buffer of at least ``size`` bytes for a rendezvous payload: the most recently recycled one
        of the best fit (at most twice as big), else a fresh uninitialised one (no memset; MPI writes
        every byte)."""
        best = -1
        cache = self._bulk_cache
        for i in range(len(cache) - 1, -1, -1):  # newest first: likely still in the CPU cache
            n = cache[i].nbytes
            if size <= n <= 2 * size and (best < 0 or n < cache[best].nbytes):
                best = i
        if best >= 0:
            arr = self._bulk_cache.pop(best)
            self._bulk_cache_bytes -= arr.nbytes
            self.stats["rndv_buffers_reused"] += 1
            return arr
        return np.empty(size, dtype=np.uint8)

    def _bulk_cache_put(self, arr: Any) -> None:
        cache = self._bulk_cache
        cache.append(arr)
        self._bulk_cache_bytes += arr.nbytes
        while self._bulk_cache_bytes > self._bulk_cache_cap or len(cache) > _BULK_CACHE_MAX:
            self._bulk_cache_bytes -= cache.pop(0).nbytes

