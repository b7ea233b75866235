"""Columnar dataflow: whole Arrow tables through the operations (``send_table`` / ``result_table``).

Sources call ``op.send_table(task, table, key=...)`` with a ``pyarrow.Table`` or ``RecordBatch`` (a
pandas DataFrame or a numpy structured array is converted on the way in); batch destinations read
``op.result_table(task)``, a ``pyarrow.Table``. Rows are routed with vectorized kernels over the whole
table, never per row, and each destination's rows travel as a few large slices whose Arrow buffers are
the codec's out-of-band parts (:mod:`twisternet.arrowcodec`).

Routing of keyed operations: :func:`row_hashes` is a stable 64-bit hash of the key columns, identical
in every process, platform and pyarrow version (it is defined here, on the key values, not taken from
pyarrow). Per key column, each value becomes a 64-bit hash:

* integers, booleans, dates, times, timestamps, durations: the value as a 64-bit integer (signed values
  sign-extended), hashed with ``mix``;
* floats: the value as a float64 (``-0.0`` taken as ``0.0``, every NaN as ``0x7ff8000000000000``),
  its bits hashed with ``mix``;
* strings, binary, large and fixed-size binary, decimals: the bytes (UTF-8 for strings; a decimal's
  little-endian two's-complement bytes) as ``h = mix(len + G)`` then, for each 8-byte little-endian
  word ``w`` of the bytes (the last one zero-padded), ``h = mix(h ^ w)``;
* dictionary columns: the hash of their decoded values.

``mix`` is the splitmix64 finalizer (``x ^= x >> 30; x *= 0xbf58476d1ce4e5b9; x ^= x >> 27;
x *= 0x94d049bb133111eb; x ^= x >> 31``, modulo 2**64) and ``G = 0x9e3779b97f4a7c15``. The row hash
folds the columns in order: ``H = 0; H = mix(H ^ h_c)`` for each key column ``c``. A row goes to
``destinations[H % len(destinations)]``; a row with a null in any key column goes to
``destinations[0]`` (and sorts first in KeyedGather / KeyedReduce results).

What a destination's ``result_table`` holds:

=================  =================================================================================
KeyedPartition     its rows as sent: ordered by source task, then send order
KeyedGather        its rows sorted by the key columns (nulls first); stable: equal keys keep source
                   task order, then send order
KeyedReduce        one row per key of this destination: the key columns, then ``{column}_{fn}`` for
                   each aggregation (``sum``, ``min``, ``max``, ``count`` of non-null values,
                   ``mean``), sorted by key (nulls first); partial aggregates are computed at the
                   sources (a combiner) and merged at the destination
Partition          the rows sent to it (by ``key`` hash, ``destination`` or round-robin), by source
                   task then send order
Gather, AllGather  every source's rows, by source task then send order
Broadcast          the source's rows, in send order
=================  =================================================================================

Every table sent to one operation must have the same schema: a destination that sees two raises
:class:`~twisternet.errors.TableSchemaError` naming the columns that differ and the ranks and tasks that
sent each variant (each source sends every new schema it uses to every destination, so each
destination sees every variant). A key column missing at the sender raises it at ``send_table``. An
operation carries either records (``send``) or tables (``send_table``), not both.

Streaming operations take tables too: ``result_batches`` then yields each piece as it arrives (send
order per source, none between sources; KeyedGather's unsorted; KeyedReduce's as the updated aggregates
of the keys the piece touched), and ``result_table`` gathers them once every source finished
(KeyedGather's sorted, KeyedReduce's final aggregates). Batch destinations re-chunk small received pieces
into batches of about ``config.table_batch_bytes`` (:func:`rechunk`).

Layout (one concept per module): ``table_input`` (what ``send_table`` accepts, key names), ``hashing``
(the row hash above), ``routing`` (destination of each row by hash or key range, per-destination
rows), ``sorting`` (stable sort by key, nulls first), ``schemas`` (what differs between two
schemas), ``rechunk`` (small batches joined), ``aggregates`` (KeyedReduce's partial and merged
states), ``table_ops`` (the mixin every operation's table path shares), ``row_tables`` (Partition,
Broadcast, Gather), ``keyed_gather_tables`` and ``keyed_reduce_tables``.
"""

from __future__ import annotations

from twisternet.arrowcodec import INSTALL_HINT, require_pyarrow

from .aggregates import AGGREGATIONS, merge_aggregates, merge_states, partial_aggregate
from .hashing import GOLDEN, row_hashes
from .keyed_gather_tables import KeyedGatherTables
from .keyed_reduce_tables import KeyedReduceTables
from .rechunk import rechunk
from .routing import destination_index, range_index, split_rows, splitters_from_sample
from .row_tables import BroadcastTables, GatherTables, PartitionTables
from .sorting import sort_by_keys
from .table_input import check_key_columns, key_names, to_table

__all__ = ["to_table", "rechunk", "row_hashes", "destination_index", "split_rows", "range_index",
           "splitters_from_sample",
           "sort_by_keys", "key_names",
           "partial_aggregate", "merge_aggregates", "merge_states", "AGGREGATIONS", "INSTALL_HINT",
           "PartitionTables", "BroadcastTables", "GatherTables", "KeyedGatherTables", "KeyedReduceTables",
           "GOLDEN", "check_key_columns", "require_pyarrow"]
