"""How one user-visible edge id becomes the channel edges an operation uses, and who owns which edge.

An operation created with ``edge=e`` owns the block of channel edges ``[e * EDGE_SPAN, (e + 1) * EDGE_SPAN)``:

* offset 0 (``DIRECT``): direct source -> destination records (Partition, KeyedPartition);
* offset 1 (``DOWN``): records flowing down a broadcast tree (Broadcast, AllReduce, AllGather);
* offsets 2-4 (``AR_UP``, ``AR_DOWN``, ``RING``): the rank-level ``AllReduce.allreduce`` algorithms;
* offset 5 (``ABORT``): a rank whose part of the operation failed tells the others why (every operation);
* offsets 8 .. EDGE_SPAN-1 (``UP_BASE + level``): records flowing up a reduce/gather tree towards a node at
  depth ``level``. One channel edge per tree level keeps the "refuse while the way onward is congested"
  dependencies acyclic even when several keyed trees share ranks, so back pressure can never deadlock.

So distinct user edges never overlap; two live operations on the same user edge in one process are
rejected with a clear error (close the first one, or pick another edge).

Automatic edges: the functional layer (``tn.all_reduce`` ...) and the torch backend pick edges themselves from
the reserved range ``[AUTO_EDGE_BASE, MAX_USER_EDGE)`` (the top ``AUTO_STREAMS * AUTO_STREAM_EDGES`` user
edges), like Twister2's ``nextEdge``: each *stream* (0: the functional layer of a Context; ``1 + g``: the
torch process group torch numbers ``g``, see ``twisternet.torch.backend``) owns ``AUTO_STREAM_EDGES``
consecutive edges and hands them out with a per-Context counter (:func:`next_auto_edge`), wrapping around.
Every rank makes the same calls in the same order, so every rank draws the same edge. An operation created by
hand on an edge in that range is refused (ConfigError): it could collide with an automatic one.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from twisternet.channel import CONTROL_EDGE_BASE
from twisternet.errors import ConfigError

if TYPE_CHECKING:
    from twisternet.context import Context

#: Channel edges owned by one user edge.
EDGE_SPAN = 64
DIRECT = 0
DOWN = 1
AR_UP = 2
AR_DOWN = 3
RING = 4
ABORT = 5
UP_BASE = 8
#: Deepest tree level an operation can use (a fanout-2 tree of 2**56 ranks).
MAX_LEVELS = EDGE_SPAN - UP_BASE
#: User edge ids must be below this.
MAX_USER_EDGE = CONTROL_EDGE_BASE // EDGE_SPAN

#: Edges of one automatic stream, and how many streams there are.
AUTO_STREAM_EDGES = 4096
AUTO_STREAMS = 256
#: First user edge of the reserved automatic range (it runs up to MAX_USER_EDGE).
AUTO_EDGE_BASE = MAX_USER_EDGE - AUTO_STREAMS * AUTO_STREAM_EDGES

_lock = threading.Lock()
_auto_next: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()
_auto_granted: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
_claims: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()
_epochs: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()


def check_user_edge(edge: object) -> int:
    """Validate a user edge id; returns it."""
    if not isinstance(edge, int) or isinstance(edge, bool) or not 0 <= edge < MAX_USER_EDGE:
        raise ConfigError("edge", f"must be an int in [0, {MAX_USER_EDGE}), got {edge!r}")
    return edge


def next_auto_edge(ctx: Context, stream: int = 0) -> int:
    """The next automatic edge of ``stream`` in ``ctx`` (the same on every rank that makes the same calls);
    an operation may then be created on it once."""
    if not 0 <= stream < AUTO_STREAMS:
        raise ConfigError("stream", f"automatic edge streams are numbered 0..{AUTO_STREAMS - 1}, got {stream!r}")
    with _lock:
        counters = _auto_next.setdefault(ctx, {})
        n = counters.get(stream, 0)
        counters[stream] = n + 1
        edge = AUTO_EDGE_BASE + stream * AUTO_STREAM_EDGES + n % AUTO_STREAM_EDGES
        _auto_granted.setdefault(ctx, set()).add(edge)
        return edge


def channel_edge(edge: int, offset: int) -> int:
    """The channel edge at ``offset`` within the block of user edge ``edge``."""
    if not 0 <= offset < EDGE_SPAN:
        raise ValueError(f"edge offset {offset} outside [0, {EDGE_SPAN})")
    return edge * EDGE_SPAN + offset


def claim_edge(ctx: Context, edge: int, owner: str) -> int:
    """Reserve user edge ``edge`` in ``ctx`` for ``owner``; raises ConfigError if a live op holds it.

    Returns the edge's incarnation (epoch): 0 for the first operation on it in this process, 1 for the
    one after it was closed, ... Every rank creates the operations on an edge in the same order, so the
    numbers agree across ranks and tell the records of consecutive operations apart (see
    ``twisternet.context``)."""
    with _lock:
        if edge >= AUTO_EDGE_BASE:
            granted = _auto_granted.get(ctx)
            if granted is None or edge not in granted:
                raise ConfigError("edge", f"edge {edge} is in the range [{AUTO_EDGE_BASE}, {MAX_USER_EDGE}) reserved "
                                          "for the edges tn.all_reduce & co. and the torch backend pick themselves; "
                                          f"give operations created by hand an edge below {AUTO_EDGE_BASE}")
        table = _claims.setdefault(ctx, {})
        if edge in table:
            raise ConfigError("edge", f"edge {edge} (channel edges {edge * EDGE_SPAN}..{(edge + 1) * EDGE_SPAN - 1}) "
                                      f"is already used by {table[edge]} in this process; give each concurrent "
                                      "operation its own edge or close the earlier one")
        table[edge] = owner
        if edge >= AUTO_EDGE_BASE:
            _auto_granted[ctx].discard(edge)
        counts = _epochs.setdefault(ctx, {})
        epoch = counts.get(edge, -1) + 1
        counts[edge] = epoch
        return epoch


def channel_edges(edge: int) -> range:
    """Every channel edge owned by user edge ``edge``."""
    return range(edge * EDGE_SPAN, (edge + 1) * EDGE_SPAN)


def release_edge(ctx: Context, edge: int) -> None:
    """Give user edge ``edge`` back (idempotent)."""
    with _lock:
        table = _claims.get(ctx)
        if table is not None:
            table.pop(edge, None)
