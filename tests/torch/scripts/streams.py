"""Process groups run on streams of their own: ranks that submit to two groups in different orders, and a
recv posted before a collective whose peer sends only after it, complete (one shared stream deadlocked).
Prints OK/BAD lines."""

import torch
import torch.distributed as dist

import twisternet.torch as tt

tt.init_process_group(timeout=60)
r, n = dist.get_rank(), dist.get_world_size()
g1 = dist.new_group(list(range(n)), backend="twisternet")
g2 = dist.new_group(list(range(n)), backend="twisternet")


def check(name, ok):
    print(f"{'OK' if ok else 'BAD'} {name} rank={r}", flush=True)


# rank 0 submits to g1 first, the others to g2 first; each waits for its first call before the second
a = torch.full((1000,), float(r + 1))
b = torch.full((1000,), float(10 * (r + 1)))
first, second = ((g1, a), (g2, b)) if r == 0 else ((g2, b), (g1, a))
w1 = dist.all_reduce(first[1], group=first[0], async_op=True)
w2 = dist.all_reduce(second[1], group=second[0], async_op=True)
w1.wait()
w2.wait()
total = n * (n + 1) / 2
check("two groups in different orders", bool((a == total).all()) and bool((b == 10 * total).all()))

# many calls in flight on one group keep their order and values
ts = [torch.full((5000 + i,), float(r + i)) for i in range(8)]
works = [dist.all_reduce(t, async_op=True) for t in ts]
for w in works:
    w.wait()
check("eight in flight", all(bool((t == sum(j + i for j in range(n))).all()) for i, t in enumerate(ts)))

# a recv posted before a collective, its sender sends only after that collective
if r == 0:
    got = torch.zeros(3)
    rw = dist.irecv(got, src=1)
    c = torch.ones(4)
    dist.all_reduce(c)
    rw.wait()
    check("recv before a collective", got.tolist() == [7.0, 8.0, 9.0] and bool((c == n).all()))
elif r == 1:
    c = torch.ones(4)
    dist.all_reduce(c)
    dist.send(torch.tensor([7.0, 8.0, 9.0]), dst=0)
    check("recv before a collective", bool((c == n).all()))
else:
    c = torch.ones(4)
    dist.all_reduce(c)
    check("recv before a collective", bool((c == n).all()))
dist.barrier()
print(f"DONE rank={r}", flush=True)
dist.destroy_process_group()
