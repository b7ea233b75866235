"""Non-blocking collectives: a :class:`Handle` per call in flight, and the per-Context :class:`AsyncEngine`.

A handle is completed from the operation's own completion path, never by a thread per call:

* dataflow operations (Reduce, Gather, AllGather, Broadcast in batch mode) are progressed by the
  Context's engine like any other; :meth:`Operation.when_settled` calls the handle back from the
  handler (progress thread) that completed this process's part, or with the error that failed it;
* rank-level calls that run on the caller's thread (``AllReduce.allreduce``: tree, ring, shared memory
  or in-network) are queued on a *collective stream* thread of the Context, which runs them in
  submission order (the order every rank submits them in, as gloo's and NCCL's streams do) and
  completes each handle as its call returns. Submitting never blocks; the calls of one stream are
  carried out one after the other, those of different streams (the functional layer's, each torch
  process group's, torch send/recv's) at the same time.

The same stream thread watches the handles still pending while it has nothing to run: a lost peer or
a handle past its deadline fails them (PeerLostError, OperationTimeout), so neither ``wait()`` nor a
future's callbacks ever wait forever.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from twisternet.errors import OperationTimeout, PeerLostError, TwisternetError

if TYPE_CHECKING:
    from twisternet.context import Context

log = logging.getLogger(__name__)

_UNSET = object()


class Handle:
    """One non-blocking collective call: ``wait(timeout)`` for its result, ``is_completed()``,
    ``get_future()`` (a :class:`concurrent.futures.Future`); errors of the call raise from both."""

    def __init__(self, ctx: Context, what: str, *, timeout: float | None = None,
                 cleanup: Callable[[], None] | None = None) -> None:
        self.ctx = ctx
        self.what = what
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._future.set_running_or_notify_cancel()
        self._cleanup = cleanup
        self._cleanup_lock = threading.Lock()
        self.timeout = ctx.config.timeout if timeout is None else timeout
        self.deadline = time.monotonic() + self.timeout

    # ------------------------------------------------------------------ public
    def wait(self, timeout: float | None = None) -> Any:
        """Block (progressing the engine) until the call completed; its result, or raise its error."""
        if not self._future.done():
            t = self.timeout if timeout is None else timeout

            def on_timeout() -> BaseException:
                return OperationTimeout(f"{self.what}: not complete after {t:g}s", timeout=t)
            try:
                self.ctx.wait_until(self._future.done, timeout=t, on_timeout=on_timeout)
            except PeerLostError as e:
                self.fail(e)
        self.release()
        return self._future.result()

    def is_completed(self) -> bool:
        """Whether the call finished (successfully or not); never blocks."""
        return self._future.done()

    def get_future(self) -> concurrent.futures.Future:
        """The call's future: its result, or its exception, once complete."""
        return self._future

    def exception(self) -> BaseException | None:
        """The error the call failed with (None if it succeeded or is still running)."""
        return self._future.exception(0) if self._future.done() else None

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<Handle {self.what} {state}>"

    # ------------------------------------------------------------------ completion (any thread)
    def complete(self, result: Any = None) -> None:
        """The call succeeded with ``result`` (idempotent: the first outcome wins)."""
        try:
            self._future.set_result(result)
        except concurrent.futures.InvalidStateError:
            return
        self.ctx.notify()

    def fail(self, err: BaseException) -> None:
        """The call failed with ``err`` (idempotent)."""
        try:
            self._future.set_exception(err)
        except concurrent.futures.InvalidStateError:
            return
        self.ctx.notify()

    def release(self) -> None:
        """Run the cleanup (closing the call's operation) once, on a user thread."""
        with self._cleanup_lock:
            fn, self._cleanup = self._cleanup, None
        if fn is not None:
            try:
                fn()
            except Exception:  # the result stands; a failed close is logged
                log.debug("%s: cleanup failed", self.what, exc_info=True)


