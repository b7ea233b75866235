"""Reduce and AllReduce: values of many sources combined up a k-ary tree with a partial reduce per node."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterable

import numpy as np

from twisternet.errors import ConfigError

from .base import Callback, Mode, pick_alias, record_nbytes
from .downtree import DownTreeMixin
from .reduction import ReduceFn, Reduction, own, snapshot
from .uptree import Node, UpTreeOperation

#: AllReduce's default pipelining unit for ring and tree (see ``chunk_bytes``).
LOCAL_CHUNK_BYTES = 4 << 20
#: ... and for a ring whose ranks span hosts.
CROSS_HOST_CHUNK_BYTES = 1 << 20

if TYPE_CHECKING:
    from twisternet.context import Context


def _pick_op(op: str | ReduceFn | None, reduce: str | ReduceFn | None) -> str | ReduceFn:
    if op is not None and reduce is not None:
        raise ConfigError("op", "give the reduction as op= or reduce=, not both")
    chosen = reduce if reduce is not None else op
    return "sum" if chosen is None else chosen


def _need_edge(edge: int | None, name: str) -> int:
    if edge is None:
        raise ConfigError("edge", f"{name} needs an edge id (edge=...), distinct for each concurrent operation")
    return edge


class _Rounds:
    """Streaming reduce state of one node: a queue per input (local task or child rank), each bounded in
    records (``limit`` shared by the inputs) and in bytes (``byte_limit`` shared alike, counted as
    :func:`record_nbytes`; a queue always takes one value, so a round can always form)."""

    __slots__ = ("order", "queues", "done", "qlimit", "qbytes", "qbyte_limit")

    def __init__(self, inputs: list[tuple[str, int]], limit: int, byte_limit: int) -> None:
        self.order = inputs
        self.queues: dict[tuple[str, int], deque] = {i: deque() for i in inputs}
        self.done: set[tuple[str, int]] = set()
        self.qlimit = max(1, limit // max(1, len(inputs)))
        self.qbytes: dict[tuple[str, int], int] = dict.fromkeys(inputs, 0)
        self.qbyte_limit = max(1, byte_limit // max(1, len(inputs)))

    def room(self, i: tuple[str, int]) -> bool:
        """Whether input ``i`` may queue one more value."""
        q = self.queues[i]
        return not q or (len(q) < self.qlimit and self.qbytes[i] < self.qbyte_limit)

    def push(self, i: tuple[str, int], value: Any) -> None:
        self.queues[i].append(value)
        self.qbytes[i] += record_nbytes(value)

    def pop(self, i: tuple[str, int]) -> Any:
        value = self.queues[i].popleft()
        self.qbytes[i] -= record_nbytes(value)
        return value


class Reduce(UpTreeOperation):
    """Reduce the values of ``sources`` into one destination task.

    ``send(task, value)`` from a source; ``finish(task)`` ends that source. Batch: the destination gets
    one value, the reduction of every value sent (``result()``; None if nothing was sent). Streaming: the
    destination gets, in order, round ``i`` = the reduction of the ``i``-th value of every source that
    sent at least ``i + 1`` values; a round forms once every unfinished source has sent its ``i``-th value.
    """

    operation = "Reduce"

    def __init__(self, ctx: Context, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 op: str | ReduceFn | None = None, reduce: str | ReduceFn | None = None,
                 mode: Mode = "batch", callback: Callback | None = None, limit: int | None = None,
                 timeout: float | None = None, fanout: int = 2, destination: int | None = None,
                 root: int | None = None, dst: int | None = None) -> None:
        # destination=/root=/dst= name the one destination task (as MPI's root and torch's dst do)
        destinations = pick_alias(type(self).__name__, "destinations", {
            "destinations": destinations, "destination": destination, "root": root, "dst": dst})
        self.reduction = Reduction(_pick_op(op, reduce))
        if destinations is None and type(self) is Reduce:
            destinations = [ctx.plan.tasks[0]]
        super().__init__(ctx, sources, destinations, _need_edge(edge, type(self).__name__), mode=mode,
                         callback=callback, limit=limit, timeout=timeout, fanout=fanout)

    def _root_task(self) -> int:
        if len(self.destinations) != 1:
            raise ConfigError("destinations", f"{self.operation} has exactly one destination task, got "
                                              f"{self.destinations}; use AllReduce for several")
        return self.destinations[0]

    def _setup(self) -> None:
        root = self._root_task()
        self._build_up({root: self.plan.rank_of(root)})

    def describe(self) -> str:
        return f"{self.mode} {self.operation}({self.reduction.name})"

    # ------------------------------------------------------------------ state
    def _new_state(self, node: Node) -> Any:
        if self.mode == "batch":
            return []
        inputs = [("t", t) for t in self.local_sources] + [("r", c) for c in node.children]
        return _Rounds(inputs, self.limit, self.byte_limit)

    def _node(self) -> Node:
        return next(iter(self._nodes.values()))

    def _acc(self, state: list, value: Any, *, copy: Callable[[Any], Any]) -> None:
        if state:
            state[0] = self.reduction.combine(state[0], value)
        else:
            state.append(copy(value))

    def _rounds(self, node: Node) -> None:
        st: _Rounds = node.state
        while True:
            live = [i for i in st.order if st.queues[i] or i not in st.done]
            if not live or any(not st.queues[i] for i in live):
                return
            acc = st.pop(live[0])
            for i in live[1:]:
                acc = self.reduction.combine(acc, st.pop(i))
            if node.parent is not None:
                self._up_send(node, "d", acc)
            else:
                self._root_value(acc)

    def _held(self) -> int:
        if self.mode == "batch":
            return 0
        return sum(len(q) for n in self._nodes.values() for q in n.state.queues.values())

    def _root_value(self, value: Any) -> None:
        self._deliver(self._node().tid, value)

    # ------------------------------------------------------------------ public API
    def send(self, task: int, value: Any, *, timeout: float | None = None) -> None:
        """Contribute ``value`` from local source ``task``; blocks under back pressure."""
        self._send(task, value, True, timeout)

    def offer(self, task: int, value: Any) -> bool:
        """Like :meth:`send` but returns False instead of blocking when the operation is full."""
        return self._send(task, value, False, None)

    def _send(self, task: int, value: Any, block: bool, timeout: float | None) -> bool:
        if self.reduction.average:
            raise ConfigError("op", f"{self.operation}(op={self.reduction.name!r}): send() does not count the values "
                                    "it combines, so it cannot average; use op='avg' with the rank-level "
                                    "allreduce() or tn.all_reduce/tn.reduce, or send sums and divide")
        node = self._node()
        if self.mode == "batch":
            return self._input(task, lambda: True, lambda: self._acc(node.state, value, copy=snapshot),
                               block=block, timeout=timeout)
        st: _Rounds = node.state
        inp = ("t", task)

        def room() -> bool:
            return st.room(inp) and self._out_room(node)

        def mutate() -> None:
            st.push(inp, snapshot(value))
            self._rounds(node)
        return self._input(task, room, mutate, block=block, timeout=timeout)

    def result(self, task: int | None = None, *, timeout: float | None = None) -> Any:
        """Batch: the reduced value at local destination ``task`` (None if no source sent anything)."""
        if self.mode != "batch":
            raise ConfigError("mode", "result() is for batch mode; iterate results() in streaming mode")
        task = self._dest(task)     # a rank without a destination has no result: a clear error
        got = list(self.results(task, timeout=timeout))
        return got[0] if got else None

    # ------------------------------------------------------------------ hooks
    def _up_data(self, node: Node, src: int, payload: Any) -> bool:
        if self.mode == "batch":
            raise self._protocol(src, payload)
        st: _Rounds = node.state
        inp = ("r", src)
        if inp not in st.queues:
            raise self._protocol(src, payload)
        if not st.room(inp) or not self._out_room(node):
            return False
        st.push(inp, self._own(payload))
        self._rounds(node)
        return True

    def _up_child_done(self, node: Node, src: int, payload: Any) -> None:
        if self.mode == "batch":
            for v in payload:
                self._acc(node.state, v, copy=own)
        else:
            node.state.done.add(("r", src))
            self._rounds(node)

    def _up_local_finish(self, node: Node, task: int) -> None:
        if self.mode == "streaming":
            node.state.done.add(("t", task))
            self._rounds(node)

    def _up_ready(self, node: Node) -> bool:
        return self.mode == "batch" or not any(node.state.queues.values())

    def _up_final(self, node: Node) -> Any:
        return list(node.state) if self.mode == "batch" else None

    def _root_complete(self, node: Node) -> None:
        if self.mode == "batch":
            value = list(node.state)
            self._complete(node.tid, lambda: iter(value))
        else:
            self._end(node.tid)


class AllReduce(DownTreeMixin, Reduce):
    """Reduce to a root (the rank of the first destination) and broadcast the result to every destination.

    Same values and order as :class:`Reduce`, delivered at every destination task. ``destinations``
    defaults to ``sources`` (default: every task). :meth:`allreduce` is the rank-level one-shot form
    (MPI style) with chunked/ring algorithms for large arrays: ``via`` picks the algorithm ("auto":
    shared memory for numpy arrays with a named reduction when every rank of the operation can map the
    first rank's segment, i.e. they share a host; otherwise, for arrays with a named reduction, the ring
    from ``ring_threshold`` bytes and recursive doubling ("doubling") below, and the tree for any other
    value; when the ranks span several hosts, "hier": inside each host, then between the host leaders,
    see docs/topology.md; "shm", "ring", "doubling", "tree", "hier" and "innet" force one),
    ``chunk_bytes`` the pipelining unit of ring and tree (by default 4 MB, and 1 MB for a ring whose
    ranks span hosts: smaller chunks overlap more but pay the per-message cost more often; measured on
    2-4 local workers, 4 MB beat 1 MB by 10-45% at 16-64 MB; across hosts the link, not the
    per-message cost, sets the pace, and the last chunk's transfer is the ring's tail: 2 hosts at
    1 Gbit/s, 64 MB, 1 MB chunks took 561.5-562.4 ms against 563.0-564.1), ``shm_chunk_bytes`` the
    size of a shared-memory slot (see :mod:`collectives.allreduce.shm`).
    """

    operation = "AllReduce"

    def __init__(self, ctx: Context, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 op: str | ReduceFn | None = None, reduce: str | ReduceFn | None = None,
                 mode: Mode = "batch", callback: Callback | None = None, limit: int | None = None,
                 timeout: float | None = None, fanout: int = 2, via: str = "auto",
                 chunk_bytes: int | None = None, ring_threshold: int = 1 << 20,
                 shm_chunk_bytes: int = 1 << 20) -> None:
        from .allreduce import VIAS
        if via not in VIAS:
            raise ConfigError("via", f"must be one of {', '.join(VIAS)}, got {via!r}")
        if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or chunk_bytes < 1024):
            raise ConfigError("chunk_bytes", f"must be None (automatic) or an int >= 1024, got {chunk_bytes!r}")
        if not isinstance(shm_chunk_bytes, int) or shm_chunk_bytes < 4096 or shm_chunk_bytes % 64:
            raise ConfigError("shm_chunk_bytes",
                              f"must be an int >= 4096 and a multiple of 64, got {shm_chunk_bytes!r}")
        self.via = via
        #: The pipelining unit (bytes) of ring and tree; a ring across hosts uses ``cross_host_chunk_bytes``.
        self.chunk_bytes = LOCAL_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self.cross_host_chunk_bytes = CROSS_HOST_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self.shm_chunk_bytes = shm_chunk_bytes
        self.ring_threshold = ring_threshold
        if destinations is None:
            destinations = sources
        super().__init__(ctx, sources, destinations, edge, op=op, reduce=reduce, mode=mode, callback=callback,
                         limit=limit, timeout=timeout, fanout=fanout)

    def _root_task(self) -> int:
        return self.destinations[0]

    def _release_storage(self) -> None:
        rar = getattr(self, "_rank_allreduce", None)
        if rar is not None:
            rar.close()
        super()._release_storage()

    def _setup(self) -> None:
        super()._setup()
        root = self.plan.rank_of(self._root_task())
        self._build_down(root)
        from .allreduce import RankAllReduce
        self._rank_allreduce = RankAllReduce(self)

    def _root_room(self, node: Node) -> bool:
        return self._down_room()

    def _root_value(self, value: Any) -> None:
        self._down_emit([value])

    def _root_finished(self, tasks: list[int]) -> None:
        self._down_info(tasks)

    def _root_complete(self, node: Node) -> None:
        if self.mode == "batch" and node.state:
            self._down_emit([node.state[0]])
        self._down_end()

    def _known_finished(self, task: int | None) -> set[int]:
        return super()._known_finished(self._root_task()) | self._down_finished

    def allreduce_async(self, value: Any, *, out: np.ndarray | None = None, timeout: float | None = None) -> Any:
        """Non-blocking :meth:`allreduce`: returns a :class:`collectives.handles.Handle` at once (``wait()``
        gives what ``allreduce`` would; ``get_future()``, ``is_completed()``). The call is queued on the
        Context's collective stream, which runs such calls in submission order; do not call the blocking
        ``allreduce`` of the same operation while its handles are pending."""
        from .handles import Handle, engine
        h = Handle(self.ctx, f"{self.describe()}.allreduce() on edge {self.edge}", timeout=timeout)
        return engine(self.ctx).submit(h, lambda: self.allreduce(value, out=out, timeout=timeout))

    def allreduce(self, value: Any, *, out: np.ndarray | None = None, timeout: float | None = None) -> Any:
        """Rank-level collective: every rank running a task of this operation calls it once with its value
        and gets the reduction of all of them. Numpy arrays with a named reduction go through shared
        memory when all the ranks share a host, else (large ones) over a ring (reduce-scatter +
        allgather, chunked); the rest over the tree, chunked and pipelined.

        ``out`` (numpy arrays only): a C-contiguous array of the value's shape and dtype that receives the
        result and is returned; it may be ``value`` itself (in place, as torch.distributed does), which
        saves allocating (and faulting in) a fresh result array on every call."""
        result = self._rank_allreduce.run(value, timeout, out)
        n = len(self._rank_allreduce.ranks)
        if self.reduction.average and n > 1:   # "avg": the sum of one value per rank, divided once
            result = self.reduction.finalize(result, n)
            if out is not None and result is not out:
                out[...] = result
                return out
        return result
