"""Data-parallel training with torch DistributedDataParallel over the twisternet backend (or gloo).

A small MLP (or, with ``--width``, a larger one) learns a synthetic regression task; each rank draws its
own batches (seeded by rank and step), DDP averages the gradients. Runs under any of::

    twisternet run -n 4 examples/ddp_train.py --backend twisternet
    torchrun --nproc-per-node 4 examples/ddp_train.py --backend twisternet
    mpiexec -n 4 python examples/ddp_train.py --backend gloo --via auto

``--via`` picks twisternet's allreduce algorithm (auto, shm, ring, tree, innet); ``--hook`` keeps a gloo
process group and averages the gradients through ``twisternet.torch.allreduce_hook`` instead.
``--save DIR`` writes each rank's final parameters to ``DIR/params-<backend>-<rank>.npy``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import twisternet.torch as tt


def make_model(inputs: int, width: int, depth: int, seed: int) -> nn.Module:
    """The same initial model on every rank (DDP also broadcasts rank 0's at start)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    d = inputs
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, 1))
    return nn.Sequential(*layers)


def batch(rank: int, step: int, size: int, inputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: x ~ N(0, 1), y = sum(sin(x)) (same on every run)."""
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.randn(size, inputs, generator=g)
    return x, torch.sin(x).sum(dim=1, keepdim=True)


def init(backend: str, via: str, hook: bool) -> None:
    # the plain init_process_group under torchrun; under twisternet run and mpiexec, tn.init() first
    tt.init_process_group("gloo" if hook else backend, via=via)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("twisternet", "gloo"), default="twisternet")
    p.add_argument("--via", choices=("auto", "shm", "ring", "doubling", "tree", "innet"), default="auto")
    p.add_argument("--hook", action="store_true", help="gloo process group + twisternet.torch.allreduce_hook")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, help="directory for each rank's final parameters")
    p.add_argument("--warmup", type=int, default=0, help="steps left out of the timing")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    init(args.backend, args.via, args.hook)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(args.inputs, args.width, args.depth, args.seed)
    ddp = DDP(model)
    if args.hook:
        ddp.register_comm_hook(state={"via": args.via}, hook=tt.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()
    params = sum(q.numel() for q in model.parameters())
    loss = torch.zeros(())
    start = time.perf_counter()
    for step in range(args.steps):
        if step == args.warmup:
            start = time.perf_counter()
        x, y = batch(rank, step, args.batch, args.inputs)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
    took = time.perf_counter() - start
    timed = max(1, args.steps - args.warmup)
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).numpy()
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        name = "hook" if args.hook else args.backend
        np.save(os.path.join(args.save, f"params-{name}-{rank}.npy"), flat)
    via = args.via if args.backend == "twisternet" or args.hook else "-"
    print(f"DDP rank={rank} world={world} backend={dist.get_backend()} via={via} hook={args.hook} params={params} "
          f"steps={args.steps} loss={loss.item():.6f} step_ms={1000 * took / timed:.2f} "
          f"checksum={float(np.float64(flat.astype(np.float64).sum())):.9e}", flush=True)
    dist.destroy_process_group()
    return {"rank": rank, "loss": loss.item(), "step_s": took / timed, "params": params}


if __name__ == "__main__":
    main()
