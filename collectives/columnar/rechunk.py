"""Re-chunking: many small record batches joined into few of about a target size."""

from __future__ import annotations

from typing import Any
from collections.abc import Iterable, Iterator

from twisternet.arrowcodec import require_pyarrow


def rechunk(batches: Iterable[Any], target_bytes: int) -> Iterator[Any]:
    """``batches`` (one schema) in the same row order, consecutive ones smaller than ``target_bytes``
    concatenated into batches of about ``target_bytes`` (a batch at least that large passes as it is,
    without a copy): many small pieces reach the reader as few large batches."""
    pa = require_pyarrow()
    held: list[Any] = []
    size = 0

    def joined() -> Any:
        if len(held) == 1:
            return held[0]
        if hasattr(pa, "concat_batches"):
            return pa.concat_batches(held)
        return pa.Table.from_batches(held).combine_chunks().to_batches()[0]

    for batch in batches:
        nbytes = batch.nbytes
        if nbytes >= target_bytes:
            if held:
                yield joined()
                held, size = [], 0
            yield batch
            continue
        if batch.num_rows == 0:
            continue
        held.append(batch)
        size += nbytes
        if size >= target_bytes:
            yield joined()
            held, size = [], 0
    if held:
        yield joined()
