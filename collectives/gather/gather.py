"""Gather: every source's ``(source_task, value)`` records at one destination task."""

from __future__ import annotations

from functools import partial
from itertools import islice
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable, Iterator

from twisternet.errors import ConfigError

from ..base import Callback, Mode, pick_alias
from ..columnar import GatherTables
from ..reduce import _need_edge
from ..reduction import snapshot
from ..spill import SpillStore
from ..uptree import Node
from .chunks import append_chunk, chunk_columns, is_chunk_columns
from .quorum import FinishQuorum
from .tree import TreeGatherBase

if TYPE_CHECKING:
    from twisternet.context import Context


class Gather(GatherTables, FinishQuorum, TreeGatherBase):
    """Collect every ``(source_task, value)`` at one destination task.

    Batch: after every source finished, the destination gets all records ordered by source task and,
    within a source, in send order (spilling to disk past ``config.memory_limit``). Streaming: records
    arrive as they come, in send order per source, with no order between sources.

    ``quorum`` (batch only) lets the destination proceed without stragglers: a dict of partial-barrier
    rules (``timeout``, ``percent``, ``min_wait``, ``knee``; see ``collectives.barrier``) applied to the
    sources' ``finish`` calls as they reach the destination. When it fires, the results hold exactly
    the records of the sources that had finished, ``left_out`` lists the others, and what they send
    afterwards is dropped. Example: ``quorum={"percent": 75, "knee": True}``.
    """

    operation = "Gather"

    def __init__(self, ctx: Context, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 mode: Mode = "batch", callback: Callback | None = None, limit: int | None = None,
                 timeout: float | None = None, fanout: int = 2, quorum: Any = None,
                 destination: int | None = None, root: int | None = None, dst: int | None = None) -> None:
        # destination=/root=/dst= name the one destination task (as MPI's root and torch's dst do)
        destinations = pick_alias(type(self).__name__, "destinations", {
            "destinations": destinations, "destination": destination, "root": root, "dst": dst})
        if destinations is None and type(self) is Gather:
            destinations = [ctx.plan.tasks[0]]
        self._quorum = self._quorum_barrier(quorum, allowed=type(self) is Gather and mode == "batch")
        #: Batch with a quorum: the sources whose records were left out (None until the results form).
        self.left_out: list[int] | None = None
        super().__init__(ctx, sources, destinations, _need_edge(edge, type(self).__name__), mode=mode,
                         callback=callback, limit=limit, timeout=timeout, fanout=fanout)

    def _root_task(self) -> int:
        if len(self.destinations) != 1:
            raise ConfigError("destinations", f"{self.operation} has exactly one destination task, got "
                                              f"{self.destinations}; use AllGather for several")
        return self.destinations[0]

    def _setup(self) -> None:
        root = self._root_task()
        self._build_up({root: self.plan.rank_of(root)})
        self._build_quorum()

    # Gather's records travel and rest as *chunks* ``(source_task, [value, ...])``: on the up edges a
    # "d" payload is ``[[task, ...], [[value, ...], ...]]`` (one source task per chunk), and the batch
    # destination keeps whole chunks in a chunked SpillStore. A batch of records then costs one list and
    # one msgpack call, not one tuple per record.

    _chunked_store = True

    def send(self, task: int, value: Any, *, timeout: float | None = None, copy: bool = True) -> None:
        """Contribute ``value`` from local source ``task``; blocks under back pressure.

        ``copy=False``: the operation may keep a reference to ``value`` until its results are consumed
        (no defensive copy); the caller must not change it in the meantime.
        """
        self._send(task, value, True, timeout, copy)

    def offer(self, task: int, value: Any, *, copy: bool = True) -> bool:
        """Like :meth:`send` but returns False instead of blocking when the operation is full."""
        return self._send(task, value, False, None, copy)

    def send_many(self, task: int, values: Iterable[Any], *, timeout: float | None = None,
                  chunk: int = 4096, copy: bool = True) -> None:
        """Contribute many values from local source ``task``, in order: the same as calling :meth:`send`
        for each, done ``chunk`` values at a time (one message and one bookkeeping step per chunk).

        Chunks bound for another rank are encoded before this returns, so they are never copied; values
        kept in this process (this rank is the destination) are copied unless ``copy=False`` (see
        :meth:`send`).
        """
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        away, kept = self._sends_away(), self._keeps_local()
        it = iter(values)
        while True:
            vals = list(islice(it, chunk))
            if not vals:
                return
            direct = away and len(vals) >= self.batch_records
            if copy and (kept or not direct):
                vals = [snapshot(v) for v in vals]
            self._input(task, self._local_room,
                        partial(self._push_local, task, vals, direct),
                        block=True, timeout=timeout)

    def _send(self, task: int, value: Any, block: bool, timeout: float | None, copy: bool = True) -> bool:
        return self._input(task, self._local_room,
                           lambda: self._push_local(task, [snapshot(value) if copy else value], False),
                           block=block, timeout=timeout)

    # Where a local source's records go; batch AllGather answers these differently (direct exchange).
    def _sends_away(self) -> bool:
        """Whether local records go to another rank (full chunks then travel encoded, uncopied)."""
        return next(iter(self._nodes.values())).parent is not None

    def _keeps_local(self) -> bool:
        """Whether this process keeps local records past the send (they must then be copied)."""
        return not self._sends_away()

    def _local_room(self) -> bool:
        return self._input_room(next(iter(self._nodes.values())))

    def _push_local(self, task: int, vals: list, direct: bool) -> None:
        """Records of local source ``task`` (under the lock). ``direct``: sent on now, in their own message
        (a full batch: encoded by this call or parked until the caller's send returns)."""
        node = next(iter(self._nodes.values()))
        if node.parent is None:
            self._root_chunks(node, [(task, vals)])
        elif self.mode != "batch":
            self._up_send(node, "d", [[task], [vals]])
        elif direct:
            self._flush_node(node)
            self._up_send(node, "d", [[task], [vals]])
        elif append_chunk(self._outbuf.setdefault(node.tid, []), task, vals) >= self.batch_records:
            self._flush_node(node)

    def _flush_node(self, node: Node) -> None:
        buf = self._outbuf.pop(node.tid, None)
        if buf:
            self._up_send(node, "d", chunk_columns(buf))

    def _held(self) -> int:
        return sum(len(c) for b in self._outbuf.values() for _, c in b)

    def _up_data(self, node: Node, src: int, payload: Any) -> bool:
        if not self._input_room(node):
            return False
        if not is_chunk_columns(payload):
            raise self._protocol(src, payload)
        if node.parent is not None:
            self._up_send(node, "d", payload)   # forwarded whole: encoded again by this call
            return True
        tasks, chunks = payload
        if not all(t in self._sources_set for t in tasks):
            raise self._protocol(src, payload)
        self._root_chunks(node, [(t, self._own_values(c)) for t, c in zip(tasks, chunks)])
        return True

    def _root_chunks(self, node: Node, chunks: list) -> None:
        if self.mode == "batch":
            if self._quorum is not None and node.complete:
                return   # records from a source left out
            store: SpillStore = node.state
            for src, vals in chunks:
                store.add_chunk(src, vals)
        else:
            for src, vals in chunks:
                for v in vals:
                    self._deliver(node.tid, (src, v))

    def _root_complete(self, node: Node) -> None:
        if self.mode == "batch":
            store = node.state
            self.left_out = []
            self._complete(node.tid, lambda: iter(store), store.values)
        else:
            self._end(node.tid)

    def values(self, task: int | None = None, *, timeout: float | None = None) -> Iterator[Any]:
        """Batch: the values of :meth:`results` without their source tasks (same order, no tuples)."""
        return self._iter_values(task, timeout)
