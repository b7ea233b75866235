"""KeyedReduce: values combined per key at the destination the key routes to (one tree per destination)."""

from __future__ import annotations

import zlib
from operator import itemgetter
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable

from twisternet.errors import ConfigError

from .base import Callback, Mode, record_nbytes
from .columnar import KeyedReduceTables
from .columns import is_columns, to_columns
from .held_sends import HeldSends
from .reduce import _need_edge, _pick_op
from .reduction import _ATOMS, ReduceFn, Reduction, _flat, own, snapshot
from .routing import Selector, check_key_type, hash_selector, normalize_key
from .uptree import Node, UpTreeOperation

if TYPE_CHECKING:
    from twisternet.context import Context


class KeyedReduce(HeldSends, KeyedReduceTables, UpTreeOperation):
    """Reduce values by key; each key belongs to one destination (``selector``, default a stable hash).

    Batch: every node of a destination's tree combines the values of each key it sees (a combiner,
    flushed upward when it holds ``limit`` keys), and after every source finished the destination gets
    each of its keys exactly once as ``(key, reduced value)``, in ascending key order when keys are
    mutually orderable (else in first-seen order). Streaming: records move on as they come; the
    destination keeps a running reduction per key and emits ``(key, running value)`` on every update.
    """

    operation = "KeyedReduce"

    def __init__(self, ctx: Context, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 op: str | ReduceFn | None = None, reduce: str | ReduceFn | None = None,
                 key_type: str = "object", selector: Selector | None = None, mode: Mode = "batch",
                 callback: Callback | None = None, limit: int | None = None, timeout: float | None = None,
                 fanout: int = 2) -> None:
        self.reduction = Reduction(_pick_op(op, reduce))
        if self.reduction.average:
            raise ConfigError("op", f"KeyedReduce cannot average ({self.reduction.name!r}): it does not count the "
                                    "values of a key; reduce ('sum', n) pairs and divide")
        self._route_cache: dict[str, int] = {}   # str key -> destination, for the default selector
        self.key_type = check_key_type(key_type)
        self.selector: Selector = selector or hash_selector
        self._combiner_bytes: dict[int, int] = {}   # inner batch combiner (tree id) -> bytes taken since flush
        self._init_held(ctx)
        super().__init__(ctx, sources, destinations, _need_edge(edge, type(self).__name__), mode=mode,
                         callback=callback, limit=limit, timeout=timeout, fanout=fanout)

    def describe(self) -> str:
        return f"{self.mode} {self.operation}({self.reduction.name})"

    def _setup(self) -> None:
        self._build_up({d: self.plan.rank_of(d) for d in self.destinations})

    def _new_state(self, node: Node) -> Any:
        return {} if (self.mode == "batch" or node.is_root) else None

    def _select(self, key: Any) -> int:
        d = self.selector(key, self.destinations)
        if d not in self._nodes:
            raise ValueError(f"selector returned {d!r} for key {key!r}; it must return one of the "
                             f"destinations {self.destinations}")
        return d

    # ------------------------------------------------------------------ public API
    def send(self, task: int, key: Any, value: Any, *, timeout: float | None = None) -> None:
        """Contribute ``value`` under ``key`` from local source ``task``; blocks under back pressure.
        Records in a stream are held back and handed over together (:meth:`HeldSends.send_record`)."""
        self.send_record(task, key, value, timeout)

    def offer(self, task: int, key: Any, value: Any) -> bool:
        """Like :meth:`send` but returns False instead of blocking when the operation is full."""
        if not self.release_held(task, False, None):
            return False
        return self._send(task, key, value, False, None)

    def _held(self) -> int:
        return super()._held() + self.held_count()

    def _hand_over_pairs(self, task: int, d: int, pairs: list, block: bool, timeout: float | None) -> bool:
        node = self._nodes[d]
        return self._input(task, lambda: self._room(node), lambda: self._take(node, pairs, snapshot),
                           block=block, timeout=timeout)

    def send_many(self, task: int, items: Any, *, timeout: float | None = None, chunk: int = 65536) -> None:
        """Contribute many ``(key, value)`` pairs (or a mapping, e.g. a ``collections.Counter``) from
        local source ``task``: keys are routed and combined per destination in one step per chunk, far
        cheaper than one :meth:`send` per pair. Same semantics as calling :meth:`send` for each pair."""
        self._check_source(task)
        self.release_held(task, True, timeout)
        pairs = items.items() if hasattr(items, "items") else items
        by_dest: dict[int, list] = {}
        kt = self.key_type

        def hand_over(d: int, lst: list) -> None:
            node = self._nodes[d]
            self._input(task, lambda: self._room(node), lambda: self._take(node, lst, snapshot),
                        block=True, timeout=timeout)

        dests = self.destinations
        nd = len(dests)
        # The default selector on str/int keys, inlined: the same stable hash as routing.stable_hash
        fast = self.selector is hash_selector and kt in ("str", "int")
        crc32 = zlib.crc32
        cache = self._route_cache
        if len(cache) > 1 << 16:
            cache.clear()
        for key, value in pairs:
            tk = type(key)
            if fast and tk is str and kt == "str":
                d = cache.get(key)
                if d is None:
                    d = cache[key] = dests[crc32(key.encode("utf-8", "surrogatepass")) % nd]
            elif fast and tk is int and kt == "int" and -(1 << 63) <= key < (1 << 63):
                d = dests[crc32(key.to_bytes(8, "little", signed=True)) % nd]
            else:
                key = normalize_key(key, kt)
                d = self._select(key)
            lst = by_dest.get(d)
            if lst is None:
                lst = by_dest[d] = []
            lst.append((key, value))
            if len(lst) >= chunk:
                hand_over(d, lst)
                by_dest[d] = []
        for d, lst in by_dest.items():
            if lst:
                hand_over(d, lst)

    def _send(self, task: int, key: Any, value: Any, block: bool, timeout: float | None) -> bool:
        key = normalize_key(key, self.key_type)
        self._check_source(task)
        return self._hand_over_pairs(task, self._select(key), [(key, value)], block, timeout)

    # ------------------------------------------------------------------ combining
    def _room(self, node: Node) -> bool:
        if node.parent is None:
            return self.mode == "batch" or self._sink_room(node.tid)
        if self.mode == "batch":
            return self._combiner_has_room(node) or self._out_room(node)
        return self._out_room(node)

    def _combiner_has_room(self, node: Node) -> bool:
        """An inner combiner holds at most ``limit`` keys and about ``byte_limit`` bytes of values (the
        bytes taken since its last flush: no more than it holds for sums, min/max or concatenation)."""
        return len(node.state) < self.limit and self._combiner_bytes.get(node.tid, 0) < self.byte_limit

    def _combine(self, table: dict, pairs: Iterable, copy: Any) -> int:
        """Fold ``pairs`` into ``table``; returns the :func:`record_nbytes` of the non-scalar values."""
        comb = self.reduction.combine
        scalar = self.reduction.scalar
        atoms = _ATOMS
        nbytes = 0
        for key, value in pairs:
            if type(value) not in atoms:
                nbytes += record_nbytes(value)
            if key in table:
                old = table[key]
                table[key] = scalar(old, value) if type(old) in atoms and type(value) in atoms else comb(old, value)
            else:
                table[key] = value if type(value) in atoms else copy(value)
        return nbytes

    def _take(self, node: Node, pairs: Iterable[Any], copy: Any) -> None:
        if node.parent is None:
            table = node.state
            if self.mode == "batch":
                self._combine(table, pairs, copy)
            else:
                pairs = list(pairs)
                if not self._streamed_table_pieces(node, pairs):      # tables: merged by the reader
                    self._deliver_many(node.tid, self._running(table, pairs, copy))
        elif self.mode == "batch":
            taken = self._combine(node.state, pairs, copy)
            if taken:
                self._combiner_bytes[node.tid] = self._combiner_bytes.get(node.tid, 0) + taken
            if not self._combiner_has_room(node):
                self._up_send(node, "d", to_columns(node.state.items(), 2))
                node.state.clear()
                self._combiner_bytes[node.tid] = 0
        else:
            keys = [k for k, _ in pairs]
            values = [v for _, v in pairs]
            if copy is snapshot and not _flat(values):
                values = [snapshot(v) for v in values]
            self._up_send(node, "d", [keys, values])

    def _running(self, table: dict, pairs: Iterable, copy: Any) -> list:
        """Streaming destination: fold ``pairs`` into the running values; the ``(key, running value)``
        update of every pair, in order (plain scalars combined without the generic dispatch)."""
        comb = self.reduction.combine
        scalar = self.reduction.scalar
        atoms = _ATOMS
        out: list[Any] = []
        append = out.append
        for key, value in pairs:
            if key in table:
                old = table[key]
                new = scalar(old, value) if type(old) in atoms and type(value) in atoms else comb(old, value)
            else:
                new = value if type(value) in atoms else copy(value)
            table[key] = new
            append((key, new if type(new) in atoms else snapshot(new)))
        return out

    def _up_data(self, node: Node, src: int, payload: Any) -> bool:
        if not self._room(node):
            return False
        self._take_columns(node, src, payload)
        return True

    def _up_child_done(self, node: Node, src: int, payload: Any) -> None:
        if payload:
            self._take_columns(node, src, payload)

    def _take_columns(self, node: Node, src: int, payload: Any) -> None:
        if not is_columns(payload, 2):
            raise self._protocol(src, payload)
        if node.parent is not None and self.mode != "batch":
            self._up_send(node, "d", payload)     # passed on as it came (encoded again by this call)
            return
        self._take(node, zip(*payload), own)

    def _up_final(self, node: Node) -> Any:
        if self.mode != "batch":
            return None
        out = to_columns(node.state.items(), 2) if node.state else None
        node.state.clear()
        return out

    def _root_complete(self, node: Node) -> None:
        if self.mode == "streaming":
            self._end(node.tid)
            return
        items = list(node.state.items())
        try:
            items.sort(key=itemgetter(0))
        except TypeError:
            pass  # keys of mixed types: first-seen order
        self._complete(node.tid, lambda: iter(items))

    def _release_storage(self) -> None:
        super()._release_storage()
