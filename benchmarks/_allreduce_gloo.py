"""Peer of benchmarks/allreduce.py: torch.distributed all_reduce on the gloo backend.

Run as ``python _allreduce_gloo.py RANK WORLD PORT SIZES REPS`` once per rank."""

import json
import sys
import time


def main() -> None:
    import torch
    import torch.distributed as dist
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    sizes = [int(x) for x in sys.argv[4].split(",")]
    reps = [int(x) for x in sys.argv[5].split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for size, n in zip(sizes, reps):
        x = torch.ones(size // 4, dtype=torch.float32)
        dist.all_reduce(x)
        times = []
        for _ in range(n):
            x.fill_(1.0)
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t)
        out[size] = sorted(times)[len(times) // 2]
    if rank == 0:
        print("ALLREDUCE " + json.dumps({"channel": "gloo", "median_s": out}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
