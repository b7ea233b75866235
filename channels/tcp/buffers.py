"""A cache of large receive buffers, reused once nothing but the cache refers to them.

Fresh large buffers cost page faults on first touch, about as much time as receiving into them.
"""

from __future__ import annotations

import sys


class RecvBuffers:
    """Reuses large receive buffers once nothing outside this cache refers to them any more.

    A message's memory is handed over to the core (views of it may live on as numpy arrays), so a
    buffer is reused only when its reference count shows that the cache alone holds it. Idle buffers
    are kept up to ``limit`` bytes.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bufs: list[bytearray] = []
        self.total = 0

    def get(self, n: int) -> memoryview:
        """A writable view of ``n`` bytes: an idle cached buffer if one fits, else a fresh one."""
        bufs = self.bufs
        for i in range(len(bufs)):
            b = bufs[i]
            # references: the list slot, the local name b, getrefcount's argument
            if n <= len(b) <= 2 * n and sys.getrefcount(b) <= 3:
                return memoryview(b)[:n]
        fresh = bytearray(n)
        if n <= self.limit:
            # evict idle buffers until the new one fits
            i = 0
            while self.total + n > self.limit and i < len(bufs):
                if sys.getrefcount(bufs[i]) <= 2:
                    self.total -= len(bufs[i])
                    del bufs[i]
                else:
                    i += 1
            if self.total + n <= self.limit:
                bufs.append(fresh)
                self.total += n
        return memoryview(fresh)
