"""Ring allreduce: reduce-scatter then allgather around a list of ranks, pipelined chunk by chunk.

Used flat (every rank of the operation, records ``r``) and between host leaders by the hierarchical
algorithm (records ``R``): :meth:`RingPath._ring` takes the ranks and the record kind.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import numpy as np

from twisternet.context import SendHandle
from twisternet.errors import (
    ClosedError,
    OperationTimeout,
    ProtocolError,
    TwisternetError,
)

from ..edges import RING, channel_edge
from .mismatch import describe_value, merge_groups, mismatch_error
from .plumbing import RecordPlumbing


class RingPath(RecordPlumbing):
    """Mixin of :class:`~collectives.allreduce.rank.RankAllReduce`: the ring algorithm."""

    def _ring(self, value: np.ndarray, call: int, t: float, out: np.ndarray | None = None,
              ranks: Sequence[int] | None = None, kind: str = "r", cross_host: bool | None = None) -> np.ndarray:
        """Reduce-scatter then allgather around ``ranks`` (default: the operation's), pipelined chunk by
        chunk, with records of ``kind``. ``cross_host``: whether the ranks span hosts, which sets the
        chunk size (it must be the same answer on every rank; None: what the task plan knows alike
        everywhere, see ``_topology``).

        Every chunk is forwarded as soon as it is complete, and the records of the call in progress are
        applied by the handler straight into the result (no copy out of the receive buffer): in the
        reduce-scatter each rank receives every segment but its own exactly once, so the result there is
        ``input + received`` written once; in the allgather the received chunk is the result. The input
        is only read, and no copy of it is made.
        """
        op = self.op
        ranks = list(self.ranks if ranks is None else ranks)
        n = len(ranks)
        i = ranks.index(op.rank)
        right = ranks[(i + 1) % n]
        src = np.ascontiguousarray(value).reshape(-1)
        result = np.empty_like(src) if out is None else out.reshape(-1)
        if out is not None and out is value:
            src = result   # in place: each element is read (sent or combined) before it is overwritten
        edges = [src.size * k // n for k in range(n + 1)]
        if cross_host is None:
            topo = op.ctx.plan.topology(ranks)
            cross_host = topo is not None and topo.nhosts > 1
        chunk = op.cross_host_chunk_bytes if cross_host else op.chunk_bytes
        segs = [self._chunks(edges[s], edges[s + 1], src.itemsize, chunk) for s in range(n)]
        rc = _RingCall(call, n, i, src, result, segs, op.reduction.ufunc, describe_value(value), kind)
        try:
            with op._state_lock():
                self.ring = rc
                for key in sorted(k for k in self.stash if k[0] == kind and k[1] == call):
                    self._apply(rc, key[2], key[3], self.stash.pop(key), key[4])
        except TwisternetError as e:
            self.ring = None
            raise self._failed(e, f"in allreduce() call {call}", call) from None
        handles: list[SendHandle] = []
        ring_edge = channel_edge(op.edge, RING)

        def send(step: int, c: int, chunk: np.ndarray) -> None:
            rec: tuple = (kind, call, step, c, chunk)
            if step == 0 and c == 0:
                rec += ({rc.desc: [op.rank]},)    # the right neighbour compares it with its own
            handles.append(op.ctx.isend(right, ring_edge, rec, timeout=t))

        try:
            for c, (a, b) in enumerate(segs[i]):             # reduce-scatter step 0: own input
                send(0, c, src[a:b])
            for step in range(2 * (n - 1)):
                s = (i - step - 1) % n if step < n - 1 else (i - (step - (n - 1))) % n
                for c, (a, b) in enumerate(segs[s]):
                    self._wait_applied(rc, step, c, ranks[(i - 1) % n], t)
                    if step + 1 < 2 * (n - 1):
                        send(step + 1, c, result[a:b])
            for h in handles:
                h.wait()
        finally:
            with op._state_lock():
                self.ring = None
        return result.reshape(value.shape) if out is None else out

    def _apply(self, rc: _RingCall, step: int, c: int, payload: Any, src: int) -> None:
        """Put ring record (step, chunk c) of the call in progress into its place (under the op lock)."""
        n, i = rc.n, rc.i
        s = (i - step - 1) % n if step < n - 1 else (i - (step - (n - 1))) % n
        if not (0 <= step < 2 * (n - 1)) or not (0 <= c < len(rc.segs[s])):
            raise ProtocolError(f"allreduce() ring: rank {src} sent step {step} chunk {c}, which does not exist")
        if step == 0 and c == 0:
            with self.op._state_lock():
                theirs = self.groups.pop((rc.kind, rc.call, src), None)
            if theirs is not None:
                groups = merge_groups({rc.desc: [self.op.rank]}, theirs)
                if len(groups) > 1:
                    raise mismatch_error(rc.call, groups)
        a, b = rc.segs[s][c]
        if not isinstance(payload, np.ndarray) or payload.dtype != rc.out.dtype or payload.size != b - a:
            raise ProtocolError(f"allreduce() ring: rank {src} sent "
                                f"{getattr(payload, 'dtype', type(payload).__name__)} x "
                                f"{getattr(payload, 'size', '?')} for a chunk of {b - a} x {rc.out.dtype} "
                                "(every rank must pass arrays of the same shape and dtype)")
        if (step, c) in rc.applied:
            raise ProtocolError(f"allreduce() ring: rank {src} sent step {step} chunk {c} twice")
        if step < n - 1:
            rc.ufunc(rc.src[a:b], payload.reshape(-1), out=rc.out[a:b])
        else:
            rc.out[a:b] = payload.reshape(-1)
        rc.applied.add((step, c))

    def _wait_applied(self, rc: _RingCall, step: int, c: int, left: int, timeout: float) -> None:
        op = self.op

        def ready() -> bool:
            return (step, c) in rc.applied or op._over()

        def on_timeout() -> BaseException:
            return OperationTimeout(f"allreduce() call {rc.call}: no data from rank {left} "
                                    f"(ring step {step}, chunk {c})", edge=op.edge, operation=op.operation,
                                    timeout=timeout)
        op.ctx.wait_until(ready, timeout=timeout, on_timeout=on_timeout)
        op._raise_if_failed()
        if (step, c) not in rc.applied:
            raise ClosedError(f"{op.describe()} was closed during allreduce()")


class _RingCall:
    """The ring allreduce call in progress on this rank: where its records go and which have arrived."""

    __slots__ = ("call", "n", "i", "src", "out", "segs", "ufunc", "applied", "desc", "kind")

    def __init__(self, call: int, n: int, i: int, src: np.ndarray, out: np.ndarray,
                 segs: list[list[tuple[int, int]]], ufunc: Any, desc: str, kind: str = "r") -> None:
        self.kind = kind
        self.call, self.n, self.i = call, n, i
        self.src, self.out, self.segs, self.ufunc = src, out, segs, ufunc
        self.desc = desc
        self.applied: set[tuple[int, int]] = set()
