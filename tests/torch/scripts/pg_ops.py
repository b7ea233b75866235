"""Every collective of the twisternet torch backend, checked against the expected values on each rank."""

import sys

import torch
import torch.distributed as dist

import twisternet.torch as tt

tt.init_process_group(via=sys.argv[1] if len(sys.argv) > 1 else None)
r, n = dist.get_rank(), dist.get_world_size()
total = n * (n + 1) / 2


def say(line):
    # one write per line, newline included: the job's stdout is unbuffered (PYTHONUNBUFFERED), where
    # print writes the text and its newline apart, and another rank's line can land in between (rank
    # 0's local "ERR op" line glued to rank 1's "ERR shape" line, which the test then missed)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def check(name, ok):
    say(f"{'OK' if ok else 'BAD'} {name} rank={r}")


for op, want in [(dist.ReduceOp.SUM, total), (dist.ReduceOp.AVG, total / n), (dist.ReduceOp.MIN, 1.0),
                 (dist.ReduceOp.MAX, float(n)), (dist.ReduceOp.PRODUCT, float(torch.arange(1, n + 1).prod()))]:
    t = torch.full((1000,), float(r + 1))
    dist.all_reduce(t, op=op)
    check(f"all_reduce {op}", bool((t == want).all()))
t = torch.full((3,), float(r))
dist.broadcast(t, src=n - 1)
check("broadcast", t.tolist() == [float(n - 1)] * 3)
outs = [torch.zeros(2) for _ in range(n)]
dist.all_gather(outs, torch.full((2,), float(r)))
check("all_gather", [o.tolist() for o in outs] == [[float(i)] * 2 for i in range(n)])
o = torch.zeros(2 * n)
dist.all_gather_into_tensor(o, torch.full((2,), float(r)))
check("all_gather_into_tensor", o.tolist() == [float(i // 2) for i in range(2 * n)])
o = torch.zeros(2)
dist.reduce_scatter_tensor(o, torch.arange(2.0 * n) + r)
check("reduce_scatter_tensor", o.tolist() == [n * (2 * r + k) + total - n for k in range(2)])
o = torch.zeros(1)
dist.reduce_scatter(o, [torch.full((1,), float(r * 10 + j)) for j in range(n)])
check("reduce_scatter", o.item() == sum(i * 10 + r for i in range(n)))
t = torch.full((2,), float(r + 1))
dist.reduce(t, dst=0)
check("reduce", r != 0 or t.tolist() == [total] * 2)
g = [torch.zeros(1) for _ in range(n)] if r == 0 else None
dist.gather(torch.full((1,), float(r)), g, dst=0)
check("gather", r != 0 or [x.item() for x in g] == [float(i) for i in range(n)])
o = torch.zeros(1)
dist.scatter(o, [torch.full((1,), float(i * 10)) for i in range(n)] if r == 0 else None, src=0)
check("scatter", o.item() == r * 10)
outs = [torch.zeros(1) for _ in range(n)]
dist.all_to_all(outs, [torch.full((1,), float(r * 10 + j)) for j in range(n)])
check("all_to_all", [x.item() for x in outs] == [float(i * 10 + r) for i in range(n)])
o = torch.zeros(n)
dist.all_to_all_single(o, torch.arange(float(n)) + 10 * r)
check("all_to_all_single", o.tolist() == [float(r + 10 * i) for i in range(n)])
dist.barrier()
x = torch.zeros(3)
if r == 0:
    dist.send(torch.arange(3.0), dst=1)
elif r == 1:
    dist.recv(x, src=0)
check("send_recv", r != 1 or x.tolist() == [0.0, 1.0, 2.0])
sub = dist.new_group([0, n - 1])          # a subgroup: its own edge stream, group ranks mapped
if r in (0, n - 1):
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t, group=sub)
    b = torch.full((2,), float(r))
    dist.broadcast(b, group_src=1, group=sub)
    check("subgroup", t.tolist() == [float(n + 1)] * 2 and b.tolist() == [float(n - 1)] * 2)
else:
    check("subgroup", True)
works = [dist.all_reduce(torch.full((10,), float(i)), async_op=True) for i in range(4)]
for w in works:
    w.wait()
check("async", all(w.is_completed() for w in works))
# bad input on one rank: every rank raises
try:
    dist.all_reduce(torch.ones(3, device="meta") if r == 1 else torch.ones(3))
    check("meta_error", False)
except Exception as e:  # noqa: BLE001
    say(f"ERR meta rank={r} {type(e).__name__}: {e}")
try:
    dist.all_reduce(torch.ones(3 + r))
    check("shape_error", False)
except Exception as e:  # noqa: BLE001
    say(f"ERR shape rank={r} {type(e).__name__}: {e}")
try:
    dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.BAND)
    check("op_error", False)
except Exception as e:  # noqa: BLE001
    say(f"ERR op rank={r} {type(e).__name__}: {e}")
t = torch.full((4,), float(r + 1))
dist.all_reduce(t)
check("after_errors", bool((t == total).all()))
dist.destroy_process_group()
say(f"DONE rank={r}")