class AsyncEngine:
    """The Context's collective stream: one thread that runs queued rank-level calls in order and fails
    pending handles on a lost peer or past their deadline. Created on first use (:func:`engine`)."""

    def __init__(self, ctx: Context, stream: Any = 0) -> None:
        self._ctx_ref = weakref.ref(ctx)
        self._queue: deque[tuple[Handle, Callable[[], Any]]] = deque()
        # strong references: a handle nobody holds any more must still be failed or have its operation closed
        self._pending: set[Handle] = set()
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False      # a call is running (on the stream thread, or inline on a caller's)
        self._thread = threading.Thread(target=self._loop, name=f"twisternet-stream-{ctx.rank}-{stream}",
                                        daemon=True)
        self._thread.start()

    def submit(self, handle: Handle, call: Callable[[], Any]) -> Handle:
        """Run ``call()`` on the stream after the calls submitted before; its result completes ``handle``."""
        with self._cond:
            if self._stop:
                raise TwisternetError(f"{handle.what}: the Context is closed")
            self._queue.append((handle, call))
            self._pending.add(handle)
            self._cond.notify_all()
        return handle

    def run(self, handle: Handle, call: Callable[[], Any]) -> Any:
        """A blocking call: on this thread when the stream is idle (no hand-over to the stream thread,
        which costs a GIL switch), else queued behind the calls before it and waited for. Either way
        it keeps its place in the order. Returns the result or raises the error."""
        with self._cond:
            inline = not self._queue and not self._busy and not self._stop
            if inline:
                self._busy = True
        if not inline:
            self.submit(handle, call)
            return handle.wait()
        try:
            handle.complete(call())
        except BaseException as e:  # noqa: BLE001 - raised below, as wait() would
            handle.fail(e)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        return handle.wait()

    def watch(self, handle: Handle) -> Handle:
        """Fail ``handle`` if a peer is lost or its deadline passes before something completes it."""
        with self._cond:
            self._pending.add(handle)
            self._cond.notify_all()
        return handle

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (not self._queue or self._busy) and not self._stop:
                    self._cond.wait(0.2)
                    done = self._sweep()
                    if done:
                        self._cond.release()      # close their operations outside the lock
                        try:
                            for h in done:
                                h.release()
                        finally:
                            self._cond.acquire()
                if self._queue and not self._busy:
                    queued: list[tuple[Handle, Callable[[], Any]]] = [self._queue.popleft()]
                    self._busy = True
                else:
                    queued = []
                stopping = self._stop
            for handle, call in queued:
                try:
                    if not handle.is_completed():     # failed early (lost peer, deadline): do not start it
                        handle.complete(call())
                except BaseException as e:  # noqa: BLE001 - the error belongs to the caller of wait()
                    handle.fail(e)
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
            if stopping and not queued:
                self._fail_all(TwisternetError("the Context was closed before the call completed"))
                return

    def _sweep(self) -> list[Handle]:
        """Fail pending handles that can no longer complete; return the completed ones, whose operations
        the caller closes (nobody may ever call their ``wait()``: a torch Work waits on its future).
        Called with the lock held."""
        ctx = self._ctx_ref()
        if ctx is None or getattr(ctx, "closed", False):
            self._stop = True
            return []
        lost = dict(getattr(ctx, "lost_peers", {}) or {})
        now = time.monotonic()
        done: list[Handle] = []
        for h in list(self._pending):
            if h.is_completed():
                self._pending.discard(h)
                done.append(h)
            elif lost:
                rank, why = next(iter(lost.items()))
                h.fail(PeerLostError(rank, why))
            elif now > h.deadline:
                h.fail(OperationTimeout(f"{h.what}: not complete after {h.timeout:g}s", timeout=h.timeout))
        return done

    def _fail_all(self, err: BaseException) -> None:
        with self._cond:
            queued = [h for h, _ in self._queue]
            self._queue.clear()
            pending = list(self._pending)
        for h in queued + pending:
            h.fail(err)


_engines: weakref.WeakKeyDictionary[Any, dict[Any, AsyncEngine]] = weakref.WeakKeyDictionary()
_engines_lock = threading.Lock()


def engine(ctx: Context, stream: Any = 0) -> AsyncEngine:
    """The collective stream ``stream`` of ``ctx`` (started on first use, stopped when the Context closes).

    Stream 0 is the functional layer's; each torch process group has its own (its edge stream), as gloo
    has a worker per group: calls of one stream run in order, calls of different streams concurrently, so
    two groups whose ranks submit in different orders across the groups cannot wait on each other."""
    with _engines_lock:
        streams = _engines.get(ctx)
        if streams is None:
            streams = _engines[ctx] = {}
        eng = streams.get(stream)
        if eng is None:
            eng = streams[stream] = AsyncEngine(ctx, stream)
            weakref.finalize(ctx, eng.stop)
        return eng


def stop_engine(ctx: Context) -> None:
    """Stop every collective stream of ``ctx``, failing what is still queued (call before closing the Context)."""
    with _engines_lock:
        streams = _engines.pop(ctx, None) or {}
    for eng in streams.values():
        eng.stop()
