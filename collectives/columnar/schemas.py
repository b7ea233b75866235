"""Comparing the schemas of received pieces: what differs, in words for TableSchemaError."""

from __future__ import annotations

from typing import Any


def _label(name: str) -> str:
    """A column name for messages (KeyedReduce's partial states named after their column)."""
    if "\x1f" in name:
        col, state = name.split("\x1f", 1)
        return f"{col!r} (its {state} partial)"
    return repr(name)


def _own_meta(schema: Any) -> dict:
    """The schema metadata this module sets (key columns, aggregations), which must agree."""
    meta = schema.metadata or {}
    return {k.decode(): v.decode() for k, v in meta.items() if k.startswith(b"twisternet.")}


def _schema_diff(a: Any, b: Any) -> str:
    fa = {f.name: f for f in a}
    fb = {f.name: f for f in b}
    parts = []
    only_a = [n for n in fa if n not in fb]
    only_b = [n for n in fb if n not in fa]
    if only_a:
        parts.append(f"columns {', '.join(map(_label, only_a))} only in the first")
    if only_b:
        parts.append(f"columns {', '.join(map(_label, only_b))} only in the second")
    for name in fa:
        if name in fb and not fa[name].type.equals(fb[name].type):
            parts.append(f"column {_label(name)}: {fa[name].type} vs {fb[name].type}")
        elif name in fb and fa[name].nullable != fb[name].nullable:
            parts.append(f"column {_label(name)}: nullable {fa[name].nullable} vs {fb[name].nullable}")
    if not parts and a.names != b.names:
        parts.append(f"column order {a.names} vs {b.names}")
    if not parts:
        parts.append("field metadata differs")
    return "; ".join(parts)
