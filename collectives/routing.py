"""Routing: k-ary trees over the ranks an operation involves, and the key -> destination selectors.

Trees use the heap layout: the root at index 0 and the others in ascending rank order, node ``i`` having
children ``k*i+1 .. k*i+k``. Keyed operations build one tree per destination (rooted at its rank), so
different destinations get differently shaped trees and the load spreads.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from twisternet.errors import ConfigError

from .edges import MAX_LEVELS

Selector = Callable[[Any, Sequence[int]], int]
KEY_TYPES = ("int", "float", "str", "bytes", "object")


class KaryTree:
    """A k-ary tree over ``members`` rooted at ``root``: parent, children and depth of every member."""

    def __init__(self, root: int, members: Iterable[int], fanout: int = 2) -> None:
        if not isinstance(fanout, int) or fanout < 1:
            raise ConfigError("fanout", f"must be an int >= 1, got {fanout!r}")
        others = sorted(set(members) - {root})
        self.root = root
        self.fanout = fanout
        self.order = [root] + others
        self._index = {r: i for i, r in enumerate(self.order)}
        self.depth = 0
        self._depth: dict[int, int] = {}
        for i, r in enumerate(self.order):
            d = 0 if i == 0 else self._depth[self.order[(i - 1) // fanout]] + 1
            self._depth[r] = d
            self.depth = max(self.depth, d)
        if self.depth > MAX_LEVELS:
            raise ConfigError("fanout", f"a fanout-{fanout} tree over {len(self.order)} ranks is "
                                        f"{self.depth} levels deep (max {MAX_LEVELS}); use a larger fanout")

    def __contains__(self, rank: object) -> bool:
        return rank in self._index

    def __len__(self) -> int:
        return len(self.order)

    def parent(self, rank: int) -> int | None:
        """Parent of ``rank`` (None for the root)."""
        i = self._index[rank]
        return None if i == 0 else self.order[(i - 1) // self.fanout]

    def children(self, rank: int) -> list[int]:
        """Children of ``rank``, in ascending index order."""
        i = self._index[rank]
        lo = self.fanout * i + 1
        return self.order[lo:lo + self.fanout]

    def level(self, rank: int) -> int:
        """Depth of ``rank`` (root 0)."""
        return self._depth[rank]

    def subtree(self, rank: int) -> set[int]:
        """``rank`` and all its descendants."""
        out, todo = set(), [rank]
        while todo:
            r = todo.pop()
            out.add(r)
            todo.extend(self.children(r))
        return out

    def __repr__(self) -> str:
        return f"KaryTree(root={self.root}, fanout={self.fanout}, order={self.order})"


def check_key_type(key_type: object) -> str:
    """Validate a key_type name; returns it."""
    if key_type not in KEY_TYPES:
        raise ConfigError("key_type", f"must be one of {', '.join(KEY_TYPES)}, got {key_type!r}")
    return key_type  # type: ignore[return-value]


def normalize_key(key: Any, key_type: str) -> Any:
    """``key`` checked against ``key_type`` and converted to its canonical Python type."""
    if key_type == "int":
        if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
            return int(key)
    elif key_type == "float":
        if isinstance(key, (int, float, np.integer, np.floating)) and not isinstance(key, (bool, np.bool_)):
            return float(key)
    elif key_type == "str":
        if isinstance(key, str):
            return key
    elif key_type == "bytes":
        if isinstance(key, (bytes, bytearray, memoryview)):
            return bytes(key)
    elif key_type == "object":
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"keys must be hashable, got {type(key).__name__} {key!r}") from None
        return key
    else:
        raise ConfigError("key_type", f"must be one of {', '.join(KEY_TYPES)}, got {key_type!r}")
    raise TypeError(f"key {key!r} ({type(key).__name__}) does not match key_type {key_type!r}")


def stable_hash(key: Any) -> int:
    """A 32-bit hash of ``key`` that is the same in every process (unlike ``hash()`` of str/bytes)."""
    if isinstance(key, str):
        return zlib.crc32(key.encode("utf-8", "surrogatepass"))
    if isinstance(key, bytes):
        return zlib.crc32(key)
    if isinstance(key, bool):
        return int(key)
    if isinstance(key, int):
        if -(1 << 63) <= key < (1 << 63):
            return zlib.crc32(struct.pack("<q", key))
        return zlib.crc32(str(key).encode())
    if isinstance(key, float):
        return zlib.crc32(struct.pack("<d", key))
    return zlib.crc32(repr(key).encode())


def hash_selector(key: Any, destinations: Sequence[int]) -> int:
    """The default selector: a stable hash of the key modulo the number of destinations."""
    return destinations[stable_hash(key) % len(destinations)]
