"""Gather, AllGather and KeyedGather: records of many sources collected up k-ary trees.

Inner nodes forward records as they arrive (no holding beyond the per-operation limit); batch
destinations keep them in a :class:`~collectives.spill.SpillStore` bounded by ``config.memory_limit``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from itertools import islice
from typing import Any, Iterable, Iterator, Mapping

from twisternet.errors import ConfigError

from .base import Callback, Mode
from .columns import from_columns, to_columns
from .downtree import DownTreeMixin
from .edges import DOWN, channel_edge
from .reduce import _need_edge
from .reduction import own_values, snapshot
from .routing import Selector, check_key_type, hash_selector, normalize_key
from .spill import SpillStore, estimate_size
from .uptree import Node, UpTreeOperation

log = logging.getLogger(__name__)


class _TreeGatherBase(UpTreeOperation):
    """Forwarding up a tree; subclasses say what a record is and how the root keeps it."""

    def _new_store(self, sort: bool = True) -> SpillStore:
        share = max(1024, self.ctx.config.memory_limit // max(1, len(self.local_destinations)))
        return SpillStore(share, self.ctx.config.spill_dir, sort=sort, name=f"{self.operation}(edge={self.edge})")

    def _new_state(self, node: Node) -> Any:
        if not hasattr(self, "_outbuf"):
            self._outbuf: dict[int, list] = {}
        if node.is_root and self.mode == "batch":
            return self._new_store()
        return None

    def _input_room(self, node: Node) -> bool:
        if node.parent is None:
            return self.mode == "batch" or self._root_room(node)
        return self._out_room(node)

    #: Items per record: (task, value) here, (key, task, value) for KeyedGather.
    _record_width = 2

    #: Batch mode: local records are sent up in lists of this many (fewer messages, same order).
    batch_records = 256

    def _push(self, node: Node, items: list, *, local: bool = False) -> None:
        if node.parent is None:
            self._root_items(node, items)
        elif local and self.mode == "batch":
            buf = self._outbuf.setdefault(node.tid, [])
            buf.extend(items)
            if len(buf) >= self.batch_records:
                self._flush_node(node)
        else:
            self._up_send(node, "d", to_columns(items, self._record_width))

    def _flush_node(self, node: Node) -> None:
        buf = self._outbuf.pop(node.tid, None)
        if buf:
            self._up_send(node, "d", to_columns(buf, self._record_width))

    def _held(self) -> int:
        return sum(len(b) for b in self._outbuf.values())

    def _up_data(self, node: Node, src: int, payload: Any) -> bool:
        if not self._input_room(node):
            return False
        try:
            if node.parent is None:   # kept past this call: no views of receive buffers
                payload[-1] = own_values(payload[-1])
            items = from_columns(payload, self._record_width)
        except (ValueError, TypeError, IndexError):
            raise self._protocol(src, payload) from None
        self._push(node, items)
        return True

    def _root_items(self, node: Node, items: list) -> None:
        raise NotImplementedError

    def _release_storage(self) -> None:
        for node in getattr(self, "_nodes", {}).values():
            if isinstance(node.state, SpillStore):
                node.state.close()
        super()._release_storage()


class Gather(_TreeGatherBase):
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

    def __init__(self, ctx: Any, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 mode: Mode = "batch", callback: Callback | None = None, limit: int | None = None,
                 timeout: float | None = None, fanout: int = 2, quorum: Any = None) -> None:
        if destinations is None and type(self) is Gather:
            destinations = [ctx.plan.tasks[0]]
        self._quorum = self._quorum_barrier(quorum, mode, edge)
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
        if self._quorum is not None:
            from .barrier.partial import PartialBarrier as _Rules   # the pure state machine
            self._quorum = _Rules(f"gather-quorum-{self.edge}", max=len(self.sources), late="pass",
                                  **self._quorum_rules)

    def send(self, task: int, value: Any, *, timeout: float | None = None) -> None:
        """Contribute ``value`` from local source ``task``; blocks under back pressure."""
        self._send(task, value, True, timeout)

    def offer(self, task: int, value: Any) -> bool:
        """Like :meth:`send` but returns False instead of blocking when the operation is full."""
        return self._send(task, value, False, None)

    def send_many(self, task: int, values: Iterable[Any], *, timeout: float | None = None,
                  chunk: int = 4096) -> None:
        """Contribute many values from local source ``task``, in order: the same as calling :meth:`send`
        for each, with the per-record bookkeeping done once per ``chunk`` values."""
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        node = next(iter(self._nodes.values()))
        it = iter(values)
        while True:
            batch = [(task, snapshot(v)) for v in islice(it, chunk)]
            if not batch:
                return
            self._input(task, lambda: self._input_room(node), lambda: self._push(node, batch, local=True),
                        block=True, timeout=timeout)

    def _send(self, task: int, value: Any, block: bool, timeout: float | None) -> bool:
        node = next(iter(self._nodes.values()))
        return self._input(task, lambda: self._input_room(node),
                           lambda: self._push(node, [(task, snapshot(value))], local=True), block=block, timeout=timeout)

    def _root_items(self, node: Node, items: list) -> None:
        if self.mode == "batch":
            if self._quorum is not None and node.complete:
                self._late_records += len(items)   # from a source the quorum left out
                return
            store: SpillStore = node.state
            for src, v in items:
                store.add(src, v)
        else:
            for it in items:
                self._deliver(node.tid, tuple(it))

    def _root_complete(self, node: Node) -> None:
        if self.mode == "batch":
            store = node.state
            self.left_out = []
            self._complete(node.tid, lambda: (tuple(r) for r in store))
        else:
            self._end(node.tid)

    # ------------------------------------------------------------------ finish quorum (batch)
    def _quorum_barrier(self, quorum: Any, mode: str, edge: Any) -> Any:
        """A partial barrier over the sources' finishes, run at the destination (None: wait for all).

        ``quorum`` is a dict (or BarrierSpec) of partial-barrier rules without ``max`` (the number of
        sources): ``timeout``, ``percent``, ``min_wait``, ``knee``. When it fires, the destination's
        results hold the records of the sources that had finished; ``left_out`` names the others and
        whatever they send later is dropped.
        """
        if quorum is None:
            return None
        if type(self) is not Gather or mode != "batch":
            raise ConfigError("quorum", "a finish quorum is for batch Gather only")
        from .barrier.specs import BarrierSpec
        rules = quorum.to_dict() if isinstance(quorum, BarrierSpec) else dict(quorum)
        rules.pop("max", None)
        rules.pop("late", None)
        unknown = set(rules) - {"timeout", "percent", "min_wait", "knee"}
        if unknown:
            raise ConfigError("quorum", f"unknown rules {sorted(unknown)}; use timeout, percent, min_wait, knee")
        self._quorum_rules = rules
        self._late_records = 0
        self._quorum_timer: Any = None
        return True   # the state machine is built in _setup, once the sources are known

    def _root_finished(self, tasks: list[int]) -> None:
        super()._root_finished(tasks)
        if self._quorum is None or self.left_out is not None:
            return
        now = time.monotonic()
        releases = []
        for t in tasks:
            releases.extend(self._quorum.enter(str(t), 0, now).releases)
        self._quorum_settle(releases)

    def _quorum_tick(self) -> None:
        with self._lock:
            if self.left_out is None and not self._closed:
                self._quorum_settle(self._quorum.tick(time.monotonic()))
        self._after()

    def _quorum_settle(self, releases: list) -> None:
        """Under the lock: complete on a fire, else arm a timer for the barrier's next deadline."""
        if releases:
            passed = {int(label) for label in releases[0].fire.passed}
            node = next(iter(self._nodes.values()))
            node.complete = True
            store = node.state
            self.left_out = sorted(set(self.sources) - passed)
            if self.left_out:
                log.warning("%s on edge %d: finish quorum (%s) reached without sources %s; their records "
                            "are left out", self.describe(), self.edge, releases[0].fire.reason.value,
                            self.left_out)
            self._complete(node.tid, lambda: (tuple(r) for r in store if r[0] in passed))
            self._changed = True
            return
        deadline = self._quorum.next_deadline()
        if deadline is not None:
            if self._quorum_timer is not None:
                self._quorum_timer.cancel()
            self._quorum_timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._quorum_tick)
            self._quorum_timer.daemon = True
            self._quorum_timer.start()


