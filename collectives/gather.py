"""Gather, AllGather and KeyedGather: records of many sources collected up k-ary trees.

Inner nodes forward records as they arrive (no holding beyond the per-operation limit); batch
destinations keep them in a :class:`~collectives.spill.SpillStore` bounded by ``config.memory_limit``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from itertools import islice
from typing import Any
from collections.abc import Iterable, Iterator, Mapping

from twisternet.errors import ConfigError

from .base import Callback, Mode, pick_alias
from .columnar import GatherTables, KeyedGatherTables
from .columns import is_columns
from .downtree import DownTreeMixin
from .edges import DIRECT
from .reduce import _need_edge
from .reduction import _flat, snapshot
from .routing import Selector, check_key_type, hash_selector, normalize_key
from .spill import SpillStore
from .uptree import Node, UpTreeOperation

log = logging.getLogger(__name__)

#: key_type -> the exact Python type whose keys are already canonical (see routing.normalize_key).
_EXACT_KEY_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bytes": bytes}


# Gather and AllGather hold and send records as chunks ``(source_task, [value, ...])``; on the wire a
# list of chunks is the two columns ``[[task, ...], [[value, ...], ...]]``.

def _append_chunk(buf: list, task: int, vals: list) -> int:
    """Add the records ``vals`` of ``task`` to the chunks in ``buf`` (growing its last chunk if that is
    ``task``'s); returns how many records ``buf`` now holds."""
    if buf and buf[-1][0] == task:
        buf[-1][1].extend(vals)
    else:
        buf.append((task, vals))
    return sum(len(c) for _, c in buf)


def _chunk_columns(chunks: list) -> list:
    """Chunks as the two wire columns."""
    return [[t for t, _ in chunks], [c for _, c in chunks]]


def _is_chunk_columns(payload: Any) -> bool:
    """Whether ``payload`` is the two wire columns of a list of chunks."""
    return is_columns(payload, 2) and all(isinstance(c, list) for c in payload[1])


class _TreeGatherBase(UpTreeOperation):
    """Forwarding up a tree; subclasses say what a record is and how the root keeps it."""

    def _new_store(self, sort: bool = True, chunked: bool = False) -> SpillStore:
        share = max(1024, self.ctx.config.memory_limit // max(1, len(self.local_destinations)))
        return SpillStore(share, self.ctx.config.spill_dir, sort=sort, chunked=chunked,
                          name=f"{self.operation}(edge={self.edge})")

    #: Whether the batch destination keeps chunks ``(source, [values])`` (Gather) or records.
    _chunked_store = False

    def _new_state(self, node: Node) -> Any:
        if not hasattr(self, "_outbuf"):
            self._outbuf: dict[int, list] = {}
        if node.is_root and self.mode == "batch":
            return self._new_store(chunked=self._chunked_store)
        return None

    def _input_room(self, node: Node) -> bool:
        if node.parent is None:
            return self.mode == "batch" or self._root_room(node)
        return self._out_room(node)

    #: Batch mode: local records are sent up in lists of this many (fewer messages, same order).
    batch_records = 256

    @property
    def spilled_bytes(self) -> int:
        """Bytes this process's batch destinations have written to spill files (past
        ``config.memory_limit``) so far."""
        stores = [n.state for n in getattr(self, "_nodes", {}).values()]
        stores.append(getattr(self, "_store", None))       # batch AllGather's
        return sum(s.spilled_bytes for s in stores if isinstance(s, SpillStore))

    @functools.cached_property
    def _sources_set(self) -> frozenset:
        """The source tasks, as a set (received records must name one of them)."""
        return frozenset(self.sources)

    def _release_storage(self) -> None:
        for node in getattr(self, "_nodes", {}).values():
            if isinstance(node.state, SpillStore):
                node.state.close()
        super()._release_storage()


class Gather(GatherTables, _TreeGatherBase):
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
                 timeout: float | None = None, fanout: int = 2, quorum: Any = None,
                 destination: int | None = None, root: int | None = None, dst: int | None = None) -> None:
        # destination=/root=/dst= name the one destination task (as MPI's root and torch's dst do)
        destinations = pick_alias(type(self).__name__, "destinations", {
            "destinations": destinations, "destination": destination, "root": root, "dst": dst})
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
                        lambda vals=vals, direct=direct: self._push_local(task, vals, direct),
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
        elif _append_chunk(self._outbuf.setdefault(node.tid, []), task, vals) >= self.batch_records:
            self._flush_node(node)

    def _flush_node(self, node: Node) -> None:
        buf = self._outbuf.pop(node.tid, None)
        if buf:
            self._up_send(node, "d", _chunk_columns(buf))

    def _held(self) -> int:
        return sum(len(c) for b in self._outbuf.values() for _, c in b)

    def _up_data(self, node: Node, src: int, payload: Any) -> bool:
        if not self._input_room(node):
            return False
        if not _is_chunk_columns(payload):
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
            self._complete(node.tid, lambda: (r for r in store if r[0] in passed),
                           lambda: (v for t, v in store if t in passed))
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
    """Every source's records at every destination task.

    Batch: every destination gets the same records as :class:`Gather` would, in the same order (by
    source task, then send order), spilling past ``config.memory_limit``. They travel straight from each
    source rank to each destination rank (a direct exchange: every record is encoded once per
    destination rank and decoded once there, and nobody relays it). Streaming: records flow up a tree to
    a root (the rank of the first destination), which broadcasts each as it arrives, so all destinations
    see the same order.
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
        if self.mode == "batch":
            self._setup_direct()
            return
        super()._setup()
        self._build_down(self.plan.rank_of(self._root_task()))

    # ------------------------------------------------------------------ batch: direct exchange
    # On the DIRECT edge: ("d", [task, ...], [[value, ...], ...]) chunks of the named source tasks, and
    # ("f", task) after the last chunk of source ``task`` (the edge is ordered per sending rank).

    def _setup_direct(self) -> None:
        self._nodes = {}
        self._outbuf = {}
        self._dbuf: list = []                 # small sends, held until batch_records of them
        self._peers = [r for r in self.destination_ranks if r != self.rank]
        self._done_sources: set[int] = set()
        self._completed = False
        self._store: SpillStore | None = (self._new_store(chunked=True) if self.local_destinations else None)
        self._register(DIRECT, self._on_direct)

    def _sends_away(self) -> bool:
        return True if self.mode == "batch" else super()._sends_away()

    def _keeps_local(self) -> bool:
        return self._store is not None if self.mode == "batch" else super()._keeps_local()

    def _local_room(self) -> bool:
        if self.mode != "batch":
            return super()._local_room()
        return all(self._can_send(r, DIRECT) for r in self._peers)

    def _push_local(self, task: int, vals: list, direct: bool) -> None:
        if self.mode != "batch":
            super()._push_local(task, vals, direct)
            return
        if self._store is not None:
            self._store.add_chunk(task, list(vals) if self._peers else vals)
        if not self._peers:
            return
        if direct:
            self._flush_direct()
            self._emit_direct(("d", [task], [vals]))
        elif _append_chunk(self._dbuf, task, vals) >= self.batch_records:
            self._flush_direct()

    def _flush_direct(self) -> None:
        if self._dbuf:
            msg = ("d", *_chunk_columns(self._dbuf))
            self._dbuf = []
            self._emit_direct(msg)

    def _emit_direct(self, msg: tuple) -> None:
        for r in self._peers:
            self._emit(r, DIRECT, msg)

    def _on_direct(self, src: int, msg: Any) -> bool:
        kind = msg[0] if isinstance(msg, (tuple, list)) and msg else None
        if kind == "d" and len(msg) == 3 and self._store is not None:
            _, tasks, chunks = msg
            if (not _is_chunk_columns([tasks, chunks])
                    or not all(t in self._sources_set and t not in self._done_sources for t in tasks)):
                raise self._protocol(src, msg)
            for t, c in zip(tasks, chunks):
                self._store.add_chunk(t, self._own_values(c))
            return True
        if kind == "f" and len(msg) == 2 and msg[1] in self._sources_set:
            self._done_sources.add(msg[1])
            self._changed = True
            self._check_direct()
            return True
        raise self._protocol(src, msg)

    def _check_direct(self) -> None:
        if self._completed or len(self._done_sources) < len(self.sources):
            return
        self._completed = True
        store = self._store
        if store is not None:
            for t in self.local_destinations:
                self._complete(t, lambda: iter(store), store.values)

    # ------------------------------------------------------------------ hooks, by mode
    def _on_local_finish(self, task: int) -> None:
        if self.mode != "batch":
            super()._on_local_finish(task)
            return
        self._flush_direct()
        self._emit_direct(("f", task))
        self._done_sources.add(task)
        self._check_direct()

    def _held(self) -> int:
        if self.mode == "batch":
            return sum(len(c) for _, c in self._dbuf)
        return super()._held()

    def _root_room(self, node: Node) -> bool:
        return self._down_room()

    def _root_chunks(self, node: Node, chunks: list) -> None:
        # streaming only: batch AllGather has no tree
        self._down_emit([(src, v) for src, vals in chunks for v in vals], columns=True)

    def _root_finished(self, tasks: list[int]) -> None:
        self._down_info(tasks)

    def _known_finished(self, task: int | None) -> set[int]:
        if self.mode == "batch":
            return self._done_sources | self._finished_local
        return super()._known_finished(self._root_task()) | self._down_finished

    def _root_complete(self, node: Node) -> None:
        self._down_end()

    def _duties_done(self) -> bool:
        if self.mode == "batch":
            return not self._dbuf
        return super()._duties_done()

    def _release_storage(self) -> None:
        if self.mode == "batch":
            if getattr(self, "_store", None) is not None:
                self._store.close()
            return
        super()._release_storage()


class KeyedGather(KeyedGatherTables, _TreeGatherBase):
    """Collect ``(key, value)`` records at the destination chosen by the key (one tree per destination).

    Batch: each destination gets its keys in ascending order (keys must be mutually orderable), values of
    a key ordered by source task and then send order; with ``group=True`` (default) as
    ``(key, [values])``, else as ``(key, value)`` pairs. Spills to disk past ``config.memory_limit``.
    Streaming: ``(key, value)`` as they arrive, in send order per source. With ``group=True`` the values
    of one key are collected in a list, so one key's values must fit in memory (``group=False`` streams).
    """

    operation = "KeyedGather"

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

    # Records travel as three columns ``[[key, ...], [task, ...], [value, ...]]`` ("d" payloads) and
    # rest at the destination as ``((key, task), value)`` in a SpillStore sorted by (key, task).

    def send(self, task: int, key: Any, value: Any, *, timeout: float | None = None, copy: bool = True) -> None:
        """Send ``value`` under ``key`` from local source ``task``; blocks under back pressure.
        ``copy=False``: the operation may keep a reference to ``value`` (no defensive copy)."""
        self._send(task, key, value, True, timeout, copy)

    def offer(self, task: int, key: Any, value: Any, *, copy: bool = True) -> bool:
        """Like :meth:`send` but returns False instead of blocking when the operation is full."""
        return self._send(task, key, value, False, None, copy)

    def send_many(self, task: int, items: Iterable[tuple[Any, Any]] | Mapping[Any, Any], *,
                  timeout: float | None = None, chunk: int = 4096, copy: bool = True) -> None:
        """Contribute many ``(key, value)`` pairs (or a mapping) from local source ``task``: the same as
        calling :meth:`send` for each, routed and handed over per destination ``chunk`` at a time.
        Full chunks bound for another rank are encoded before this returns, so they are not copied."""
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        self._check_source(task)
        pairs = items.items() if isinstance(items, Mapping) else items
        by_dest: dict[int, tuple[list, list]] = {}
        kt = self.key_type

        def hand_over(d: int, keys: list, vals: list) -> None:
            node = self._nodes[d]
            direct = node.parent is not None and len(keys) >= self.batch_records
            if copy and not direct and not _flat(vals):
                vals = [snapshot(v) for v in vals]
            self._input(task, lambda: self._input_room(node),
                        lambda: self._push_cols(node, keys, [task] * len(keys), vals, local=True, direct=direct),
                        block=True, timeout=timeout)

        exact = _EXACT_KEY_TYPES.get(kt)       # keys of exactly this type need no normalizing
        selector, dests = self.selector, self.destinations
        for key, value in pairs:
            if type(key) is not exact:
                key = normalize_key(key, kt)
            d = selector(key, dests)
            cols = by_dest.get(d)
            if cols is None:                      # first record for d: check the selector's answer
                if d not in self._nodes:
                    raise ValueError(f"selector returned {d!r} for key {key!r}; it must return one of the "
                                     f"destinations {self.destinations}")
                cols = by_dest[d] = ([], [])
            cols[0].append(key)
            cols[1].append(value)
            if len(cols[0]) >= chunk:
                by_dest[d] = ([], [])
                hand_over(d, *cols)
        for d, cols in by_dest.items():
            if cols[0]:
                hand_over(d, *cols)

    def _send(self, task: int, key: Any, value: Any, block: bool, timeout: float | None,
              copy: bool = True) -> bool:
        key = normalize_key(key, self.key_type)
        self._check_source(task)
        node = self._nodes[self._select(key)]
        return self._input(task, lambda: self._input_room(node),
                           lambda: self._push_cols(node, [key], [task], [snapshot(value) if copy else value],
                                                   local=True, direct=False),
                           block=block, timeout=timeout)

    def _push_cols(self, node: Node, keys: list, tasks: list, vals: list, *, local: bool, direct: bool) -> None:
        """Records as columns (under the lock): kept at the root, else buffered or sent on up."""
        if node.parent is None:
            self._root_cols(node, keys, tasks, vals)
        elif local and self.mode == "batch" and not direct:
            buf = self._outbuf.get(node.tid)
            if buf is None:
                buf = self._outbuf[node.tid] = ([], [], [])
            buf[0].extend(keys)
            buf[1].extend(tasks)
            buf[2].extend(vals)
            if len(buf[0]) >= self.batch_records:
                self._flush_node(node)
        else:
            if local:
                self._flush_node(node)
            self._up_send(node, "d", [keys, tasks, vals])

    def _flush_node(self, node: Node) -> None:
        buf = self._outbuf.pop(node.tid, None)
        if buf and buf[0]:
            self._up_send(node, "d", list(buf))

    def _held(self) -> int:
        return sum(len(b[0]) for b in self._outbuf.values())

    def _up_data(self, node: Node, src: int, payload: Any) -> bool:
        if not self._input_room(node):
            return False
        if not is_columns(payload, 3):
            raise self._protocol(src, payload)
        keys, tasks, vals = payload
        if node.parent is not None:
            self._up_send(node, "d", payload)    # passed on as it came (encoded again by this call)
            return True
        if not all(t in self._sources_set for t in set(tasks)):
            raise self._protocol(src, payload)
        self._root_cols(node, keys, tasks, self._own_values(vals))
        return True

    def _root_cols(self, node: Node, keys: list, tasks: list, vals: list) -> None:
        if self.mode == "batch":
            store: SpillStore = node.state
            try:
                store.add_many(list(zip(zip(keys, tasks), vals)))
            except TypeError as e:
                raise TypeError(f"KeyedGather batch results are sorted by key: {e}") from None
        else:
            self._deliver_many(node.tid, list(zip(keys, vals)))

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
