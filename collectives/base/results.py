"""Where an operation's results wait for their reader: per-destination sinks, the streaming byte bound,
batch completion, iteration and callbacks (a mixin of :class:`~collectives.base.operation.Operation`).

State (made in ``Operation.__init__``): ``_sinks`` (local destination task -> :class:`Sink`), ``_cbq``
and ``_cb_lock`` (results queued for the callback, and who runs it)."""

from __future__ import annotations

from collections import deque
from typing import Any
from collections.abc import Callable, Iterator

import numpy as np

from twisternet.errors import TwisternetError

from .state import OperationState

_BATCH_MARK = object()


def record_nbytes(item: Any) -> int:
    """Bytes of the large parts of a result (arrays, bytes, strings; one level into a tuple or list,
    e.g. a ``(source, array)`` pair): what the streaming byte bound counts. 0 for small records."""
    t = type(item)
    if t is np.ndarray:
        return item.nbytes
    if t is bytes or t is str or t is bytearray:
        return len(item)
    if (t is tuple or t is list) and len(item) <= 4:
        n = 0
        for x in item:
            tx = type(x)
            if tx is np.ndarray:
                n += x.nbytes
            elif tx is bytes or tx is str or tx is bytearray:
                n += len(x)
        return n
    return 0


class Sink:
    """Results waiting for one local destination task."""

    __slots__ = ("items", "ended", "complete", "batch", "values", "consumed", "nbytes")

    def __init__(self) -> None:
        self.nbytes = 0             # record_nbytes of the items (streaming)
        self.items: deque = deque()
        self.ended = False          # streaming: no more items will come
        self.complete = False       # batch: the result is ready
        self.batch: Callable[[], Iterator[Any]] = lambda: iter(())
        self.values: Callable[[], Iterator[Any]] | None = None   # batch values alone, if cheaper
        self.consumed = False