class AllGather(DownTreeMixin, Gather):
    """Gather at a root (the rank of the first destination), then broadcast to every destination task.

    Every destination gets the same records as :class:`Gather` in the same order (batch), or each
    record as it reaches the root (streaming; all destinations see the same order).
    """

    operation = "AllGather"

    def __init__(self, ctx: Any, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 mode: Mode = "batch", callback: Callback | None = None, limit: int | None = None,
                 timeout: float | None = None, fanout: int = 2) -> None:
        if destinations is None:
            destinations = sources
        super().__init__(ctx, sources, destinations, edge, mode=mode, callback=callback, limit=limit,
                         timeout=timeout, fanout=fanout)

    def _root_task(self) -> int:
        return self.destinations[0]

    def _setup(self) -> None:
        super()._setup()
        self._build_down(self.plan.rank_of(self._root_task()))
        self._sender: threading.Thread | None = None

    def _root_room(self, node: Node) -> bool:
        return self._down_room()

    def _root_items(self, node: Node, items: list) -> None:
        if self.mode == "batch":
            super()._root_items(node, items)
        else:
            self._down_emit([tuple(it) for it in items])

    def _root_finished(self, tasks: list[int]) -> None:
        self._down_info(tasks)

    def _known_finished(self, task: int | None) -> set[int]:
        return super()._known_finished(self._root_task()) | self._down_finished

    def _root_complete(self, node: Node) -> None:
        if self.mode == "streaming":
            self._down_end()
            return
        store: SpillStore = node.state
        self._down_ended = True
        for t in self.local_destinations:
            self._complete(t, lambda: (tuple(r) for r in store))
        if self._down_children:
            # Stream the (possibly spilled) result down from a thread: blocking sends, bounded memory.
            self._sender = threading.Thread(target=self._broadcast_store, args=(store,), daemon=True,
                                            name=f"twisternet-allgather-{self.edge}")
            self._sender.start()

    def _broadcast_store(self, store: SpillStore) -> None:
        e = channel_edge(self.edge, DOWN)
        log.debug("rank %d: %s broadcasting %d gathered records", self.rank, self.describe(), len(store))
        try:
            batch, size = [], 0
            for i, rec in enumerate(store):
                batch.append(rec)
                if not i & 15:   # a sample is enough to size the batches
                    size += 16 * estimate_size(rec[1])
                if size >= self.ctx.config.buffer_size // 2 or len(batch) >= 4096:
                    msg = ("c", to_columns(batch, 2))
                    for c in self._down_children:
                        self.ctx.send(c, e, msg, timeout=self.timeout)
                    batch, size = [], 0
            for c in self._down_children:
                if batch:
                    self.ctx.send(c, e, ("c", to_columns(batch, 2)), timeout=self.timeout)
                self.ctx.send(c, e, ("e", None), timeout=self.timeout)
        except Exception as ex:  # noqa: BLE001 - surfaces to this rank's waiters
            with self._lock:
                self._fail(ex, "while broadcasting gathered records")
            self.ctx.notify()

    def _duties_done(self) -> bool:
        sender = getattr(self, "_sender", None)
        return (sender is None or not sender.is_alive()) and super()._duties_done()

    def _release_storage(self) -> None:
        sender = getattr(self, "_sender", None)
        if sender is not None and sender.is_alive() and sender is not threading.current_thread():
            sender.join(self.timeout)
        super()._release_storage()


