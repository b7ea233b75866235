"""The record plumbing every allreduce algorithm of :class:`~collectives.allreduce.rank.RankAllReduce`
shares, and the state it declares (the algorithms are mixins over it).

Contract for collaborators (``shm.py``, ``hierarchical.py``, ``collectives.innet_allreduce``): records are
``(kind, call, step, chunk, payload[, groups])`` on one of the offsets AR_UP/AR_DOWN/RING; the handler
stashes them by ``(kind, call, step, chunk, src)`` (except those of the ring in progress);
:meth:`RecordPlumbing.send_record` sends one, :meth:`RecordPlumbing.take_record` waits for one and raises
the operation's failure, ClosedError or OperationTimeout; :meth:`RecordPlumbing._failed` fails the
operation on every rank. Of the operation they use only its documented helper contract
(``_state_lock``, ``_over``, ``_add_handler``, ``_fail_everywhere``, ``_mark_changed``,
``_raise_if_failed``; see ``collectives.base.Operation``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from twisternet.errors import (
    ClosedError,
    MismatchError,
    OperationTimeout,
    TwisternetError,
)

from ..edges import channel_edge
from ..routing import KaryTree
from .mismatch import describe_value, merge_groups, mismatch_error

if TYPE_CHECKING:
    from ..reduce import AllReduce
    from .ring import _RingCall

#: Record kinds of the hierarchical path (see hierarchical.py).
HIER_KINDS = ("U", "W", "R", "D", "S")
#: Which algorithm sends each record kind ("x": none, see Operation's ABORT edge; "t": the topology
#: exchange, which goes with any algorithm).
_PATH = {"u": "tree", "w": "tree", "r": "ring", "s": "shm", "d": "doubling", **{k: "hier" for k in HIER_KINDS},
         "R": "hier/ring", "D": "hier/doubling"}


def _compatible(kind: str, path: str) -> bool:
    """Whether a record of ``kind`` can belong to a call that goes by ``path`` on this rank."""
    family = _PATH.get(kind)
    return family is None or family == path or (family == "hier" and path.startswith("hier"))


class RecordPlumbing:
    """State and record helpers of one AllReduce operation's ``allreduce`` calls."""

    op: AllReduce
    ranks: list[int]
    tree: KaryTree
    stash: dict[tuple, Any]
    groups: dict[tuple, Any]
    ring: _RingCall | None
    current: tuple[int, str] | None
    mine_desc: str
    hier: Any

    # ------------------------------------------------------------------ plumbing
    # The contract of the collaborators (shm.py, hierarchical.py, innet_allreduce.py): records are
    # ``(kind, call, step, chunk, payload[, groups])`` on one of the offsets AR_UP/AR_DOWN/RING; the
    # handler stashes them by ``(kind, call, step, chunk, src)`` (except those of the ring in progress)
    # and ``take_record`` waits for one, raising the operation's failure, ClosedError or OperationTimeout.
    def send_record(self, dst: int, offset: int, msg: tuple, timeout: float) -> None:
        """Send record ``msg`` to rank ``dst`` on the operation's edge offset ``offset`` (blocking)."""
        self.op.ctx.send(dst, channel_edge(self.op.edge, offset), msg, timeout=timeout)

    def take_record(self, key: tuple, timeout: float) -> Any:
        """The payload of the record ``(kind, call, step, chunk, src)``, once it has arrived (removed)."""
        return self._take_record(key, timeout, False)

    def take_record_groups(self, key: tuple, timeout: float) -> tuple[Any, Any]:
        """:meth:`take_record`, and the ``{descriptor: [ranks]}`` the record carried (None if it carried
        none), both taken under one lock."""
        got: tuple[Any, Any] = self._take_record(key, timeout, True)
        return got

    def _take_record(self, key: tuple, timeout: float, groups: bool) -> Any:
        op = self.op

        def ready() -> bool:
            return key in self.stash or op._over()

        def on_timeout() -> BaseException:
            return OperationTimeout(f"allreduce() call {key[1]}: no data from rank {key[-1]} "
                                    f"(step {key[2]}, chunk {key[3]})", edge=op.edge, operation=op.operation,
                                    timeout=timeout)
        # (an operation that failed or closed before makes ready() true at once: it raises below)
        op.ctx.wait_until(ready, timeout=timeout, on_timeout=on_timeout)
        op._raise_if_failed()
        with op._state_lock():
            if key not in self.stash:
                raise ClosedError(f"{op.describe()} was closed during allreduce()")
            if groups:
                return self.stash.pop(key), self.groups.pop((key[0], key[1], key[4]), None)
            return self.stash.pop(key)

    _send = send_record
    _take = take_record

    def _path_error(self, call: int, mine: str, kind: str, src: int) -> MismatchError:
        """Rank ``src`` sent a record of another algorithm than this rank's in call ``call``: their values
        differ (in type, size or dtype) or their operations were created with different ``via``."""
        groups: dict[str, list[int]] = {}
        with self.op._state_lock():
            theirs = self.groups.get((kind, call, src))
        merge_groups(groups, theirs if theirs is not None else {f"? ({_PATH[kind]})": [src]})
        groups.setdefault(self.mine_desc, []).append(self.op.rank)
        if len(groups) > 1:
            return mismatch_error(call, groups)
        err = MismatchError(f"allreduce() call {call}: rank {src} used the {_PATH[kind]} algorithm and rank "
                            f"{self.op.rank} the {mine}; create the operation with the same via=, chunk and "
                            "threshold arguments on every rank", [src, self.op.rank])
        err.call = call    # type: ignore[attr-defined]
        return err

    def _start(self, call: int, path: str, value: Any) -> None:
        """Call ``call`` goes by ``path`` here: records of another algorithm for it mean a mismatch."""
        self.mine_desc = describe_value(value)
        with self.op._state_lock():
            self.current = (call, path)
            odd = next((k for k in self.stash if k[1] == call and not _compatible(k[0], path)),
                       None) if self.stash else None
        if odd is not None:
            raise self._failed(self._path_error(call, path, odd[0], odd[4]), f"in allreduce() call {call}", call)

    def _failed(self, e: BaseException, where: str, call: int | None = None) -> BaseException:
        """Fail the operation with ``e`` (raised here by the caller) and tell every other rank."""
        if call is not None:
            e.call = call    # type: ignore[attr-defined]  # ranks still in an earlier call wait for it
        self.op._fail_everywhere(e, where)
        return e

    def _check_child(self, call: int, groups: dict[str, list[int]], kind: str, src: int) -> None:
        """Add the groups of ``src``'s first record of ``call`` to ``groups``; raise if values differ."""
        with self.op._state_lock():
            theirs = self.groups.pop((kind, call, src), None)
        if theirs is None:
            theirs = {"?": [src]}
        merge_groups(groups, theirs)
        if len(groups) > 1:
            raise self._failed(mismatch_error(call, groups), f"in allreduce() call {call}", call)

    def _combine(self, acc: Any, got: Any, call: int) -> Any:
        try:
            return self.op.reduction.combine(acc, got)
        except TwisternetError:
            raise
        except Exception as e:  # noqa: BLE001 - the reduction raised: every rank must hear of it
            raise self._failed(e, f"in the reduction of allreduce() call {call}", call) from None

    def _chunks(self, a: int, b: int, itemsize: int, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
        """Elements ``a..b`` in pieces of ``chunk_bytes`` (default: the operation's)."""
        step = max(1, (self.op.chunk_bytes if chunk_bytes is None else chunk_bytes) // max(1, itemsize))
        return [(x, min(b, x + step)) for x in range(a, b, step)] or [(a, a)]

    def _combine_into(self, flat: np.ndarray, a: int, b: int, got: Any, call: int) -> None:
        part = flat[a:b]
        r = self._combine(part, got, call)
        if r is not part:
            flat[a:b] = r
