"""float32 allreduce: twisternet (under `twisternet run` and under mpiexec) vs mpi4py Allreduce (MPICH),
torch.distributed gloo and ray.util.collective (gloo backend), all measured in the same run.

twisternet runs twice per launcher: with ``via="auto"`` (what a user gets: on one host, shared memory)
and with ``via="ring"`` (the ring over the channel: Unix sockets under `twisternet run`, MPI messages
under mpiexec), so the transports' own figures stay visible. Under `twisternet run` it also runs the
small-message algorithms over Unix sockets, ``via="tree"`` and ``via="doubling"``, and up to
``SMALL_MAX`` bytes the raw-socket ping-pong round trip (UDS and TCP, 2 processes whatever the worker
count, :mod:`benchmarks._raw_sockets`) is measured beside them: the targets of issue 22 compare a 1 KB
allreduce with it and with gloo.

    python -m benchmarks --suite allreduce [--workers 2,4] [--repeat 3] [--quick]
                         [--set allreduce.sizes=1K,1M,64M] [--set allreduce.ray=1]
                         [--set allreduce.peers=twisternet-tcp-tree,gloo,raw-rtt-uds]
    python benchmarks/allreduce.py [--workers 2,4] [--sizes 1K,1M,64M] [--repeat 3] [--quick] [--json OUT]

Each figure is the median over ``repeat`` job launches of the per-call median time on rank 0.
A peer that cannot run here (torch, ray, mpi4py not installed) is listed as skipped with the reason.
Ray's start-up takes ~20 s, so quick runs skip it unless ``--set allreduce.ray=1``.
``allreduce.peers`` keeps only the named columns (keys of ``PEERS``); the others are listed as skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _raw_sockets as raw
from benchmarks.common import (ROOT, fmt_size, job_env, median, mpiexec_run, run_tagged,
                               twisternet_run)
from benchmarks.harness import Chart, SuiteOptions, SuiteResult, Table, Target, ratio

NAME = "allreduce"
DESCRIPTION = ("float32 allreduce 1 KB..256 MB at 2 and 4 workers: twisternet (auto: shared memory; ring over "
               "UDS and over MPI) vs mpi4py (MPICH), torch gloo, ray.util.collective gloo")

KB, MB = 1 << 10, 1 << 20
FULL_SIZES = [1 * KB, 64 * KB, 1 * MB, 16 * MB, 64 * MB, 256 * MB]
QUICK_SIZES = [1 * KB, 64 * KB]
TARGET_SIZE = 64 * MB
#: Peers in column order: (key in the results, column header).
PEERS = [("twisternet-tcp", "tn run"), ("twisternet-tcp-ring", "tn ring UDS"),
         ("twisternet-tcp-tree", "tn tree UDS"), ("twisternet-tcp-doubling", "tn doubling UDS"),
         ("twisternet-mpi", "tn mpiexec"), ("twisternet-mpi-ring", "tn ring MPI"), ("mpi4py", "mpi4py (MPICH)"),
         ("gloo", "torch gloo"), ("ray-gloo", "ray gloo"), ("raw-rtt-uds", "raw RTT UDS"),
         ("raw-rtt-tcp", "raw RTT TCP")]
#: The raw ping-pong round trip is measured for sizes up to this many bytes.
SMALL_MAX = 64 * KB
#: The size of issue 22's targets, and those targets: (variant, peer, the largest time ratio, worker counts).
SMALL_SIZE = 1 * KB
SMALL_TARGETS = [("twisternet-tcp-doubling", "raw-rtt-uds", 3.0, (2,)),
                 ("twisternet-tcp-doubling", "gloo", 1.0, (2, 4))]
#: (twisternet variant, peer, the largest acceptable time ratio): the targets of issue 8.
#: twisternet as a user gets it (via="auto") and its ring over each channel, held to the same bounds.
TARGETS = [("twisternet-tcp", "gloo", 1.0), ("twisternet-mpi", "mpi4py", 1.15), ("twisternet-tcp", "mpi4py", 1.25),
           ("twisternet-tcp-ring", "gloo", 1.0), ("twisternet-mpi-ring", "mpi4py", 1.15),
           ("twisternet-tcp-ring", "mpi4py", 1.25)]
#: Short column headers of those ratios.
RATIO_HEADS = ["tn/gloo", "tnMPI/mpi4py", "tn/mpi4py", "ringUDS/gloo", "ringMPI/mpi4py", "ringUDS/mpi4py"]


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (without importing it: torch and ray are slow to import)."""
    return importlib.util.find_spec(module) is not None


