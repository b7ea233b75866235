"""The receive-buffer cache both channels share (channels/buffers.py)."""

from __future__ import annotations

import numpy as np

from channels.buffers import MIN_KEPT, BufferCache

MB = 1 << 20


def test_a_buffer_is_handed_out_again_only_once_nothing_else_refers_to_it() -> None:
    stats = {"reused": 0}
    cache = BufferCache(64 * MB, stats=stats, stat="reused")
    a = cache.take(MB)
    cache.put(a)                      # kept at once, as TCP does, while a view of it lives on
    view = np.frombuffer(a.data[:MB], dtype=np.uint8)
    del a
    b = cache.take(MB)
    assert not np.shares_memory(b, view) and cache.reused == 0    # the view keeps it from reuse
    del view
    c = cache.take(MB)                # now only the cache held it
    assert cache.reused == 1 and stats["reused"] == 1 and c.nbytes == MB and len(cache) == 0
    del b


def test_best_fit_within_twice_the_size_newest_first() -> None:
    cache = BufferCache(64 * MB)
    small, big, newer = np.empty(2 * MB, np.uint8), np.empty(8 * MB, np.uint8), np.empty(2 * MB, np.uint8)
    ids = {id(small): "small", id(big): "big", id(newer): "newer"}
    for arr in (small, big, newer):
        cache.put(arr)
    del small, big, newer, arr                           # (the loop name held the last)
    assert ids[id(cache.take(MB + 1))] == "newer"          # the newest of the best fit
    assert len(cache) == 2
    got = cache.take(3 * MB)                               # 8 MB is more than twice 3 MB: fresh
    assert got.nbytes == 3 * MB and len(cache) == 2
    assert ids[id(cache.take(4 * MB))] == "big"


def test_bounds_by_bytes_count_and_size() -> None:
    cache = BufferCache(10 * MB, max_buffers=3)
    for _ in range(5):
        cache.put(np.empty(MB, np.uint8))
    assert len(cache) == 3 and cache.nbytes == 3 * MB      # the oldest went first
    cache.put(np.empty(9 * MB, np.uint8))
    assert cache.nbytes <= 10 * MB and len(cache) == 2
    cache.put(np.empty(11 * MB, np.uint8))                 # larger than the whole cache: not kept
    cache.put(np.empty(MIN_KEPT - 1, np.uint8))            # too small to be worth keeping
    assert cache.nbytes <= 10 * MB and len(cache) == 2
