"""Routing: k-ary trees over the ranks an operation involves, and the key -> destination selectors.

Trees use the heap layout: the root at index 0 and the others in ascending rank order, node ``i`` having
children ``k*i+1 .. k*i+k``. Keyed operations build one tree per destination (rooted at its rank), so
different destinations get differently shaped trees and the load spreads.

When the ranks of a tree span several hosts and some host has more than one of them
(:mod:`twisternet.topology`), :func:`tree_for` builds a :class:`HostTree` instead: the ranks of each
host form a subtree of their own under one *entry* rank of that host, and only the entries' edges cross
host links. Up a reduce/gather tree each host's records are then combined (keyed operations: one record
per key per host) before they cross its link; down a broadcast tree each host's link carries the data
once.
"""

from __future__ import annotations

import struct
import zlib
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from twisternet.errors import ConfigError

from .edges import MAX_LEVELS

if TYPE_CHECKING:
    from twisternet.context import Context

#: Whether :func:`tree_for` may build host-aware trees (a switch for benchmarks comparing the two).
HOST_TREES = True
#: Fan-out of the level between the hosts' entry ranks (a star up to this many hosts, a tree beyond).
HOST_FANOUT = 16

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


class HostTree(KaryTree):
    """A tree over ``members`` rooted at ``root`` that crosses each host link once per host.

    The root's host: a fanout-``fanout`` KaryTree of its ranks under the root. Every other host: a
    KaryTree of its ranks under its entry rank (``group[root % len(group)]``, so different roots use
    different entries), and the entries hang under the root in a KaryTree of fanout
    ``max(fanout, HOST_FANOUT)``. Same interface as KaryTree; every rank builds the same tree from the
    same topology.
    """

    def __init__(self, root: int, members: Iterable[int], fanout: int, topology: Any) -> None:
        if not isinstance(fanout, int) or fanout < 1:
            raise ConfigError("fanout", f"must be an int >= 1, got {fanout!r}")
        members = set(members) | {root}
        groups = [[r for r in g if r in members] for g in topology.groups]
        groups = [g for g in groups if g]
        self.root, self.fanout = root, fanout
        self._parent: dict[int, int | None] = {root: None}
        self._children: dict[int, list[int]] = {r: [] for r in members}

        def hang(top: int, group: list[int], k: int) -> None:
            sub = KaryTree(top, group, k)
            for r in sub.order[1:]:
                p = sub.parent(r)
                assert p is not None
                self._parent[r] = p
                self._children[p].append(r)
        home = next(g for g in groups if root in g)
        hang(root, home, fanout)
        entries = []
        for g in groups:
            if g is home:
                continue
            e = g[root % len(g)]
            entries.append(e)
            hang(e, g, fanout)
        hang(root, [root] + entries, max(fanout, HOST_FANOUT))
        for r in self._children:
            self._children[r].sort()
        self.order: list[int] = [root]
        self._depth = {root: 0}
        for r in self.order:                      # breadth first
            for c in self._children[r]:
                self._depth[c] = self._depth[r] + 1
                self.order.append(c)
        self._index = {r: i for i, r in enumerate(self.order)}
        self.depth = max(self._depth.values())
        if self.depth > MAX_LEVELS:
            raise ConfigError("fanout", f"a host tree over {len(self.order)} ranks is {self.depth} levels deep "
                                        f"(max {MAX_LEVELS}); use a larger fanout")

    def parent(self, rank: int) -> int | None:
        return self._parent[rank]

    def children(self, rank: int) -> list[int]:
        return list(self._children[rank])

    def __repr__(self) -> str:
        return f"HostTree(root={self.root}, parent={self._parent})"


def tree_for(ctx: Context, root: int, members: Iterable[int], fanout: int = 2) -> KaryTree:
    """The tree an operation of ``ctx`` uses over ``members`` rooted at ``root``: a :class:`HostTree`
    when the task plan knows every rank's host (from the TCP bootstrap table, or an earlier exchange)
    and the members span several hosts with more than one member on some host; else a KaryTree."""
    members = set(members) | {root}
    plan = getattr(ctx, "plan", None)
    topo = None
    if HOST_TREES and plan is not None and len(members) > 2:
        topo = plan.topology()
        if topo is None:
            from twisternet.topology import from_channel
            hosts = from_channel(getattr(ctx, "channel", None))
            if hosts is not None:
                plan.set_hosts(hosts)
                topo = plan.topology()
    if topo is not None:
        sub = topo.restrict(members)
        if 1 < sub.nhosts < len(members):
            return HostTree(root, members, fanout, sub)
    return KaryTree(root, members, fanout)


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