class ResultDelivery(OperationState):
    """Operation part: result sinks, their readers and the user callback."""

    def results(self, task: int | None = None, *, timeout: float | None = None) -> Iterator[Any]:
        """Results for local destination ``task`` (default: the only one in this process; on a rank
        that runs no destination task, nothing: every rank may iterate, as SPMD code does).

        Batch: waits until every source finished, then yields every result. Streaming: yields results
        as they form and stops once every source finished. ``timeout`` bounds each wait and raises
        OperationTimeout naming the sources that never finished.
        """
        task = self._dest(task, none_here=True)
        if self.callback is not None:
            raise TwisternetError(f"{self.describe()} on edge {self.edge} delivers its results to the callback")
        if task is None:
            return iter(())     # this rank runs no destination task: it has no results
        return self._iter_results(task, timeout)

    def drain(self, task: int | None = None) -> list[Any]:
        """Streaming: the results available now, without waiting (empty list if none)."""
        task = self._dest(task, none_here=True)
        if self.mode != "streaming":
            raise TwisternetError("drain() is for streaming operations; use results() in batch mode")
        self._raise_if_failed()
        if task is None:
            return []
        with self._lock:
            sink = self._sinks[task]
            items = list(sink.items)
            sink.items.clear()
            sink.nbytes = 0
        if items:
            self._resume_all()
        return items

    def done(self, task: int | None = None) -> bool:
        """Whether destination ``task`` has its whole result (batch) or saw the end of the stream."""
        task = self._dest(task)
        with self._lock:
            sink = self._sinks[task]
            return sink.complete if self.mode == "batch" else (sink.ended and not sink.items)


    def _sink_room(self, task: int) -> bool:
        if self.callback is not None or self.mode == "batch":
            return True
        sink = self._sinks[task]
        return len(sink.items) < self.limit and (sink.nbytes < self.byte_limit or not sink.items)

    def _sinks_room(self) -> bool:
        return all(self._sink_room(t) for t in self._sinks)

    def _deliver(self, task: int, item: Any) -> None:
        """Streaming result ``item`` for local destination ``task`` (under the lock)."""
        if self.callback is not None:
            self._cbq.append((task, item))
        else:
            sink = self._sinks[task]
            sink.items.append(item)
            sink.nbytes += record_nbytes(item)
        self._changed = True

    def _deliver_many(self, task: int, items: list) -> None:
        """:meth:`_deliver` of each of ``items``, in order (under the lock)."""
        if self.callback is not None:
            self._cbq.extend((task, it) for it in items)
        else:
            sink = self._sinks[task]
            sink.items.extend(items)
            n = 0
            for it in items:
                n += record_nbytes(it)
            sink.nbytes += n
        self._changed = True

    def _end(self, task: int) -> None:
        """Streaming: destination ``task`` will get nothing more."""
        self._sinks[task].ended = True
        self._changed = True

    def _complete(self, task: int, batch: Callable[[], Iterator[Any]],
                  values: Callable[[], Iterator[Any]] | None = None) -> None:
        """Batch: destination ``task``'s results are ready; ``batch()`` iterates them. Operations whose
        results are ``(source_task, value)`` pairs may pass ``values()``, iterating the values alone."""
        sink = self._sinks[task]
        sink.batch = batch
        sink.values = values
        sink.complete = True
        self._changed = True
        if self.callback is not None:
            self._cbq.append((task, _BATCH_MARK))

    def _consumed(self, task: int) -> None:
        with self._lock:
            self._sinks[task].consumed = True
            every = all(s.consumed for s in self._sinks.values())
        if every:
            self._release_storage()

    def _iter_values(self, task: int | None, timeout: float | None) -> Iterator[Any]:
        """Batch results that are ``(source_task, value)`` pairs, without the source tasks."""
        task = self._dest(task, none_here=True)
        if self.callback is not None:
            raise TwisternetError(f"{self.describe()} on edge {self.edge} delivers its results to the callback")
        if self.mode != "batch":
            raise TwisternetError("values() is for batch operations; use results() in streaming mode")
        if task is None:
            return iter(())     # this rank runs no destination task: it has no results
        return self._values_gen(task, timeout)

    def _values_gen(self, task: int, timeout: float | None) -> Iterator[Any]:
        sink = self._sinks[task]
        self._wait(lambda: sink.complete, "batch results not complete", task, timeout)
        if sink.values is not None:
            yield from sink.values()
        else:
            for item in sink.batch():
                yield item[1]
        self._consumed(task)

    def _iter_results(self, task: int, timeout: float | None) -> Iterator[Any]:
        sink = self._sinks[task]
        if self.mode == "batch":
            self._wait(lambda: sink.complete, "batch results not complete", task, timeout)
            yield from sink.batch()
            self._consumed(task)
            return
        # The items taken out stay counted against the byte bound until the caller has moved past them
        # (a slow consumer holds them meanwhile), so held + queued bytes stay within the bound.
        in_hand = 0
        try:
            while True:
                if in_hand:
                    with self._lock:
                        sink.nbytes = max(0, sink.nbytes - in_hand)
                    in_hand = 0
                    self._resume_all()
                self._wait(lambda: bool(sink.items) or sink.ended, "no streaming result arrived", task, timeout)
                with self._lock:
                    items = list(sink.items)
                    sink.items.clear()
                    in_hand = sink.nbytes
                    ended = sink.ended
                if items and self._sink_room(task):
                    self._resume_all()
                yield from items
                if ended:
                    return
        finally:
            if in_hand:
                with self._lock:
                    sink.nbytes = max(0, sink.nbytes - in_hand)

    def _resume_all(self) -> None:
        for e in self._registered:
            self.ctx.resume(e)

    def _run_callbacks(self) -> None:
        cb = self.callback
        if cb is None:   # only an operation with a callback queues results for it
            raise TwisternetError(f"{self.describe()}: results queued for a callback it does not have")
        while self._cbq:
            if not self._cb_lock.acquire(blocking=False):
                return
            try:
                while self._cbq:
                    task, item = self._cbq.popleft()
                    try:
                        if item is _BATCH_MARK:
                            for it in self._sinks[task].batch():
                                cb(task, it)
                            self._consumed(task)
                        else:
                            cb(task, item)
                    except Exception as e:  # noqa: BLE001 - surfaces to every waiter
                        with self._lock:
                            self._fail(e, "in the user callback")
            finally:
                self._cb_lock.release()
