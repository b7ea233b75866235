"""Peer of benchmarks/allreduce.py: ``ray.util.collective`` allreduce on its gloo backend.

Run as ``python _allreduce_ray.py WORLD SIZES REPS``: starts a private local Ray instance with WORLD
actors (one CPU each), forms a gloo collective group and times ``col.allreduce`` on float32 torch
tensors in every actor; prints one ``ALLREDUCE {json}`` line with rank 0's per-size median seconds.
"""

import json
import sys


def main() -> None:
    import ray
    import ray.util.collective as col

    world = int(sys.argv[1])
    sizes = [int(x) for x in sys.argv[2].split(",")]
    reps = [int(x) for x in sys.argv[3].split(",")]

    @ray.remote(num_cpus=1)
    class Worker:
        def setup(self, rank: int) -> bool:
            import torch
            torch.set_num_threads(1)
            col.init_collective_group(world, rank, backend="gloo", group_name="bench")
            self.rank = rank
            return True

        def run(self) -> dict:
            import time

            import torch
            out = {}
            for size, n in zip(sizes, reps):
                x = torch.ones(size // 4, dtype=torch.float32)
                col.allreduce(x, group_name="bench")          # warm-up
                if float(x[0]) != world:
                    raise AssertionError(f"ray allreduce gave {float(x[0])}, expected {world}")
                times = []
                for _ in range(n):
                    x.fill_(1.0)
                    col.barrier(group_name="bench")
                    t = time.perf_counter()
                    col.allreduce(x, group_name="bench")
                    times.append(time.perf_counter() - t)
                out[size] = sorted(times)[len(times) // 2]
            return out

    ray.init(num_cpus=world, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        actors = [Worker.remote() for _ in range(world)]
        ray.get([a.setup.remote(r) for r, a in enumerate(actors)], timeout=300)
        results = ray.get([a.run.remote() for a in actors], timeout=1800)
        print("ALLREDUCE " + json.dumps({"channel": "ray-gloo", "version": ray.__version__,
                                         "median_s": results[0]}), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
