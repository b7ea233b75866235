"""KeyedGather: ``(key, value)`` records collected at the destination their key selects, sorted by key
in batch mode (one tree per destination)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable, Iterator, Mapping

from twisternet.errors import TwisternetError

from ..base import Callback, Mode
from ..columnar import KeyedGatherTables
from ..columnar.gathered_tables import is_table_piece
from ..columns import is_columns
from ..held_sends import HeldSends
from ..reduce import _need_edge
from ..reduction import _flat, snapshot
from ..routing import Selector, check_key_type, hash_selector, normalize_key
from ..spill import SpillStore
from ..uptree import Node
from .tree import TreeGatherBase

if TYPE_CHECKING:
    from twisternet.context import Context

#: key_type -> the exact Python type whose keys are already canonical (see routing.normalize_key).
_EXACT_KEY_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bytes": bytes}


class KeyedGather(HeldSends, KeyedGatherTables, TreeGatherBase):
    """Collect ``(key, value)`` records at the destination chosen by the key (one tree per destination).

    Batch: each destination gets its keys in ascending order (keys must be mutually orderable), values of
    a key ordered by source task and then send order; with ``group=True`` (default) as
    ``(key, [values])``, else as ``(key, value)`` pairs. Spills to disk past ``config.memory_limit``.
    Streaming: ``(key, value)`` as they arrive, in send order per source. With ``group=True`` the values
    of one key are collected in a list, so one key's values must fit in memory (``group=False`` streams).
    """

    operation = "KeyedGather"

    def __init__(self, ctx: Context, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 key_type: str = "object", selector: Selector | None = None, group: bool = True,
                 mode: Mode = "batch", callback: Callback | None = None, limit: int | None = None,
                 timeout: float | None = None, fanout: int = 2) -> None:
        self.key_type = check_key_type(key_type)
        self.selector: Selector = selector or hash_selector
        self.group = group
        self._init_held(ctx)
        super().__init__(ctx, sources, destinations, _need_edge(edge, type(self).__name__), mode=mode,
                         callback=callback, limit=limit, timeout=timeout, fanout=fanout)

    def _setup(self) -> None:
        self._build_up({d: self.plan.rank_of(d) for d in self.destinations})

    @property
    def spilled_bytes(self) -> int:
        """Bytes this process's batch destinations have written to spill files (records' and tables'
        sorted runs, past ``config.memory_limit``) so far."""
        tables = self.__dict__.get("_gathered", {}).values()
        return TreeGatherBase.spilled_bytes.fget(self) + sum(g.spilled_bytes for g in tables)  # type: ignore[attr-defined]

    def _release_storage(self) -> None:
        for g in self.__dict__.get("_gathered", {}).values():
            g.close()
        super()._release_storage()

    def _select(self, key: Any) -> int:
        return self._check_selected(self.selector(key, self.destinations), key)

    def _check_selected(self, d: Any, key: Any) -> int:
        """``d``, the selector's answer for ``key``; ValueError unless it is one of the destinations."""
        if d not in self._nodes:
            raise ValueError(f"selector returned {d!r} for key {key!r}; it must return one of the "
                             f"destinations {self.destinations}")
        return d

    # Records travel as three columns ``[[key, ...], [task, ...], [value, ...]]`` ("d" payloads) and
    # rest at the destination as ``((key, task), value)`` in a SpillStore sorted by (key, task).

    def send(self, task: int, key: Any, value: Any, *, timeout: float | None = None, copy: bool = True) -> None:
        """Send ``value`` under ``key`` from local source ``task``; blocks under back pressure.
        ``copy=False``: the operation may keep a reference to ``value`` (no defensive copy). Records
        in a stream are held back and handed over together (:meth:`HeldSends.send_record`)."""
        self.send_record(task, key, snapshot(value) if copy else value, timeout)

    def offer(self, task: int, key: Any, value: Any, *, copy: bool = True) -> bool:
        """Like :meth:`send` but returns False instead of blocking when the operation is full."""
        if not self.release_held(task, False, None):
            return False
        return self._send(task, key, value, False, None, copy)

    def _hand_over_pairs(self, task: int, d: int, pairs: list, block: bool, timeout: float | None) -> bool:
        node = self._nodes[d]
        keys = [k for k, _ in pairs]
        vals = [v for _, v in pairs]
        return self._input(task, lambda: self._input_room(node),
                           lambda: self._push_cols(node, keys, [task] * len(keys), vals, local=True, direct=False),
                           block=block, timeout=timeout)

    def send_many(self, task: int, items: Iterable[tuple[Any, Any]] | Mapping[Any, Any], *,
                  timeout: float | None = None, chunk: int = 4096, copy: bool = True) -> None:
        """Contribute many ``(key, value)`` pairs (or a mapping) from local source ``task``: the same as
        calling :meth:`send` for each, routed and handed over per destination ``chunk`` at a time.
        Full chunks bound for another rank are encoded before this returns, so they are not copied."""
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        self._check_source(task)
        self.release_held(task, True, timeout)
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
                cols = by_dest[self._check_selected(d, key)] = ([], [])
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
        return sum(len(b[0]) for b in self._outbuf.values()) + self.held_count()

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
            if len(vals) == 1 and is_table_piece(vals[0]):      # send_table's: kept as sorted Arrow runs
                self._table_piece(node, keys[0], vals[0])
                return
            store: SpillStore = node.state
            try:
                store.add_many(list(zip(zip(keys, tasks), vals)))
            except TypeError as e:
                raise TypeError(f"KeyedGather batch results are sorted by key: {e}") from None
        else:
            self._deliver_many(node.tid, list(zip(keys, vals)))

    def _batch_items(self, node: Node) -> Iterator[Any]:
        if self._gathered_tables(node.tid) is not None:
            raise TwisternetError(f"{self.describe()} (edge {self.edge}): destination {node.tid} received "
                                  f"send_table() tables: read them with result_table() or result_batches()")
        store: SpillStore = node.state
        if self.group:
            for key, recs in itertools.groupby(store, key=lambda r: r[0][0]):
                yield key, [v for _, v in recs]
        else:
            for (key, _src), v in store:
                yield key, v

    def _root_complete(self, node: Node) -> None:
        if self.mode == "batch":
            self._complete(node.tid, lambda: self._batch_items(node))
        else:
            self._end(node.tid)
