"""float32 allreduce: twisternet (TCP/UDS channel, and MPI channel) vs mpi4py Allreduce (MPICH) and
torch.distributed gloo, all measured in the same run.

    python benchmarks/allreduce.py [--workers 2,4] [--sizes 1K,1M,64M] [--repeat 3] [--quick]

Each figure is the median over ``--repeat`` job launches of the per-call median time on rank 0.
A peer that is not installed (torch, mpi4py) is skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (ROOT, fmt_size, job_env, median, mpiexec_run, run_tagged, table,  # noqa: E402
                               twisternet_run)
from benchmarks.p2p import parse_sizes  # noqa: E402


def reps_for(size: int) -> int:
    return 200 if size <= 64 << 10 else 20 if size <= 4 << 20 else 5


def gloo(n: int, sizes: list[int], reps: list[int]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "benchmarks/_allreduce_gloo.py"), str(r), str(n),
                               str(port), ",".join(map(str, sizes)), ",".join(map(str, reps))],
                              env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    outs = [p.communicate(timeout=900) for p in procs]
    for out, _ in outs:
        for line in out.splitlines():
            if line.startswith("ALLREDUCE "):
                return json.loads(line[10:])
    raise RuntimeError("gloo run printed nothing:\n" + "\n".join(e[-1500:] for _, e in outs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1K,1M,64M"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    workers = [int(w) for w in a.workers.split(",")]
    sizes, repeat = a.sizes, a.repeat
    if a.quick:
        sizes, repeat, workers = parse_sizes("1K,1M"), 1, [2]
    reps = [reps_for(s) for s in sizes]
    have_torch = importlib.util.find_spec("torch") is not None
    have_mpi = importlib.util.find_spec("mpi4py") is not None and mpiexec_run(2, "x") is not None
    if not have_torch:
        print("[allreduce] skipping gloo: torch is not installed (pip install torch)", file=sys.stderr)
    if not have_mpi:
        print("[allreduce] skipping MPI columns: mpi4py/mpiexec missing (pip install '.[mpi]')", file=sys.stderr)
    args = [",".join(map(str, sizes)), ",".join(map(str, reps))]
    results: dict = {}
    for n in workers:
        for rep in range(repeat):
            runs = {"twisternet-tcp": lambda: run_tagged(twisternet_run(n, "benchmarks/_allreduce_worker.py", *args),
                                                         "ALLREDUCE")}
            if have_mpi:
                runs["twisternet-mpi"] = lambda: run_tagged(
                    mpiexec_run(n, "benchmarks/_allreduce_worker.py", *args), "ALLREDUCE")
                runs["mpi4py"] = lambda: run_tagged(mpiexec_run(n, "benchmarks/_allreduce_mpi4py.py", *args),
                                                    "ALLREDUCE")
            if have_torch:
                runs["gloo"] = lambda: gloo(n, sizes, reps)
            for name, fn in runs.items():
                print(f"[allreduce] {n} workers, run {rep + 1}/{repeat}: {name} ...", file=sys.stderr, flush=True)
                try:
                    r = fn()
                except Exception as e:  # noqa: BLE001 - report and go on with the other peers
                    print(f"[allreduce] {name} failed: {e}", file=sys.stderr)
                    continue
                results.setdefault(n, {}).setdefault(name, []).append({int(k): v for k, v in r["median_s"].items()})
    names = ["twisternet-tcp", "twisternet-mpi", "mpi4py", "gloo"]
    for n, by in results.items():
        med = {name: {s: median([r[s] for r in runs]) for s in sizes} for name, runs in by.items()}
        rows = []
        for s in sizes:
            row = [fmt_size(s)] + [f"{med[k][s] * 1e3:.3f}" if k in med else "n/a" for k in names]
            t, m, g = med.get("twisternet-tcp", {}).get(s), med.get("mpi4py", {}).get(s), med.get("gloo", {}).get(s)
            tm = med.get("twisternet-mpi", {}).get(s)
            row += [f"{t / m:.2f}" if t and m else "n/a", f"{tm / m:.2f}" if tm and m else "n/a",
                    f"{t / g:.2f}" if t and g else "n/a"]
            rows.append(row)
        print(f"\nallreduce, {n} workers: median ms per call (median of {repeat} launches); ratios are times")
        print(table(["size", "tn TCP/UDS", "tn MPI", "mpi4py", "gloo", "tnTCP/mpi4py", "tnMPI/mpi4py",
                     "tnTCP/gloo"], rows))
        results[n] = {"median_s": med}
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
