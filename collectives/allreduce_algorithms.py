"""Rank-level ``AllReduce.allreduce(value)``: a chunked, pipelined tree, or a ring for large arrays.

* **tree** (any value, any reduction): values flow up the operation's k-ary tree over its ranks, each
  inner node combining its children's chunk ``j`` with its own before passing it on, and the result
  flows back down. Arrays with a named reduction are cut into ``chunk_bytes`` pieces, so levels work
  on different chunks at once (pipelining) and no message is larger than a chunk.
* **ring** (numpy arrays, named reduction): reduce-scatter then allgather around the ranks in order,
  ``2 (n - 1)`` steps each moving ``1/n`` of the array per rank, chunked: every link carries about
  ``2 (n-1)/n`` of the array, so the time approaches the array size over the link bandwidth instead of
  funnelling everything through a root.
* **innet** (future): in-network aggregation on ATP switches; raises NotImplementedError for now.

Records (edges ``AR_UP``, ``AR_DOWN``, ``RING``) are ``(kind, call, step, chunk, payload)``; ``call``
counts the ``allreduce`` calls of this operation, so consecutive calls never mix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from twisternet.errors import ConfigError, OperationTimeout

from .edges import AR_DOWN, AR_UP, RING, channel_edge
from .reduction import own, snapshot
from .routing import KaryTree

if TYPE_CHECKING:
    from .reduce import AllReduce

VIAS = ("auto", "tree", "ring", "innet")


class RankAllReduce:
    """Carries out ``allreduce`` calls for one AllReduce operation.

    One call at a time per process; every participating rank makes the same sequence of calls, with
    arrays of the same shape and dtype (a mismatch is not detected up front and ends in an error or a
    timeout naming the rank that sent nothing).
    """

    def __init__(self, op: "AllReduce") -> None:
        self.op = op
        self.ranks = sorted(set(op.source_ranks) | set(op.destination_ranks))
        self.same_ranks = set(op.source_ranks) == set(op.destination_ranks)
        self.tree = KaryTree(self.ranks[0], self.ranks, op.fanout)
        self.stash: dict[tuple, Any] = {}
        self.calls = 0
        for offset in (AR_UP, AR_DOWN, RING):
            op._register(offset, self._on_record, activates=False)

    def _on_record(self, src: int, msg: Any) -> bool:
        try:
            kind, call, step, chunk, payload = msg
        except (TypeError, ValueError):
            raise self.op._protocol(src, msg) from None
        self.stash[(kind, call, step, chunk, src)] = own(payload)
        self.op._changed = True
        return True

    # ------------------------------------------------------------------ plumbing
    def _send(self, dst: int, offset: int, msg: tuple, timeout: float) -> None:
        self.op.ctx.send(dst, channel_edge(self.op.edge, offset), msg, timeout=timeout)

    def _take(self, key: tuple, timeout: float) -> Any:
        op = self.op
        op._raise_if_failed()

        def ready() -> bool:
            return key in self.stash or op._error is not None or op._closed

        def on_timeout() -> BaseException:
            return OperationTimeout(f"allreduce() call {key[1]}: no data from rank {key[-1]} "
                                    f"(step {key[2]}, chunk {key[3]})", edge=op.edge, operation=op.operation,
                                    timeout=timeout)
        op.ctx.wait_until(ready, timeout=timeout, on_timeout=on_timeout)
        op._raise_if_failed()
        with op._lock:
            return self.stash.pop(key)

    def _chunks(self, a: int, b: int, itemsize: int) -> list[tuple[int, int]]:
        step = max(1, self.op.chunk_bytes // max(1, itemsize))
        return [(x, min(b, x + step)) for x in range(a, b, step)] or [(a, a)]

    def _combine_into(self, flat: np.ndarray, a: int, b: int, got: Any) -> None:
        part = flat[a:b]
        r = self.op.reduction.combine(part, got)
        if r is not part:
            flat[a:b] = r

    # ------------------------------------------------------------------ entry
    def run(self, value: Any, timeout: float | None) -> Any:
        op = self.op
        t = op.timeout if timeout is None else timeout
        if op.via == "innet":
            return self._innet(value, t)
        if not self.same_ranks:
            raise ConfigError("destinations", "allreduce() needs sources and destinations on the same ranks "
                                              f"(sources on {op.source_ranks}, destinations on {op.destination_ranks})")
        if op.rank not in self.ranks:
            raise ValueError(f"rank {op.rank} runs no task of {op.describe()} (edge {op.edge}); "
                             f"allreduce() is called by ranks {self.ranks}")
        op._raise_if_failed()
        call = self.calls
        self.calls += 1
        n = len(self.ranks)
        is_array = isinstance(value, np.ndarray)
        ring_ok = is_array and op.reduction.named and n > 1 and value.size >= n
        if op.via == "ring" and n > 1 and not ring_ok:
            raise ConfigError("via", "via='ring' needs a numpy array (at least one element per rank) and a "
                                     "named reduction (sum, prod, max, min)")
        if n == 1:
            return snapshot(value)
        if ring_ok and (op.via == "ring" or (op.via == "auto" and value.nbytes >= op.ring_threshold)):
            return self._ring(value, call, t)
        return self._tree(value, call, t)

    # ------------------------------------------------------------------ in-network (hook)
    def _innet(self, value: Any, timeout: float) -> Any:
        """Hook for ``via="innet"``: aggregate float32 arrays on ATP switches (the ``innet`` package).

        To be wired: quantize, send fragments through the switch service registered in
        ``self.op.ctx.services`` and return the aggregated array.
        """
        raise NotImplementedError("AllReduce(via='innet') needs the in-network aggregation service of the "
                                  "innet package, which is not wired to collectives yet; use via='auto'")

    # ------------------------------------------------------------------ tree
    def _tree(self, value: Any, call: int, t: float) -> Any:
        me = self.op.rank
        parent = self.tree.parent(me)
        children = self.tree.children(me)
        if isinstance(value, np.ndarray) and self.op.reduction.named:
            flat = np.array(value, copy=True).reshape(-1)
            bounds = self._chunks(0, flat.size, flat.itemsize)
            for c, (a, b) in enumerate(bounds):
                for ch in children:
                    self._combine_into(flat, a, b, self._take(("u", call, 0, c, ch), t))
                msg_kind, dsts = ("u", [parent]) if parent is not None else ("w", children)
                for d in dsts:
                    self._send(d, AR_UP if parent is not None else AR_DOWN, (msg_kind, call, 0, c, flat[a:b]), t)
            if parent is not None:
                for c, (a, b) in enumerate(bounds):
                    flat[a:b] = self._take(("w", call, 0, c, parent), t)
                    for ch in children:
                        self._send(ch, AR_DOWN, ("w", call, 0, c, flat[a:b]), t)
            return flat.reshape(value.shape)
        acc = snapshot(value)
        for ch in children:
            acc = self.op.reduction.combine(acc, self._take(("u", call, 0, 0, ch), t))
        if parent is not None:
            self._send(parent, AR_UP, ("u", call, 0, 0, acc), t)
            acc = self._take(("w", call, 0, 0, parent), t)
        for ch in children:
            self._send(ch, AR_DOWN, ("w", call, 0, 0, acc), t)
        return acc

    # ------------------------------------------------------------------ ring
    def _ring(self, value: np.ndarray, call: int, t: float) -> np.ndarray:
        ranks = self.ranks
        n = len(ranks)
        i = ranks.index(self.op.rank)
        right, left = ranks[(i + 1) % n], ranks[(i - 1) % n]
        flat = np.array(value, copy=True).reshape(-1)
        edges = [flat.size * k // n for k in range(n + 1)]
        segs = [self._chunks(edges[s], edges[s + 1], flat.itemsize) for s in range(n)]
        for step in range(n - 1):                       # reduce-scatter
            send_s, recv_s = (i - step) % n, (i - step - 1) % n
            for c, (a, b) in enumerate(segs[send_s]):
                self._send(right, RING, ("r", call, step, c, flat[a:b]), t)
            for c, (a, b) in enumerate(segs[recv_s]):
                self._combine_into(flat, a, b, self._take(("r", call, step, c, left), t))
        for step in range(n - 1):                       # allgather
            send_s, recv_s = (i + 1 - step) % n, (i - step) % n
            for c, (a, b) in enumerate(segs[send_s]):
                self._send(right, RING, ("r", call, n - 1 + step, c, flat[a:b]), t)
            for c, (a, b) in enumerate(segs[recv_s]):
                flat[a:b] = self._take(("r", call, n - 1 + step, c, left), t)
        return flat.reshape(value.shape)
