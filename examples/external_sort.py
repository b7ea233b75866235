"""Sort more data than the memory bound allows: a batch KeyedGather that spills sorted runs to disk.

    twisternet run -n 4 examples/external_sort.py [--records N] [--memory 4MiB] [--out DIR]

Every worker generates ``--records`` random 64-bit keys, each with a payload. A range selector sends key
range ``i`` to destination ``i``, so the destinations' outputs, concatenated in task order, are globally
sorted. Each destination holds at most ``--memory`` bytes of records in RAM (``memory_limit``) and
spills sorted runs to disk past it; reading the results merges the runs k-way. Destinations write their
part to ``DIR/part-<task>.txt`` (if ``--out``) and check the order; rank 0 prints the totals.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import twisternet as tn
from collectives import Gather, KeyedGather

KEY_SPACE = 1 << 62


def range_selector(key: int, destinations: Sequence[int]) -> int:
    """Destination ``i`` gets keys in ``[i, i + 1) * KEY_SPACE / len(destinations)``."""
    return destinations[min(len(destinations) - 1, key * len(destinations) // KEY_SPACE)]


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000, help="records generated per worker")
    ap.add_argument("--payload", type=int, default=32, help="payload bytes per record")
    ap.add_argument("--memory", default="4MiB", help="memory bound per destination before spilling")
    ap.add_argument("--spill-dir", default=None)
    ap.add_argument("--out", default=None, help="directory for the sorted parts (default: none written)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    spill_dir = args.spill_dir or tempfile.gettempdir()
    with tn.init(memory_limit=args.memory, spill_dir=spill_dir) as ctx:
        task = ctx.my_tasks[0]
        t0 = time.perf_counter()
        sorter = KeyedGather(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1, key_type="int",
                             selector=range_selector, group=False, mode="batch")
        summary = Gather(ctx, sources=ctx.tasks, destinations=[0], edge=2, mode="batch")
        rng = np.random.default_rng([args.seed, ctx.rank])
        keys = rng.integers(0, KEY_SPACE, size=args.records, dtype=np.int64)
        pad = "x" * max(0, args.payload - 12)
        for i, k in enumerate(keys.tolist()):
            sorter.send(task, k, f"{ctx.rank:04d}{i:08d}{pad}")
        sorter.finish(task)

        count, previous, ordered, checksum = 0, -1, True, 0
        out = open(os.path.join(args.out, f"part-{task:05d}.txt"), "w") if args.out else None
        try:
            for key, payload in sorter.results(task):
                ordered = ordered and key >= previous
                previous = key
                count += 1
                checksum = (checksum + key) % (1 << 64)
                if out is not None:
                    out.write(f"{key:019d} {payload}\n")
        finally:
            if out is not None:
                out.close()
        summary.send(task, (count, ordered, checksum, previous))
        summary.finish(task)
        result = None
        if ctx.rank == 0:
            parts = [v for _, v in summary.results()]
            total = sum(p[0] for p in parts)
            result = {"records": total, "ordered": all(p[1] for p in parts),
                      "checksum": sum(p[2] for p in parts) % (1 << 64)}
            print(f"sorted {total} records ({total * (args.payload + 8) / 2**20:.1f} MiB) on {ctx.world} workers "
                  f"with a {args.memory} memory bound per destination in {time.perf_counter() - t0:.2f} s; "
                  f"globally ordered: {result['ordered']}")
        sorter.close()
        summary.close()
        return result


if __name__ == "__main__":
    main()
