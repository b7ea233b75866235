"""In-place all_reduce through shared memory, split rounds included: bit-identical to the sum in rank order
on every rank, for numpy arrays (small slots: many rounds, a partial last one) and torch tensors (the
functional layer's slots). Prints OK/BAD lines."""

import sys

import numpy as np

import twisternet as tn
from collectives import AllReduce
from collectives.allreduce.shm import DIRECT_BYTES
from twisternet import functional as F

ctx = tn.init()
r, n = ctx.rank, ctx.world


def check(name, ok):
    print(f"{'OK' if ok else 'BAD'} {name} rank={r}", flush=True)


def values(rank, size, salt):
    return np.random.default_rng(1000 * salt + rank).standard_normal(size).astype(np.float32)


def reference(size, salt):
    acc = values(0, size, salt).copy()
    for j in range(1, n):
        acc = acc + values(j, size, salt)      # the order every rank combines in: rank 0, 1, 2, ...
    return acc


# small slots: 4 * DIRECT_BYTES each, so rounds split among the ranks; 300_001 floats: 5 rounds, the last partial
op = AllReduce(ctx, edge=77, op="sum", via="shm", shm_chunk_bytes=4 * DIRECT_BYTES)
for salt, size in enumerate((300_001, 1, 4 * DIRECT_BYTES // 4 + 3, 7 * n)):
    x = values(r, size, salt)
    got = op.allreduce(x, out=x)
    check(f"numpy in place size={size}", got is x and np.array_equal(x, reference(size, salt)))
    y = values(r, size, salt)
    z = op.allreduce(y)
    check(f"numpy out of place size={size}", np.array_equal(z, reference(size, salt))
          and np.array_equal(y, values(r, size, salt)))      # the input is left as it was
check("shm path used", op._rank_allreduce.shm is not None)
op.close()

try:
    import torch
except ImportError:
    torch = None
if torch is not None and "--torch" in sys.argv:
    size = (F.shm_slot_bytes(n) // 4) * 2 + 12_345      # the functional layer's slots: 3 rounds
    t = torch.from_numpy(values(r, size, 9))
    F.all_reduce(t, out=t)
    check("tensor in place", np.array_equal(t.numpy(), reference(size, 9)))
    arop = F._state(ctx).allreduce_ops[("sum", "auto")]
    check("functional slots", arop.shm_chunk_bytes == F.shm_slot_bytes(n) and arop._rank_allreduce.shm is not None)
print(f"DONE rank={r}", flush=True)
ctx.close()
