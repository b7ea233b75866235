"""The chunked, pipelined k-ary tree allreduce (any value, any reduction): up the tree, combining, and the
result back down (records ``u`` on ``AR_UP``, ``w`` on ``AR_DOWN``; see the package docstring)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..edges import AR_DOWN, AR_UP
from ..reduction import snapshot
from .mismatch import describe_value
from .plumbing import RecordPlumbing


class TreePath(RecordPlumbing):
    """Mixin of :class:`~collectives.allreduce.rank.RankAllReduce`: the tree algorithm."""

    def _tree(self, value: Any, call: int, t: float) -> Any:
        me = self.op.rank
        parent = self.tree.parent(me)
        children = self.tree.children(me)
        # with a named reduction every rank's value must look alike: the first record up says whose is what
        groups: dict[str, list[int]] | None = {describe_value(value): [me]} if self.op.reduction.named else None
        if isinstance(value, np.ndarray) and self.op.reduction.named:
            flat = np.array(value, copy=True).reshape(-1)
            bounds = self._chunks(0, flat.size, flat.itemsize)
            for c, (a, b) in enumerate(bounds):
                for ch in children:
                    got = self._take(("u", call, 0, c, ch), t)
                    if c == 0:
                        assert groups is not None     # a named reduction: set above
                        self._check_child(call, groups, "u", ch)
                    self._combine_into(flat, a, b, got, call)
                msg_kind, dsts = ("u", [parent]) if parent is not None else ("w", children)
                for d in dsts:
                    rec: tuple = (msg_kind, call, 0, c, flat[a:b])
                    if c == 0 and parent is not None:
                        rec += (groups,)
                    self._send(d, AR_UP if parent is not None else AR_DOWN, rec, t)
            if parent is not None:
                for c, (a, b) in enumerate(bounds):
                    flat[a:b] = self._take(("w", call, 0, c, parent), t)
                    for ch in children:
                        self._send(ch, AR_DOWN, ("w", call, 0, c, flat[a:b]), t)
            return flat.reshape(value.shape)
        acc = snapshot(value)
        for ch in children:
            got = self._take(("u", call, 0, 0, ch), t)
            if groups is not None:
                self._check_child(call, groups, "u", ch)
            acc = self._combine(acc, got, call)
        if parent is not None:
            self._send(parent, AR_UP, ("u", call, 0, 0, acc) + ((groups,) if groups is not None else ()), t)
            acc = self._take(("w", call, 0, 0, parent), t)
        for ch in children:
            self._send(ch, AR_DOWN, ("w", call, 0, 0, acc), t)
        return acc
