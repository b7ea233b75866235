"""A 3 GiB bytes object goes to rank 1 and back, checked by hash (64-bit lengths end to end)."""

import hashlib
import sys

import twisternet as tn

SIZE = int(float(sys.argv[1]) * (1 << 30)) if len(sys.argv) > 1 else 3 << 30

with tn.init(timeout=900) as ctx:
    got = []
    ctx.register(1, lambda s, o: got.append(o) or True)
    if ctx.rank == 0:
        blob = bytes(range(256)) * (SIZE // 256) + b"z" * (SIZE % 256)
        want = hashlib.sha256(blob).hexdigest()
        ctx.send(1, 1, blob)
        del blob
        ctx.wait_until(lambda: got, timeout=900)
        back = got.pop()
        print(f"HUGE size={len(back)} same={hashlib.sha256(back).hexdigest() == want}", flush=True)
    else:
        ctx.wait_until(lambda: got, timeout=900)
        ctx.send(0, 1, got.pop())
