"""How an operation fails: the first error wins, every waiter raises it, and every other rank of the
operation hears of it (a mixin of :class:`~collectives.base.operation.Operation`).

State (made in ``Operation.__init__``): ``_error`` (the failure), ``_spread`` (local failures still to
tell the other ranks about), ``_ctx_lost`` (the Context's live table of lost ranks), ``_deferral`` (who
decides whether another rank's failure waits)."""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Callable

from twisternet.errors import MismatchError, PeerLostError, ProtocolError, RemoteError, TwisternetError

from ..edges import ABORT, channel_edge
from .state import OperationState

log = logging.getLogger(__name__)


class FailureSpread(OperationState):
    """Operation part: failing, telling the other ranks, raising."""

    def _check_peers(self) -> None:
        """PeerLostError (naming the first rank lost) if a rank of this operation is gone: a send that
        only buffers locally (batch) would otherwise notice no earlier than finish()."""
        if self._ctx_lost and any(r in self._ctx_lost for r in self.member_ranks):
            self.ctx.check_lost()

    def _fail(self, e: BaseException, where: str = "") -> None:
        """The operation failed with ``e``: every waiter in this process raises it, and (unless it came
        from another rank or is a lost peer, which every rank sees itself) it is sent to the other ranks
        of the operation (by :meth:`_after`, outside the lock), so they raise too instead of waiting."""
        if self._error is None:
            self._error = e
            log.error("rank %d: %s on edge %d failed %s: %r", self.rank, self.describe(), self.edge, where, e)
            if not isinstance(e, (RemoteError, PeerLostError)) and not (isinstance(e, TwisternetError) and e.remote):
                self._spread.append(e)
        self._changed = True

    def _spread_failure(self) -> None:
        """Tell every other rank of the operation why it failed here (one record each on ``ABORT``)."""
        with self._lock:
            if not self._spread:
                return
            e = self._spread.pop()
            self._spread.clear()
        notice = [self.rank, type(e).__name__, str(e), list(getattr(e, "ranks", []) or []), getattr(e, "call", None)]
        edge = channel_edge(self.edge, ABORT)
        for r in self.member_ranks:
            if r == self.rank or r in self.ctx.lost_peers:
                continue
            try:
                self.ctx.send(r, edge, notice, timeout=min(self.timeout, 5.0))
            except TwisternetError as err:   # a peer that is gone or stuck hears of it some other way
                log.debug("rank %d: could not tell rank %d of the failure: %r", self.rank, r, err)

    def _on_edge_error(self, e: BaseException) -> None:
        """The Context found records of another operation on this one's edges (MismatchError): fail."""
        if isinstance(e, TwisternetError):
            e.remote = True   # the Context told the peer itself
        with self._lock:
            self._fail(e, "")
        self._after()

    def _on_abort(self, src: int, notice: Any) -> bool:
        """Another rank's part of the operation failed: fail here with the same error."""
        try:
            origin, kind, message, ranks, call = notice
        except (TypeError, ValueError):
            raise self._protocol(src, notice) from None
        err: TwisternetError
        if kind == "MismatchError":
            err = MismatchError(str(message), ranks)
        else:
            err = RemoteError(int(origin), f"{kind}: {message}")
        err.remote = True   # do not send it back
        if call is not None and self._defer_failure(call, err):
            return True
        self._fail(err, f"on rank {origin}")
        return True

    def _defer_failure(self, call: int, err: BaseException) -> bool:
        """Whether a failure another rank had in its call ``call`` (of a rank-level collective such as
        ``allreduce``) waits until this rank makes that call, because it is still in an earlier one (the
        hook of :meth:`~collectives.base.operation.Operation._defer_failures_to` decides)."""
        return self._deferral is not None and self._deferral(call, err)

    def _guarded(self, fn: Callable[[], None], where: str) -> BaseException | None:
        """Run ``fn`` (under the operation's lock): an error of the user's code in it (e.g. the reduction
        raised) fails the operation on every rank and is returned, for the caller to raise once it has
        let go of the lock; the library's own errors propagate as they are."""
        try:
            fn()
        except TwisternetError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the reduction raised: every rank must hear of it
            self._fail(e, where)
            return e
        return None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _protocol(self, src: int, msg: Any) -> ProtocolError:
        return ProtocolError(f"{self.describe()} edge {self.edge}: unexpected record from rank {src}: {msg!r:.200}")
