"""TeraSort-style sort of 100-byte records (10-byte keys) as Arrow tables: generate, sort, validate
(needs pyarrow: ``pip install 'twisternet[arrow]'``).

    twisternet run -n 2 examples/terasort.py [--records N] [--memory-limit BYTES]
    mpiexec -n 2 python examples/terasort.py

Each worker generates its share of the records (a random 10-byte key and a 90-byte value holding the
record's number), sends a sample of its keys to everyone (AllGather), and all compute the same range
splitters from the whole sample. KeyedGather then routes every record to the worker owning its key range
and sorts each worker's rows by key, so the workers' results in rank order are one sorted sequence.
With ``--memory-limit`` each worker reads its result as record batches (``result_batches``): past the
limit, sorted runs are spilled as Arrow IPC files and merged back, so the sorted data need not fit in
memory.
Validation: each worker's keys are sorted, each worker's first key is not below the previous worker's
last, and the count and an order-independent checksum of all records equal the input's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

import twisternet as tn
from collectives import AllGather, Gather, KeyedGather

if TYPE_CHECKING:
    import pyarrow as pa

KEY_BYTES, VALUE_BYTES = 10, 90


def generated_records(rank: int, world: int, records: int, seed: int = 11) -> pa.Table:
    """Worker ``rank``'s share: columns ``key`` (binary(10), random) and ``value`` (binary(90))."""
    import pyarrow as pa
    lo, hi = records * rank // world, records * (rank + 1) // world
    n = hi - lo
    rng = np.random.default_rng([seed, rank])
    keys = rng.integers(0, 256, (n, KEY_BYTES), dtype=np.uint8)
    values = np.zeros((n, VALUE_BYTES), dtype=np.uint8)
    values[:, :8] = np.arange(lo, hi, dtype=">u8").view(np.uint8).reshape(n, 8)
    values[:, 8:] = ord("x")
    return pa.table({
        "key": pa.FixedSizeBinaryArray.from_buffers(pa.binary(KEY_BYTES), n, [None, pa.py_buffer(keys)]),
        "value": pa.FixedSizeBinaryArray.from_buffers(pa.binary(VALUE_BYTES), n, [None, pa.py_buffer(values)]),
    })


def checksum(table: pa.Table) -> int:
    """Order-independent checksum of the records (the sum of their stable row hashes, mod 2**64)."""
    from collectives.columnar import row_hashes
    h, _ = row_hashes(table, ["key", "value"])
    return int(np.sum(h, dtype=np.uint64))


def keys_numpy(table: pa.Table) -> np.ndarray:
    col = table.column("key").combine_chunks()
    raw = np.frombuffer(col.buffers()[1], dtype=np.uint8)[col.offset * KEY_BYTES:(col.offset + len(col)) * KEY_BYTES]
    return raw.view(f"S{KEY_BYTES}")


def main() -> None:
    import pyarrow as pa
    from collectives.columnar import splitters_from_sample
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--sample", type=int, default=10_000, help="keys sampled per worker")
    ap.add_argument("--memory-limit", type=int, default=0,
                    help="bytes of sorted rows held before spilling runs (0: sort in memory)")
    args = ap.parse_args()
    limits = {"memory_limit": args.memory_limit} if args.memory_limit else {}
    with tn.init(timeout=1800, **limits) as ctx:      # the operations' own stores spill past it too
        task = ctx.my_tasks[0]
        table = generated_records(ctx.rank, ctx.world, args.records)
        in_sum, in_count = checksum(table), table.num_rows
        t0 = time.perf_counter()
        with AllGather(ctx, edge=1) as ag:
            step = max(1, table.num_rows // args.sample)
            ag.send_table(task, table.select(["key"]).take(np.arange(0, table.num_rows, step)))
            ag.finish(task)
            splitters = splitters_from_sample(ag.result_table(task), ["key"], len(ctx.tasks))
        with KeyedGather(ctx, edge=2) as sort:
            sort.send_table(task, table, key="key", splitters=splitters)
            sort.finish(task)
            del table
            out_sum, out_count, ordered, first, last = 0, 0, True, None, None
            batches: Iterable[Any]
            if args.memory_limit:
                batches = sort.result_batches(task, memory_limit=args.memory_limit, compression=None)
            else:
                batches = [sort.result_table(task)]
            checking = 0.0
            for batch in batches:        # validated as it streams: nothing is kept
                c0 = time.perf_counter()
                if not isinstance(batch, pa.Table):
                    batch = pa.Table.from_batches([batch])
                keys = keys_numpy(batch)
                if not len(keys):
                    checking += time.perf_counter() - c0
                    continue
                ordered &= bool(np.all(keys[:-1] <= keys[1:])) and (last is None or last <= keys[0])
                first = keys[0] if first is None else first
                last = keys[-1]
                out_sum += checksum(batch)
                out_count += len(keys)
                checking += time.perf_counter() - c0
            elapsed = time.perf_counter() - t0 - checking     # the sort alone
            runs = getattr(sort, "spilled_runs", 0)
        summary = {"rank": ctx.rank, "seconds": elapsed, "in_sum": in_sum, "in_count": in_count,
                   "out_sum": out_sum, "out_count": out_count, "sorted": ordered, "runs": runs,
                   "first": first.hex() if first is not None else None,
                   "last": last.hex() if last is not None else None}
        with Gather(ctx, edge=3, destinations=[ctx.tasks[0]]) as g:
            g.send(task, summary)
            g.finish(task)
            if ctx.rank != 0:
                return
            parts = sorted((v for _, v in g.results()), key=lambda p: p["rank"])
        mask = (1 << 64) - 1
        ok = all(p["sorted"] for p in parts)
        ok &= sum(p["in_count"] for p in parts) == sum(p["out_count"] for p in parts) == args.records
        ok &= sum(p["in_sum"] for p in parts) & mask == sum(p["out_sum"] for p in parts) & mask
        bounds = [(p["first"], p["last"]) for p in parts if p["first"] is not None]
        ok &= all(a[1] <= b[0] for a, b in zip(bounds, bounds[1:]))
        seconds = max(p["seconds"] for p in parts)
        mb = args.records * (KEY_BYTES + VALUE_BYTES) / 1e6
        for p in parts:
            print(f"[{p['rank']}] {p['out_count']} records, keys {p['first']} .. {p['last']}, "
                  f"{p['runs']} spilled runs")
        print(f"sorted {args.records} records ({mb:.0f} MB) in {seconds:.3f} s ({mb / seconds:.1f} MB/s); "
              f"validation {'passed' if ok else 'FAILED'}")
        if not ok:
            sys.exit(1)


if __name__ == "__main__":
    main()
