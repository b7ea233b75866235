"""KeyedReduce's table aggregations: partial states at the sources (the combiner), merged at the destination."""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Mapping, Sequence

from twisternet.arrowcodec import require_pyarrow

from .sorting import sort_by_keys

#: Aggregations KeyedReduce.send_table accepts.
AGGREGATIONS = ("sum", "min", "max", "count", "mean")
_META_AGG = b"twisternet.aggregate"


def _check_aggregate(aggregate: Mapping[str, str | Sequence[str]]) -> list[tuple[str, str]]:
    if not isinstance(aggregate, Mapping) or not aggregate:
        raise TypeError(f"aggregate must be a non-empty dict column -> aggregation, got {aggregate!r}")
    out = []
    for col, fns in aggregate.items():
        for fn in ([fns] if isinstance(fns, str) else list(fns)):
            if fn not in AGGREGATIONS:
                raise ValueError(f"aggregation {fn!r} of column {col!r} is not one of {', '.join(AGGREGATIONS)}")
            out.append((col, fn))
    return out


def _states(spec: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The partial-aggregate states ``(column, sum|min|max|count)`` that ``spec`` needs."""
    states: list[tuple[str, str]] = []
    for col, fn in spec:
        for s in (("sum", "count") if fn == "mean" else (fn,)):
            if (col, s) not in states:
                states.append((col, s))
    return states


def _state_name(col: str, op: str) -> str:
    return f"{col}\x1f{op}"


def partial_aggregate(table: Any, keys: list[str], spec: list[tuple[str, str]]) -> Any:
    """One row per key of ``table`` with the partial states of ``spec`` (the combiner)."""
    states = _states(spec)
    agg = table.group_by(keys, use_threads=False).aggregate([(c, s) for c, s in states])
    cols = {k: agg.column(k) for k in keys}
    for c, s in states:
        cols[_state_name(c, s)] = agg.column(f"{c}_{s}")
    pa = require_pyarrow()
    out = pa.table(cols)
    meta = {_META_AGG: json.dumps({"keys": keys, "spec": spec}).encode()}
    return out.replace_schema_metadata(meta)


def merge_aggregates(partials: Any, keys: list[str], spec: list[tuple[str, str]]) -> Any:
    """The final one-row-per-key table from concatenated partial states, sorted by key."""
    return _final_aggregates(merge_states(partials, keys, spec), keys, spec)


def merge_states(partials: Any, keys: list[str], spec: list[tuple[str, str]], extra: Sequence[str] = ()) -> Any:
    """One row per key of ``partials`` (partial-state rows, e.g. several sources' for one key) with
    the merged states, named as in the partials (sums of sums and counts, min of mins, ...); the
    ``extra`` columns are merged with ``max``."""
    pa = require_pyarrow()
    states = _states(spec)
    partials = partials.unify_dictionaries()     # pieces from several sources: one dictionary per column
    merged = partials.group_by(keys, use_threads=False).aggregate(
        [(_state_name(c, s), "sum" if s in ("sum", "count") else s) for c, s in states]
        + [(e, "max") for e in extra])
    cols = {k: merged.column(k) for k in keys}
    for c, s in states:
        cols[_state_name(c, s)] = merged.column(f"{_state_name(c, s)}_{'sum' if s in ('sum', 'count') else s}")
    for e in extra:
        cols[e] = merged.column(f"{e}_max")
    return pa.table(cols).replace_schema_metadata(partials.schema.metadata)


def _final_aggregates(merged: Any, keys: list[str], spec: list[tuple[str, str]]) -> Any:
    """The ``{column}_{fn}`` columns of merged states, sorted by key."""
    pa = require_pyarrow()
    import pyarrow.compute as pc
    got = {(c, s): merged.column(_state_name(c, s)) for c, s in _states(spec)}
    cols = {k: merged.column(k) for k in keys}
    for c, fn in spec:
        if fn == "mean":
            total = pc.cast(got[(c, "sum")], pa.float64())
            count = got[(c, "count")]
            cols[f"{c}_mean"] = pc.if_else(pc.greater(count, 0), pc.divide(total, pc.cast(count, pa.float64())),
                                           pa.scalar(None, pa.float64()))
        elif fn == "count":
            cols[f"{c}_count"] = pc.fill_null(got[(c, "count")], 0)
        else:
            cols[f"{c}_{fn}"] = got[(c, fn)]
    return sort_by_keys(pa.table(cols), keys)
