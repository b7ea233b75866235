"""Join: a keyed join of two tables (inner, left, right, outer) built on two KeyedPartitions.

Both sides' rows are hash-partitioned by their key columns with the same stable hash
(:mod:`collectives.columnar`), so rows with equal keys meet at one destination, which joins its two
partitions with Arrow's hash join. Null keys never match (SQL semantics): such rows appear only in
the outer sides of the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Iterable, Sequence

from twisternet.errors import ConfigError

from .columnar import key_names, require_pyarrow, sort_by_keys
from .partition import KeyedPartition

if TYPE_CHECKING:
    from twisternet.context import Context

#: How to join -> pyarrow's join_type.
HOWS = {"inner": "inner", "left": "left outer", "right": "right outer", "outer": "full outer"}


class Join:
    """Join tables sent on the ``left`` and ``right`` sides by key, at the destinations the keys hash to.

    ``Join(ctx, sources, destinations, edge, key="k", right_key=None, how="inner")`` joins on the
    ``key`` columns of the left side and ``right_key`` (default: the same names) of the right; it uses
    user edges ``edge`` and ``edge + 1`` (one KeyedPartition per side). Sources call :meth:`send_left` /
    :meth:`send_right` (any number of times, both sides optional per source) and :meth:`finish`; batch
    destinations read
    :meth:`result_table`: the joined rows of their keys, sorted by key (nulls first). Columns: the key
    columns (named as on the left), then the left's other columns, then the right's; a non-key column
    name on both sides gets ``left_suffix`` / ``right_suffix``.
    """

    operation = "Join"

    def __init__(self, ctx: Context, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 key: str | Sequence[str], right_key: str | Sequence[str] | None = None, how: str = "inner",
                 left_suffix: str = "_left", right_suffix: str = "_right",
                 timeout: float | None = None) -> None:
        require_pyarrow()
        if how not in HOWS:
            raise ConfigError("how", f"must be one of {', '.join(HOWS)}, got {how!r}")
        if edge is None:
            raise ConfigError("edge", "Join needs edge= (it uses edge and edge + 1)")
        self.how = how
        self.suffixes = (left_suffix, right_suffix)
        self.keys = key_names(key)
        self.right_keys = key_names(right_key) if right_key is not None else list(self.keys)
        if not self.keys or len(self.keys) != len(self.right_keys):
            raise ConfigError("key", f"the left and right sides need as many key columns, got {self.keys} "
                                     f"and {self.right_keys}")
        self.left = KeyedPartition(ctx, sources, destinations, edge, timeout=timeout)
        try:
            self.right = KeyedPartition(ctx, sources, destinations, edge + 1, timeout=timeout)
        except BaseException:
            self.left.abort()
            raise
        self.local_sources = self.left.local_sources
        self.local_destinations = self.left.local_destinations

    def send_left(self, task: int, table: Any, *, timeout: float | None = None) -> None:
        """Rows of the left side from local source ``task``."""
        self.left.send_table(task, table, key=self.keys, timeout=timeout)

    def send_right(self, task: int, table: Any, *, timeout: float | None = None) -> None:
        """Rows of the right side from local source ``task`` (key columns of the left's types)."""
        self.right.send_table(task, table, key=self.right_keys, timeout=timeout)

    def finish(self, task: int) -> None:
        """End both sides of source ``task``."""
        self.left.finish(task)
        self.right.finish(task)

    def result_table(self, task: int | None = None, *, timeout: float | None = None) -> Any:
        """Batch: the joined rows of this destination's keys, sorted by key."""
        pa = require_pyarrow()
        left = self.left.result_table(task, timeout=timeout)
        right = self.right.result_table(task, timeout=timeout)
        lk, rk = self.keys, self.right_keys
        if left.num_columns == 0 or right.num_columns == 0:
            if left.num_columns == 0 and right.num_columns == 0:
                return pa.table({})
            raise ConfigError("Join", "one side of the join received no table from any source (its schema "
                                      "is unknown): send an empty table with the schema from some source")
        out = left.join(right, keys=lk, right_keys=rk, join_type=HOWS[self.how],
                        left_suffix=self.suffixes[0], right_suffix=self.suffixes[1], coalesce_keys=True,
                        use_threads=False)
        return sort_by_keys(out, lk)

    def close(self) -> None:
        """Close both partitions."""
        try:
            self.left.close()
        finally:
            self.right.close()

    def abort(self) -> None:
        self.left.abort()
        self.right.abort()

    def __enter__(self) -> Join:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

