"""Tables coming in: what ``send_table`` accepts (Arrow, pandas, numpy structured arrays) and key names."""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import numpy as np

from twisternet.arrowcodec import require_pyarrow
from twisternet.errors import TableSchemaError


def to_table(data: Any) -> Any:
    """``data`` as a ``pyarrow.Table``: a Table as it is, a RecordBatch wrapped (no copy), a pandas
    DataFrame (index dropped) or a numpy structured array converted column by column."""
    pa = require_pyarrow()
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, np.ndarray) and data.dtype.names is not None:
        if data.ndim != 1:
            raise TableSchemaError(f"a structured array table must be 1-d, got shape {data.shape}")
        return pa.table({name: np.ascontiguousarray(data[name]) for name in data.dtype.names})
    mod = type(data).__module__ or ""
    if mod.startswith("pandas") and type(data).__name__ == "DataFrame":
        table = pa.Table.from_pandas(data, preserve_index=False)
        meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != b"pandas"}
        return table.replace_schema_metadata(meta or None)
    raise TypeError(f"send_table takes a pyarrow Table or RecordBatch, a pandas DataFrame or a numpy "
                    f"structured array, got {type(data).__module__}.{type(data).__qualname__}")


def key_names(key: str | Sequence[str] | None) -> list[str]:
    """The key column names of ``key`` (one name or several)."""
    if key is None:
        return []
    if isinstance(key, str):
        return [key]
    names = list(key)
    if not names or not all(isinstance(k, str) for k in names):
        raise TypeError(f"key must be a column name or a list of column names, got {key!r}")
    return names


def check_key_columns(table: Any, keys: Sequence[str], where: str) -> None:
    """TableSchemaError unless every key column is in ``table``."""
    missing = [k for k in keys if k not in table.column_names]
    if missing:
        raise TableSchemaError(f"{where}: key column(s) {missing} not in the table; its columns are "
                               f"{table.column_names}")