class KeyedGather(_TreeGatherBase):
    """Collect ``(key, value)`` records at the destination chosen by the key (one tree per destination).

    Batch: each destination gets its keys in ascending order (keys must be mutually orderable), values of
    a key ordered by source task and then send order; with ``group=True`` (default) as
    ``(key, [values])``, else as ``(key, value)`` pairs. Spills to disk past ``config.memory_limit``.
    Streaming: ``(key, value)`` as they arrive, in send order per source. With ``group=True`` the values
    of one key are collected in a list, so one key's values must fit in memory (``group=False`` streams).
    """

    operation = "KeyedGather"
    _record_width = 3

    def __init__(self, ctx: Any, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 key_type: str = "object", selector: Selector | None = None, group: bool = True,
                 mode: Mode = "batch", callback: Callback | None = None, limit: int | None = None,
                 timeout: float | None = None, fanout: int = 2) -> None:
        self.key_type = check_key_type(key_type)
        self.selector: Selector = selector or hash_selector
        self.group = group
        super().__init__(ctx, sources, destinations, _need_edge(edge, type(self).__name__), mode=mode,
                         callback=callback, limit=limit, timeout=timeout, fanout=fanout)

    def _setup(self) -> None:
        self._build_up({d: self.plan.rank_of(d) for d in self.destinations})

    def _select(self, key: Any) -> int:
        d = self.selector(key, self.destinations)
        if d not in self._nodes:
            raise ValueError(f"selector returned {d!r} for key {key!r}; it must return one of the "
                             f"destinations {self.destinations}")
        return d

    def send(self, task: int, key: Any, value: Any, *, timeout: float | None = None) -> None:
        """Send ``value`` under ``key`` from local source ``task``; blocks under back pressure."""
        self._send(task, key, value, True, timeout)

    def offer(self, task: int, key: Any, value: Any) -> bool:
        """Like :meth:`send` but returns False instead of blocking when the operation is full."""
        return self._send(task, key, value, False, None)

    def send_many(self, task: int, items: Iterable[tuple[Any, Any]] | Mapping[Any, Any], *,
                  timeout: float | None = None, chunk: int = 4096) -> None:
        """Contribute many ``(key, value)`` pairs (or a mapping) from local source ``task``: the same as
        calling :meth:`send` for each, routed and handed over per destination ``chunk`` at a time."""
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        self._check_source(task)
        pairs = items.items() if isinstance(items, Mapping) else items
        by_dest: dict[int, list] = {}
        kt = self.key_type

        def hand_over(d: int, batch: list) -> None:
            node = self._nodes[d]
            self._input(task, lambda: self._input_room(node), lambda: self._push(node, batch, local=True),
                        block=True, timeout=timeout)

        for key, value in pairs:
            key = normalize_key(key, kt)
            d = self._select(key)
            batch = by_dest.get(d)
            if batch is None:
                batch = by_dest[d] = []
            batch.append((key, task, snapshot(value)))
            if len(batch) >= chunk:
                by_dest[d] = []
                hand_over(d, batch)
        for d, batch in by_dest.items():
            if batch:
                hand_over(d, batch)

    def _send(self, task: int, key: Any, value: Any, block: bool, timeout: float | None) -> bool:
        key = normalize_key(key, self.key_type)
        self._check_source(task)
        node = self._nodes[self._select(key)]
        return self._input(task, lambda: self._input_room(node),
                           lambda: self._push(node, [(key, task, snapshot(value))], local=True), block=block, timeout=timeout)

    def _root_items(self, node: Node, items: list) -> None:
        if self.mode == "batch":
            store: SpillStore = node.state
            try:
                for key, src, v in items:
                    store.add((key, src), v)
            except TypeError as e:
                raise TypeError(f"KeyedGather batch results are sorted by key: {e}") from None
        else:
            for key, _src, v in items:
                self._deliver(node.tid, (key, v))

    def _batch_items(self, store: SpillStore) -> Iterator[Any]:
        if self.group:
            for key, recs in itertools.groupby(store, key=lambda r: r[0][0]):
                yield key, [v for _, v in recs]
        else:
            for (key, _src), v in store:
                yield key, v

    def _root_complete(self, node: Node) -> None:
        if self.mode == "batch":
            store = node.state
            self._complete(node.tid, lambda: self._batch_items(store))
        else:
            self._end(node.tid)
