"""One rank of tests/testbed/test_hierarchical.py: the same allreduce calls hierarchical and flat.

Prints ``HIER {"rank", "host", "results": [[via, dtype, size, digest, first, sum]...], "algos": [...]}``.
"""

from __future__ import annotations

import hashlib
import json
import socket

import numpy as np

import twisternet as tn
from collectives import AllReduce
from collectives.allreduce import RankAllReduce

SIZES = [1, 3, 1000, 200_000, 1_100_000]
used: list[str] = []
for name in ("_hier", "_multi_ring", "_doubling", "_ring", "_tree"):
    orig = getattr(RankAllReduce, name)

    def spy(self, *a, _orig=orig, _name=name, **k):
        used.append(_name)
        return _orig(self, *a, **k)
    setattr(RankAllReduce, name, spy)

with tn.init(timeout=300) as ctx:
    out = []
    for via in ("hier", "ring"):
        op = AllReduce(ctx, edge=5 if via == "hier" else 6, op="sum", via=via, ring_threshold=256 << 10,
                       chunk_bytes=256 << 10, shm_chunk_bytes=64 << 10)
        for dtype in ("int64", "float32"):
            rng = np.random.default_rng(1000 * ctx.rank + len(dtype))
            for n in SIZES:
                v = rng.integers(-10**6, 10**6, n).astype(dtype) if dtype == "int64" else \
                    rng.standard_normal(n).astype(dtype)
                if n < ctx.world and via == "ring":
                    continue
                r = op.allreduce(v)
                out.append([via, dtype, n, hashlib.sha1(r.tobytes()).hexdigest(), float(r[0]), float(r.sum())])
        op.close()
    print("HIER " + json.dumps({"rank": ctx.rank, "host": socket.gethostname(), "results": out,
                                "algos": sorted(set(used))}), flush=True)