def reps_for(size: int) -> int:
    """Timed calls per launch: many for small sizes, a few for large ones."""
    return 200 if size <= 64 * KB else 20 if size <= 4 * MB else 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collect(procs: list[subprocess.Popen], what: str, timeout: float) -> dict:
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.communicate()
        raise RuntimeError(f"{what} did not finish within {timeout:.0f} s") from None
    for out, _ in outs:
        for line in out.splitlines():
            if line.startswith("ALLREDUCE "):
                return json.loads(line[len("ALLREDUCE "):])
    raise RuntimeError(f"{what} printed nothing (exit {[p.returncode for p in procs]}):\n"
                       + "\n".join(e[-1500:] for _, e in outs))


def gloo(n: int, sizes: list[int], reps: list[int], timeout: float = 900) -> dict:
    """torch.distributed gloo all_reduce, one process per rank, rendezvous on a loopback port."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "benchmarks/_allreduce_gloo.py"), str(r), str(n),
                               str(port), ",".join(map(str, sizes)), ",".join(map(str, reps))],
                              env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    return _collect(procs, "the gloo run", timeout)


def ray_gloo(n: int, sizes: list[int], reps: list[int], timeout: float = 900) -> dict:
    """ray.util.collective allreduce (gloo backend) among n Ray actors of a private local Ray instance."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks/_allreduce_ray.py"), str(n),
                             ",".join(map(str, sizes)), ",".join(map(str, reps))],
                            env=job_env(RAY_DISABLE_USAGE_STATS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    return _collect([proc], "the ray run", timeout)


def _ray_reason(opts: SuiteOptions) -> str | None:
    """Why the ray peer does not run here, or None when it does."""
    if not installed("ray"):
        return "ray gloo: ray is not installed (pip install ray; its gloo backend also needs torch)"
    if not installed("torch"):
        return "ray gloo: ray.util.collective's gloo backend runs on torch.distributed, and torch is not installed"
    if opts.quick and not opts.get("ray", False):
        return "ray gloo: left out of quick runs (Ray's start-up takes ~20 s); --set allreduce.ray=1 to include"
    if not opts.get("ray", True):
        return "ray gloo: disabled with --set allreduce.ray=0"
    return None


def run(opts: SuiteOptions) -> SuiteResult:  # noqa: C901 - one report step after another
    """Every peer at every worker count and size; tables, charts and the issue's 64 MB targets."""
    t0 = time.monotonic()
    sizes = sorted(opts.get("sizes", QUICK_SIZES if opts.quick else FULL_SIZES))
    workers = sorted(set(opts.workers))
    repeat = opts.repeats()
    reps = [reps_for(s) for s in sizes]
    res = SuiteResult(suite=NAME, description=DESCRIPTION)
    have_mpi = installed("mpi4py") and mpiexec_run(2, "x") is not None
    have_torch = installed("torch")
    if not have_mpi:
        res.skipped.append("twisternet MPI channel and mpi4py (MPICH): mpi4py/mpiexec missing (pip install '.[mpi]')")
    if not have_torch:
        res.skipped.append("torch gloo: torch is not installed (pip install torch)")
    ray_reason = _ray_reason(opts)
    if ray_reason:
        res.skipped.append(ray_reason)
    args = [",".join(map(str, sizes)), ",".join(map(str, reps))]
    vias: dict[int, dict[str, str]] = {}     # what via="auto" chose, per worker count and launcher
    only: set[str] | None = set(opts.get("peers", [""])) if "peers" in opts.extra else None
    if only is not None:
        unknown = only - {k for k, _ in PEERS}
        if unknown:
            raise ValueError(f"--set allreduce.peers: unknown {sorted(unknown)}; known: {[k for k, _ in PEERS]}")
        res.skipped.append(f"left out on request (allreduce.peers): {[k for k, _ in PEERS if k not in only]}")

    def peers(n: int) -> dict[str, Callable[[], dict]]:
        def tn(launch: Callable[..., Any], via: str) -> Callable[[], dict]:
            def go() -> dict:
                r = run_tagged(launch(n, "benchmarks/_allreduce_worker.py", *args, via), "ALLREDUCE")
                vias.setdefault(n, {})[f"{launch is mpiexec_run}-{via}"] = r.get("via", via)
                return r
            return go
        p: dict[str, Callable[[], dict]] = {"twisternet-tcp": tn(twisternet_run, "auto"),
                                            "twisternet-tcp-ring": tn(twisternet_run, "ring"),
                                            "twisternet-tcp-tree": tn(twisternet_run, "tree"),
                                            "twisternet-tcp-doubling": tn(twisternet_run, "doubling")}
        if have_mpi:
            p["twisternet-mpi"] = tn(mpiexec_run, "auto")
            p["twisternet-mpi-ring"] = tn(mpiexec_run, "ring")
            p["mpi4py"] = lambda: run_tagged(mpiexec_run(n, "benchmarks/_allreduce_mpi4py.py", *args), "ALLREDUCE")
        if have_torch:
            p["gloo"] = lambda: gloo(n, sizes, reps)
        if ray_reason is None:
            p["ray-gloo"] = lambda: ray_gloo(n, sizes, reps)
        small = [s for s in sizes if s <= SMALL_MAX]
        if small:
            for kind in ("uds", "tcp"):
                p[f"raw-rtt-{kind}"] = lambda kind=kind: {"median_s": {s: 2 * raw.latency(kind, s) for s in small}}
        return {k: v for k, v in p.items() if only is None or k in only}

    bar = opts.bar(NAME)
    bar.set_total(sum(len(peers(n)) for n in workers) * repeat)
    samples: dict[int, dict[str, list[dict[int, float]]]] = {}
    failures: dict[str, str] = {}
    for n in workers:
        for rep in range(repeat):
            for name, fn in peers(n).items():
                bar.step(f"{n} workers, run {rep + 1}/{repeat}: {name}")
                try:
                    r = fn()
                except Exception as e:  # noqa: BLE001 - a peer failing is reported, the others go on
                    failures.setdefault(name, f"{type(e).__name__}: {str(e).strip()[:500]}")
                    continue
                samples.setdefault(n, {}).setdefault(name, []).append(
                    {int(k): float(v) for k, v in r["median_s"].items()})
    for name, why in failures.items():
        res.skipped.append(f"{name}: failed in this run: {why}")
    med: dict[int, dict[str, dict[int, float]]] = {
        n: {name: {s: median([r[s] for r in runs]) for s in sizes if all(s in r for r in runs)}
            for name, runs in by.items()}
        for n, by in samples.items()}

    present = [(k, h) for k, h in PEERS if any(k in med.get(n, {}) for n in workers)]
    for n in workers:
        m = med.get(n, {})
        rows: list[list[Any]] = []
        for s in sizes:
            get = lambda k, m=m, s=s: m.get(k, {}).get(s)  # noqa: E731
            rows.append([fmt_size(s), *(None if get(k) is None else get(k) * 1e3 for k, _ in present),
                         *(ratio(get(a), get(b)) for a, b, _ in TARGETS)])
        res.tables.append(Table(
            f"allreduce, {n} workers: ms per call (median of {repeat} launches)",
            ["size", *(h for _, h in present), *RATIO_HEADS], rows,
            note="ratios are times (below 1: twisternet faster); n/a: peer not measured; 'tn run' / 'tn "
                 "mpiexec' are twisternet with via='auto' under each launcher (here: "
                 f"{', '.join(sorted({v for k, v in vias.get(n, {}).items() if k.endswith('-auto')})) or 'n/a'}), "
                 "'tn ring' its ring over the channel"))
        res.charts.append(Chart(f"time_vs_size_{n}w", f"allreduce time vs size, {n} workers",
                                "message size (bytes)", "ms per call",
                                {h: [(s, m[k][s] * 1e3) for s in sizes if s in m[k]] for k, h in present if k in m},
                                logx=True, logy=True))
    tsize = TARGET_SIZE if TARGET_SIZE in sizes else None
    if tsize is not None and len(workers) > 1:
        res.charts.append(Chart("time_vs_workers_64M", "allreduce 64 MB: time vs workers", "workers",
                                "ms per call", {h: [(n, med[n][k][tsize] * 1e3) for n in workers
                                                    if tsize in med.get(n, {}).get(k, {})] for k, h in present}))
    labels = dict(PEERS)
    for n in workers:
        for a, b, limit in TARGETS:
            name = f"allreduce 64 MB, {n} workers: {labels[a]} vs {labels[b]}"
            wanted = "at least as fast as" if limit == 1.0 else f"within {limit:.2f}x of"
            wanted = f"{labels[a]} {wanted} {labels[b]} (time ratio <= {limit:.2f})"
            if tsize is None:
                res.targets.append(Target(name, wanted, "not measured (64 MB not in this run's sizes)", None))
                continue
            ta, tb = med.get(n, {}).get(a, {}).get(tsize), med.get(n, {}).get(b, {}).get(tsize)
            q = ratio(ta, tb)
            if q is None:
                missing = labels[a] if ta is None else labels[b]
                res.targets.append(Target(name, wanted, f"not measured ({missing} did not run)", None))
            else:
                res.targets.append(Target(name, wanted, f"{q:.2f}x ({ta * 1e3:.1f} ms vs {tb * 1e3:.1f} ms)",
                                          q <= limit))
    for a, b, limit, counts in SMALL_TARGETS:
        for n in counts:
            if n not in workers:
                continue
            name = f"allreduce 1 KB, {n} workers: {labels[a]} vs {labels[b]}"
            wanted = f"{labels[a]} within {limit:.1f}x of {labels[b]}" if limit != 1.0 else \
                f"{labels[a]} faster than {labels[b]}"
            ta, tb = med.get(n, {}).get(a, {}).get(SMALL_SIZE), med.get(n, {}).get(b, {}).get(SMALL_SIZE)
            q = ratio(ta, tb)
            if q is None:
                res.targets.append(Target(name, wanted, "not measured (1 KB or a peer not in this run)", None))
            else:
                res.targets.append(Target(name, wanted, f"{q:.2f}x ({ta * 1e6:.0f} µs vs {tb * 1e6:.0f} µs)",
                                          q <= limit))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if max(workers) > cores:
        res.notes.append(f"{max(workers)} workers share {cores} cores here: every implementation runs "
                         "oversubscribed at that size, so compare the ratios, not the absolute times")
    res.raw = {"sizes": sizes, "workers": workers, "repeat": repeat, "calls_per_launch": reps,
               "samples_s": samples, "median_s": med}
    res.seconds = time.monotonic() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    """The standalone script (kept for compatibility): same as ``python -m benchmarks --suite allreduce``."""
    from benchmarks import report
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--sizes", help="e.g. 1K,1M,64M")
    ap.add_argument("--repeat", type=int)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ray", choices=["0", "1"], help="include (1) or leave out (0) the ray peer")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    extra: dict[str, Any] = {k: v for k, v in (("sizes", a.sizes), ("ray", a.ray)) if v}
    opts = SuiteOptions(quick=a.quick, workers=[int(w) for w in a.workers.split(",")], repeat=a.repeat or 3,
                        repeat_given=bool(a.repeat), extra=extra)
    report.run_standalone(NAME, run, opts, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
