"""Partition and KeyedPartition: each record goes straight from its source to one destination.

Records on the direct edge are ``("d", destination, source, payload)`` and ``("f", source)``; a finish
marker goes to every destination rank, after the source's data on the same (ordered) edge.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterable, Iterator, Sequence


from .base import Callback, Mode, Operation
from .columnar import PartitionTables
from .edges import DIRECT
from .reduce import _need_edge
from .reduction import snapshot
from .routing import Selector, check_key_type, hash_selector, normalize_key
from .spill import SpillStore

if TYPE_CHECKING:
    from twisternet.context import Context

#: ``selector(value, destinations) -> destination task`` for unkeyed Partition.
ValueSelector = Callable[[Any, Sequence[int]], int]


class Partition(PartitionTables, Operation):
    """Send each record of a source to one destination task, directly (no tree).

    ``send(task, value, destination=None)``: the destination is the one given, else
    ``selector(value, destinations)``, else round-robin per source. Batch: after every source finished,
    a destination gets its ``(source_task, value)`` records ordered by source task, then send order
    (spilling past ``config.memory_limit``). Streaming: records as they arrive, send order per source.
    """

    operation = "Partition"

    def __init__(self, ctx: Context, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 selector: ValueSelector | None = None, mode: Mode = "batch", callback: Callback | None = None,
                 limit: int | None = None, timeout: float | None = None) -> None:
        self.selector = selector
        super().__init__(ctx, sources, destinations, _need_edge(edge, type(self).__name__), mode=mode,
                         callback=callback, limit=limit, timeout=timeout)

    def _setup(self) -> None:
        self._finished: set[int] = set()
        self._completed = False
        self._rr = {t: i for i, t in enumerate(self.local_sources)}
        self._outbuf: dict[int, list] = {}
        share = max(1024, self.ctx.config.memory_limit // max(1, len(self.local_destinations)))
        self._stores = {t: SpillStore(share, self.ctx.config.spill_dir, sort=True,
                                      name=f"{self.operation}(edge={self.edge}) task {t}")
                        for t in self.local_destinations} if self.mode == "batch" else {}
        self._register(DIRECT, self._on_direct)
        self._check_complete()

    # ------------------------------------------------------------------ public API
    def send(self, task: int, value: Any, destination: int | None = None, *, timeout: float | None = None,
             copy: bool = True) -> None:
        """Send ``value`` from local source ``task``; blocks under back pressure.

        ``copy=False``: the operation may keep a reference to ``value`` until its results are consumed
        (no defensive copy); the caller must not change it in the meantime.
        """
        self._route(task, self._pick(task, value, destination), value, True, timeout, copy)

    def offer(self, task: int, value: Any, destination: int | None = None, *, copy: bool = True) -> bool:
        """Like :meth:`send` but returns False instead of blocking when the destination is full."""
        return self._route(task, self._pick(task, value, destination), value, False, None, copy)

    def values(self, task: int | None = None, *, timeout: float | None = None) -> Iterator[Any]:
        """Batch: the values of :meth:`results` without their source tasks (KeyedPartition: without
        their keys), in the same order."""
        return self._iter_values(task, timeout)

    def _pick(self, task: int, value: Any, destination: int | None) -> int:
        self._check_source(task)
        if destination is None:
            if self.selector is not None:
                destination = self.selector(value, self.destinations)
            else:
                i = self._rr[task]
                self._rr[task] = i + 1
                destination = self.destinations[i % len(self.destinations)]
        if destination not in self.destinations:
            raise ValueError(f"destination {destination!r} is not one of {self.destinations}")
        return destination

    # ------------------------------------------------------------------ plumbing
    def _route(self, task: int, dest: int, payload: Any, block: bool, timeout: float | None,
               copy: bool = True) -> bool:
        r = self.plan.rank_of(dest)
        if r == self.rank:
            return self._input(task, lambda: self._sink_room(dest),
                               lambda: self._accept(dest, task, snapshot(payload) if copy else payload),
                               block=block, timeout=timeout)
        if self.mode == "batch":
            return self._input(task, lambda: self._can_send(r, DIRECT),
                               lambda: self._buffer(r, (dest, task, snapshot(payload) if copy else payload)),
                               block=block, timeout=timeout)
        if not block and copy:  # offer() may return before the record is handed over: keep our own copy
            payload = snapshot(payload)
        return self._input(task, lambda: self._can_send(r, DIRECT),
                           lambda: self._emit(r, DIRECT, ("d", dest, task, payload)), block=block, timeout=timeout)

    #: Batch mode: records for one rank are sent in lists of this many (fewer messages, same order).
    batch_records = 256

    def _buffer(self, rank: int, rec: tuple) -> None:
        buf = self._outbuf.setdefault(rank, [])
        buf.append(rec)
        if len(buf) >= self.batch_records:
            self._flush(rank)

    def _flush(self, rank: int) -> None:
        buf = self._outbuf.pop(rank, None)
        if buf:
            self._emit(rank, DIRECT, ("D", buf))

    def _held(self) -> int:
        return sum(len(b) for b in self._outbuf.values())

    def _accept(self, dest: int, src: int, payload: Any) -> None:
        if self.mode == "batch":
            self._stores[dest].add(src, payload)
        else:
            self._deliver(dest, self._item(src, payload))

    def _item(self, src: int, payload: Any) -> Any:
        return (src, payload)

    def _on_local_finish(self, task: int) -> None:
        for r in self.destination_ranks:
            if r == self.rank:
                self._finished.add(task)
                self._check_complete()
            else:
                self._flush(r)
                self._emit(r, DIRECT, ("f", task))

    def _on_direct(self, src: int, msg: Any) -> bool:
        kind = msg[0] if isinstance(msg, (tuple, list)) and msg else None
        if kind == "d" and len(msg) == 4:
            _, dest, source, payload = msg
            if dest not in self._sinks:
                raise self._protocol(src, msg)
            if not self._sink_room(dest):
                return False
            self._accept(dest, source, self._own(payload))
            return True
        if kind == "D" and len(msg) == 2:
            for dest, source, payload in msg[1]:
                if dest not in self._sinks:
                    raise self._protocol(src, msg)
                self._accept(dest, source, self._own(payload))
            return True
        if kind == "f" and len(msg) == 2:
            self._finished.add(msg[1])
            self._changed = True
            self._check_complete()
            return True
        raise self._protocol(src, msg)

    def _check_complete(self) -> None:
        if self._completed or not self._sinks or not self._finished >= set(self.sources):
            return
        self._completed = True
        for t in self.local_destinations:
            if self.mode == "batch":
                self._complete(t, lambda t=t: self._batch_items(self._stores[t]))  # type: ignore[misc]  # bound default
            else:
                self._end(t)

    def _batch_items(self, store: SpillStore) -> Iterator[Any]:
        for src, payload in store:
            yield self._item(src, payload)

    def _known_finished(self, task: int | None) -> set[int]:
        return self._finished | self._finished_local

    def _release_storage(self) -> None:
        for s in getattr(self, "_stores", {}).values():
            s.close()


class KeyedPartition(Partition):
    """Send each ``(key, value)`` straight to the destination its key selects (stable hash by default).

    A destination gets ``(key, value)`` items: batch, after every source finished, ordered by source
    task then send order; streaming, as they arrive (send order per source).
    """

    operation = "KeyedPartition"

    def __init__(self, ctx: Context, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 key_type: str = "object", selector: Selector | None = None, mode: Mode = "batch",
                 callback: Callback | None = None, limit: int | None = None, timeout: float | None = None) -> None:
        self.key_type = check_key_type(key_type)
        self.key_selector: Selector = selector or hash_selector
        super().__init__(ctx, sources, destinations, edge, mode=mode, callback=callback, limit=limit,
                         timeout=timeout)

    def send(self, task: int, key: Any, value: Any, *, timeout: float | None = None) -> None:  # type: ignore[override]
        """Send ``value`` under ``key`` from local source ``task``; blocks under back pressure."""
        self._keyed(task, key, value, True, timeout)

    def offer(self, task: int, key: Any, value: Any) -> bool:  # type: ignore[override]
        """Like :meth:`send` but returns False instead of blocking when the destination is full."""
        return self._keyed(task, key, value, False, None)

    def _keyed(self, task: int, key: Any, value: Any, block: bool, timeout: float | None) -> bool:
        key = normalize_key(key, self.key_type)
        self._check_source(task)
        dest = self.key_selector(key, self.destinations)
        if dest not in self.destinations:
            raise ValueError(f"selector returned {dest!r} for key {key!r}; it must return one of "
                             f"{self.destinations}")
        return self._route(task, dest, (key, value), block, timeout)

    def _item(self, src: int, payload: Any) -> Any:
        return tuple(payload)
