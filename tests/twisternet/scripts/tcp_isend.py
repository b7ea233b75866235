"""isend under `twisternet run`: rank 0 isends large arrays, waits on each handle, then overwrites the
array; rank 1 checks every received array holds what was sent (never the overwritten values)."""

import numpy as np

import twisternet as tn

N, SIZE = 20, 1 << 20   # float64 values: 8 MB per record, far above the zero-copy threshold

with tn.init() as ctx:
    got: list = []
    ctx.register(5, lambda src, obj: got.append(np.array(obj, copy=True)) or True)
    if ctx.rank == 0:
        buf = np.empty(SIZE, np.float64)
        small = ctx.isend(1, 5, np.arange(4.0))
        assert small.done        # copied into a send buffer: done at once
        for i in range(N):
            buf[:] = i
            h = ctx.isend(1, 5, buf)
            h.wait()
            assert h.done
            buf[:] = -1.0        # after wait() the memory is ours again
        print("SENT", N + 1, flush=True)
    else:
        ctx.wait_until(lambda: len(got) == N + 1, timeout=120)
        ok = np.array_equal(got[0], np.arange(4.0)) and all(
            g.shape == (SIZE,) and (g == i).all() for i, g in enumerate(got[1:]))
        print(f"RESULT ok={ok} received={len(got)}", flush=True)
