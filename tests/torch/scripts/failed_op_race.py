"""A rank that learns of another rank's failure before it submits that same call: its call fails with that
error, on the same operation, and the next call is on the same edge everywhere (it used to run its call on
a fresh operation, a call ahead of the others, and the next call mismatched or hung). Prints OK/BAD lines."""

import numpy as np

import twisternet as tn
from twisternet import functional as F
from twisternet.errors import TwisternetError

ctx = tn.init()
r, n = ctx.rank, ctx.world


def check(name, ok):
    print(f"{'OK' if ok else 'BAD'} {name} rank={r}", flush=True)


F.all_reduce(np.ones(3))                                       # the cached operation exists on every rank
op = F._state(ctx).allreduce_ops[("sum", "auto")]
if r == 0:   # wait until rank 1's failure has reached this rank, then make the same call
    ctx.wait_until(lambda: op._error is not None, timeout=120)
try:
    F.all_reduce(np.ones(3), out=np.ones(4) if r == 1 else None, timeout=120)
    check("bad call fails", False)
except (TwisternetError, ValueError) as e:
    check("bad call fails", r == 1 or "rank 1" in str(e))
got = F.all_reduce(np.full(4, float(r + 1)), timeout=120)
check("next call", np.array_equal(got, np.full(4, n * (n + 1) / 2)))
print(f"DONE rank={r}", flush=True)
ctx.close()
