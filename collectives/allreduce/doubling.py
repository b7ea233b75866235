"""Recursive-doubling allreduce over a list of ranks (numpy arrays, named reductions).

``log2 p`` rounds (``p`` the largest power of two not above ``n``), two more for the ranks folded in and
out when ``n`` is not a power of two; in each round a rank sends its whole partial result to one partner
and combines the partner's into it. Two users:

* flat, over every rank of the operation (``via="doubling"``, records ``d``): what "auto" picks over
  sockets for arrays under ``ring_threshold`` (see select.py); at 2 ranks a call is one message each way
  at once, where the tree waits for a round trip through its root;
* between the host leaders of the hierarchical algorithm (records ``D``, see hierarchical.py).

A non-power-of-two ``n = p + rem`` (``p`` the largest power of two below it) folds the extra ranks in
first: of the first ``2 rem`` ranks each even one hands its array to its odd neighbour (step
``_FOLD_IN``) and gets the result back from it at the end (``_FOLD_OUT``); the ``p`` others run the
power-of-two exchange.

Every record carries ``{descriptor: [ranks]}`` of the values its sender has seen so far (its own and its
partners', see :mod:`.mismatch`), so after the last round every rank knows every rank's descriptor
without another message. When two differ a rank stops combining, still exchanges, and raises
MismatchError after its last round, naming the ranks that differ from the majority: the same error on
every rank (and the first one to raise tells the others through the operation's ``ABORT`` edge).
Both partners of a round combine the same two arrays (the reductions are commutative), so every rank
ends with the bit-identical result.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twisternet.errors import ProtocolError, TwisternetError

from ..edges import AR_DOWN, AR_UP
from .mismatch import merge_groups, mismatch_error
from .plumbing import RecordPlumbing

#: Steps of the records that fold the extra ranks of a non-power-of-two count in and out.
_FOLD_IN, _FOLD_OUT = -1, -2

__all__ = ["DoublingPath"]


class DoublingPath(RecordPlumbing):
    """Mixin of :class:`~collectives.allreduce.rank.RankAllReduce`: recursive doubling."""

    def _flat_doubling(self, value: np.ndarray, call: int, t: float, out: np.ndarray | None) -> np.ndarray:
        """``via="doubling"``: every rank of the operation, the result in ``out`` when given (after
        ``_start``, which notes the value's descriptor)."""
        if out is None:
            acc = np.ascontiguousarray(value).reshape(-1).copy()
        else:
            if out is not value:    # (another array: run() made sure it does not overlap the value)
                out[...] = value
            acc = out.reshape(-1)
        self._doubling(acc, self.mine_desc, call, t, self.ranks, kind="d")   # (set by _start)
        return acc.reshape(value.shape) if out is None else out

    def _doubling(self, acc: np.ndarray, desc: str, call: int, t: float, ranks: list[int],
                  kind: str = "D") -> np.ndarray:
        """Recursive doubling over ``ranks`` on the flat array ``acc``, in place (records ``kind``)."""
        op = self.op
        me = op.rank
        n = len(ranks)
        i = ranks.index(me)
        p = 1 << (n.bit_length() - 1)
        rem = n - p
        groups: dict[str, list[int]] = {desc: [me]}
        differ = False
        # consecutive calls alternate between two channel edges: a partner returns the credit of this
        # call's record with its record of the next call, so the one after finds its edge idle again
        # and goes out at once as its own message (the core batches records behind unacknowledged ones)
        offset = AR_UP if call % 2 == 0 else AR_DOWN

        def exchange(peer: int, step: int, send: bool = True, recv: bool = True) -> Any:
            nonlocal differ, groups
            if send:
                self.send_record(peer, offset, (kind, call, step, 0, acc, groups), t)
            if not recv:
                return None
            got, theirs = self.take_record_groups((kind, call, step, 0, peer), t)
            if step == _FOLD_OUT and isinstance(theirs, dict):
                groups = {str(d): [int(r) for r in rs] for d, rs in theirs.items()}   # they cover this rank too
            else:
                merge_groups(groups, theirs if theirs is not None else {"?": [peer]})
            if len(groups) > 1:
                differ = True
            elif not isinstance(got, np.ndarray) or got.dtype != acc.dtype or got.size != acc.size:
                raise self._failed(ProtocolError(
                    f"allreduce() call {call}: rank {peer} sent {getattr(got, 'dtype', type(got).__name__)} x "
                    f"{getattr(got, 'size', '?')} for {acc.dtype} x {acc.size}"), f"in allreduce() call {call}", call)
            return got

        def combine(got: Any) -> None:
            if differ:
                return
            try:
                op.reduction.ufunc(acc, got.reshape(-1), out=acc)
            except TwisternetError:
                raise
            except Exception as e:  # noqa: BLE001 - every rank must hear of it
                raise self._failed(e, f"in the reduction of allreduce() call {call}", call) from None

        def real(v: int) -> int:
            return ranks[v * 2 + 1] if v < rem else ranks[v + rem]

        if i < 2 * rem and i % 2 == 0:      # folded in: hand the array to the odd neighbour, wait for the result
            exchange(ranks[i + 1], _FOLD_IN, recv=False)
            got = exchange(ranks[i + 1], _FOLD_OUT, send=False)
            if not differ:
                acc[...] = got.reshape(-1)
        else:
            if i < 2 * rem:
                combine(exchange(ranks[i - 1], _FOLD_IN, send=False))
            vi = i // 2 if i < 2 * rem else i - rem
            mask, step = 1, 0
            while mask < p:
                combine(exchange(real(vi ^ mask), step))
                mask <<= 1
                step += 1
            if i < 2 * rem:
                exchange(ranks[i - 1], _FOLD_OUT, recv=False)
        if differ:
            raise self._failed(mismatch_error(call, groups), f"in allreduce() call {call}", call)
        return acc
