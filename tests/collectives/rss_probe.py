"""Subprocess body of the RSS-bound test: a one-process batch KeyedGather of far more data than the bound.

Prints JSON: peak RSS growth while sending and reading, bytes of payload, whether the output was sorted.
"""

from __future__ import annotations

import json
import resource
import sys


def peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> None:
    n, pad, memory, spill_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import numpy as np

    import twisternet as tn
    from collectives import KeyedGather
    with tn.init(memory_limit=memory, spill_dir=spill_dir) as ctx:
        op = KeyedGather(ctx, None, None, 1, key_type="int", group=False)
        base = peak_kib()
        rng = np.random.default_rng(5)
        payload = 0
        for block in range(0, n, 10_000):
            for k in rng.integers(0, 1 << 40, size=min(10_000, n - block)).tolist():
                v = f"{k:x}".ljust(pad, "*")
                payload += len(v)
                op.send(0, k, v)
        op.finish(0)
        prev, count, ordered = -1, 0, True
        for k, _v in op.results():
            ordered = ordered and k >= prev
            prev = k
            count += 1
        op.close()
        print(json.dumps({"growth_kib": peak_kib() - base, "payload": payload, "count": count,
                          "ordered": ordered}))


if __name__ == "__main__":
    main()
