"""Worker of the cross-host in-network tests: ``CALLS`` allreduce calls via the switch, checked.

    innet_exact.py CALLS ELEMENTS

Each rank's values are seeded by (rank, call), so every rank computes the float64 sum of all of them and
checks its result against it within ``innet.error_bound``. Prints ``WHERE rank=R host=H worker=A:P
switch=A:P ps=A:P values=V own_switch=B`` after the first call, ``RESULT rank=R call=I ok=B worst=W
fallback=F`` per call (W: the largest error as a fraction of its bound), ``DONE rank=R``; on a failure
``FAILED rank=R host=H after=S type=T: message`` and exit status 3.
"""

from __future__ import annotations

import sys

import numpy as np

from collectives import AllReduce
from worker_report import run_reported
from innet import DEFAULT_SCALE, error_bound


def value(rank: int, call: int, size: int) -> np.ndarray:
    return (np.random.default_rng([rank, call, size]).standard_normal(size) * 30).astype(np.float32)


def main() -> int:
    calls, size = int(sys.argv[1]), int(sys.argv[2])

    def body(ctx, host, step) -> None:
        rank = ctx.rank
        with AllReduce(ctx, edge=1, op="sum", via="innet") as ar:
            for i in range(calls):
                got = ar.allreduce(value(ctx.rank, i, size))
                ref = sum(value(r, i, size).astype(np.float64) for r in range(ctx.world))
                bound = error_bound(ref, DEFAULT_SCALE, ctx.world)
                err = np.abs(got.astype(np.float64) - ref)
                path = ar._rank_allreduce.innet
                if i == 0:
                    w = path.job.worker
                    print(f"WHERE rank={rank} host={host} worker={w.address[0]}:{w.address[1]} "
                          f"switch={w.switch_addr[0]}:{w.switch_addr[1]} ps={w.ps_addr[0]}:{w.ps_addr[1]} "
                          f"values={w.value_count} own_switch={path.service is not None}", flush=True)
                print(f"RESULT rank={rank} call={i} ok={bool((err <= bound).all())} "
                      f"worst={(err / bound).max():.3g} fallback={path.last_stats.fallback}",
                      flush=True)
                step()
    return run_reported(body)


if __name__ == "__main__":
    sys.exit(main())
