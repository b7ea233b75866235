"""Data-parallel training: every worker computes a gradient on its shard, AllReduce averages them.

    twisternet run -n 4 examples/gradient_average.py [--steps N] [--features F] [--via auto|tree|ring|doubling|innet]

Least-squares linear regression on synthetic data (a deterministic weight vector plus noise). Each
step every worker computes the gradient of the loss on its own shard and calls
``AllReduce.allreduce(grad)`` (sum; large arrays use the ring algorithm; ``--via innet`` aggregates in
an ATP software switch that the job starts for itself, as ATP does for training), divides by the number of
workers and takes the same gradient step, so all replicas keep identical weights. Prints the loss and
the time per step; checks at the end that every worker holds the same weights.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import twisternet as tn
from collectives import AllReduce


def shard(rank: int, rows: int, features: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This worker's rows of the synthetic data set, and the true weights (same everywhere)."""
    w_true = np.random.default_rng(seed).normal(size=features).astype(np.float32)
    rng = np.random.default_rng([seed, rank + 1])
    x = rng.normal(size=(rows, features)).astype(np.float32)
    y = x @ w_true + 0.01 * rng.normal(size=rows).astype(np.float32)
    return x, y, w_true


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rows", type=int, default=256, help="rows per worker")
    ap.add_argument("--features", type=int, default=50_000, help="model size (float32 parameters)")
    ap.add_argument("--lr", type=float, default=None, help="step size (default: 1/L for this data)")
    ap.add_argument("--via", default="auto", choices=["auto", "tree", "ring", "doubling", "innet"])
    args = ap.parse_args(argv)

    with tn.init() as ctx:
        x, y, _ = shard(ctx.rank, args.rows, args.features)
        w = np.zeros(args.features, np.float32)
        grads = AllReduce(ctx, edge=2, op="sum", via=args.via)
        checks = AllReduce(ctx, edge=3, op="max")
        n_total = args.rows * ctx.world
        # 1/L, L the Lipschitz constant of the mean-squared-error gradient for Gaussian data
        lr = args.lr if args.lr is not None else 1.0 / (2.0 * (1.0 + np.sqrt(args.features / n_total)) ** 2)
        t0 = time.perf_counter()
        loss = first_loss = float("nan")
        for step in range(args.steps):
            err = x @ w - y
            loss_local = np.array([float(err @ err), len(y)], np.float64)
            grad = (x.T @ err) * (2.0 / len(y))            # gradient of this shard's mean squared error
            total = grads.allreduce(grad.astype(np.float32))
            sums = grads.allreduce(loss_local)
            w -= np.float32(lr) * total / np.float32(ctx.world)  # the average gradient, same on every replica
            loss = sums[0] / sums[1]
            first_loss = loss if step == 0 else first_loss
            if ctx.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss:.6f}  "
                      f"{(time.perf_counter() - t0) / (step + 1) * 1000:.1f} ms/step", flush=True)
        # every replica must hold the same weights: compare the max and min of a checksum
        digest = np.array([float(np.sum(w, dtype=np.float64)), -float(np.sum(w, dtype=np.float64))])
        spread = checks.allreduce(digest)
        same = bool(spread[0] == -spread[1])
        result = {"loss": float(loss), "first_loss": float(first_loss), "same_weights": same}
        if ctx.rank == 0:
            print(f"{args.steps} steps of {args.features} parameters on {ctx.world} workers in "
                  f"{time.perf_counter() - t0:.2f} s; replicas identical: {same}")
        grads.close()
        checks.close()
        return result


if __name__ == "__main__":
    main()
