"""Gather and AllGather hold and send records as chunks ``(source_task, [value, ...])``; on the wire a
list of chunks is the two columns ``[[task, ...], [[value, ...], ...]]``."""

from __future__ import annotations

from typing import Any

from ..columns import is_columns


def append_chunk(buf: list, task: int, vals: list) -> int:
    """Add the records ``vals`` of ``task`` to the chunks in ``buf`` (growing its last chunk if that is
    ``task``'s); returns how many records ``buf`` now holds."""
    if buf and buf[-1][0] == task:
        buf[-1][1].extend(vals)
    else:
        buf.append((task, vals))
    return sum(len(c) for _, c in buf)


def chunk_columns(chunks: list) -> list:
    """Chunks as the two wire columns."""
    return [[t for t, _ in chunks], [c for _, c in chunks]]


def is_chunk_columns(payload: Any) -> bool:
    """Whether ``payload`` is the two wire columns of a list of chunks."""
    return is_columns(payload, 2) and all(isinstance(c, list) for c in payload[1])
