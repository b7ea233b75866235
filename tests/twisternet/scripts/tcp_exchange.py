"""Every rank sends every other rank a deterministic mix of values; receivers check each one."""

import hashlib
import sys

import numpy as np

import twisternet as tn

MAX_MB = int(sys.argv[1]) if len(sys.argv) > 1 else 16
COUNT = int(sys.argv[2]) if len(sys.argv) > 2 else 400


def value(src: int, dst: int, i: int):
    rng = np.random.default_rng(src * 1_000_003 + dst * 1009 + i)
    kind = i % 6
    if kind == 0:
        return rng.bytes(int(rng.integers(0, 5000)))
    if kind == 1:
        return "ü" * int(rng.integers(0, 3000)) + str(i)
    if kind == 2:
        return {"i": i, "src": src, "nested": [1.5, None, (src, dst)], "b": rng.bytes(10)}
    if kind == 3:
        return rng.standard_normal(int(rng.integers(1, 50_000))).astype(np.float32)
    if kind == 4:
        return [i] * int(rng.integers(0, 100))
    # a few large arrays, up to MAX_MB
    n = (MAX_MB << 20) // 8 if i % 60 == 5 else int(rng.integers(1, 300_000))
    return np.arange(n, dtype=np.int64) * (src + 1)


def same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


with tn.init() as ctx:
    got: dict[int, list] = {r: [] for r in range(ctx.world)}
    bad: list[str] = []

    def handle(src, obj):
        i = len(got[src])
        if not same(value(src, ctx.rank, i), obj):
            bad.append(f"from {src} #{i}")
        raw = obj.tobytes() if isinstance(obj, np.ndarray) else repr(obj).encode()
        got[src].append(hashlib.md5(raw).hexdigest()[:4])
        return True

    ctx.register(11, handle)
    for i in range(COUNT):
        for d in range(ctx.world):
            if d != ctx.rank:
                ctx.send(d, 11, value(ctx.rank, d, i))
    ctx.flush()
    ctx.wait_until(lambda: all(len(got[s]) == COUNT for s in range(ctx.world) if s != ctx.rank), timeout=120)
    kinds = {r: p.kind for r, p in ctx.channel._peers.items()} if hasattr(ctx.channel, "_peers") else {}
    print(f"RESULT rank={ctx.rank} bad={len(bad)} received={sum(len(v) for v in got.values())} "
          f"links={','.join(sorted(set(kinds.values())))}", flush=True)
    if bad:
        print("BAD", bad[:10], flush=True)
