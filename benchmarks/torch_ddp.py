"""torch DDP over the twisternet backend vs gloo: step time of examples/ddp_train.py's MLP at ~25M
parameters, and torch.distributed.all_reduce of a 64 MB float32 tensor, both backends in the same run.

    python -m benchmarks --suite torch_ddp [--workers 2,4] [--repeat 1] [--quick]
                         [--set torch_ddp.width=2048] [--set torch_ddp.steps=6]
    python benchmarks/torch_ddp.py [--workers 2,4] [--repeat 1] [--quick] [--json OUT]
    python benchmarks/torch_ddp.py --cluster 2x1,4x2 [--repeat 3] [--rate 1gbit] [--mb 64]

Every job runs under ``twisternet run -n N`` (``twisternet.torch.init_process_group`` gives gloo its
TCPStore there too). A figure is the median over ``repeat`` launches of rank 0's median per step (after
``warmup`` steps) or per all_reduce call. Targets (issue 24): DDP step time <= 0.8x gloo's, the 64 MB
all_reduce <= 0.5x gloo's, on one host.

``--cluster HxK,...``: the 64 MB all_reduce alone on the emulated cluster (twisternet.testbed: H network
namespaces, links shaped to ``--rate``, K ranks per host; needs root), both backends started by
``Testbed.twisternet_job`` on the same namespaces, alternating, ``repeat`` launches each (target: the
twisternet backend's time <= gloo's). gloo gets ``GLOO_SOCKET_IFNAME=eth0``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median, run_tagged, twisternet_run
from benchmarks.harness import SuiteOptions, SuiteResult, Table, Target, ratio

NAME = "torch_ddp"
DESCRIPTION = ("torch DDP step time (~25M-parameter MLP) and 64 MB all_reduce at 2 and 4 workers: the twisternet "
               "torch.distributed backend vs gloo")
BACKENDS = ("twisternet", "gloo")
#: (what, the largest acceptable twisternet/gloo time ratio)
TARGETS = {"step": 0.8, "allreduce": 0.5}
TAG = "TORCHDDP"


# ---------------------------------------------------------------------------------- the worker
def worker(argv: list[str]) -> None:
    """One rank of a benchmark job (run by ``twisternet run``); rank 0 prints the TAG line."""
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--via", default="auto")
    p.add_argument("--inputs", type=int, default=1024)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--no-ddp", action="store_true", help="the all_reduce timing only")
    a = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import twisternet.torch as tt
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from ddp_train import batch, make_model
    torch.set_num_threads(1)
    tt.init_process_group(a.backend, via=a.via)
    rank, world = dist.get_rank(), dist.get_world_size()
    # all_reduce of one large tensor, in place, as DDP and users call it
    x = torch.ones(a.mb * (1 << 20) // 4, dtype=torch.float32)
    dist.all_reduce(x)
    calls = []
    for _ in range(a.calls):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        calls.append(time.perf_counter() - t)
    del x
    if a.no_ddp:
        if rank == 0:
            print(f"{TAG} " + json.dumps({"backend": a.backend, "world": world, "params": None, "step_s": None,
                                          "allreduce_s": sorted(calls)[len(calls) // 2],
                                          "allreduce_all_s": calls}), flush=True)
        dist.destroy_process_group()
        return
    model = make_model(a.inputs, a.width, a.depth, 0)
    params = sum(q.numel() for q in model.parameters())
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    loss_fn = nn.MSELoss()
    steps = []
    for step in range(a.warmup + a.steps):
        xb, yb = batch(rank, step, a.batch, a.inputs)
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(xb), yb).backward()
        opt.step()
        if step >= a.warmup:
            steps.append(time.perf_counter() - t)
    if rank == 0:
        print(f"{TAG} " + json.dumps({"backend": a.backend, "world": world, "params": params,
                                      "step_s": sorted(steps)[len(steps) // 2],
                                      "allreduce_s": sorted(calls)[len(calls) // 2]}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------- the suite
def run(opts: SuiteOptions) -> SuiteResult:
    """Both backends at every worker count, alternating, ``repeat`` launches each."""
    t0 = time.monotonic()
    res = SuiteResult(suite=NAME, description=DESCRIPTION)
    if importlib.util.find_spec("torch") is None:
        res.skipped.append("the whole suite: torch is not installed (pip install 'twisternet[torch]')")
        return res
    workers = sorted(set(opts.workers))
    repeat = opts.repeats(1)      # each launch trains a 25M-parameter model on every rank: minutes
    quick = opts.quick
    width = int(opts.get("width", 512 if quick else 2048))
    steps = int(opts.get("steps", 2 if quick else 6))
    mb = int(opts.get("mb", 4 if quick else 64))
    via = str(opts.get("via", "auto"))
    args = ["--width", str(width), "--steps", str(steps), "--mb", str(mb), "--via", via]
    bar = opts.bar(NAME)
    bar.set_total(len(workers) * repeat * len(BACKENDS))
    samples: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for n in workers:
        for rep in range(repeat):
            for backend in BACKENDS:
                bar.step(f"{n} workers, run {rep + 1}/{repeat}: {backend}")
                try:
                    r = run_tagged(twisternet_run(n, "benchmarks/torch_ddp.py", "--worker", "--backend", backend,
                                                  *args), TAG, timeout=1800)
                except Exception as e:  # noqa: BLE001 - reported, the other runs go on
                    res.skipped.append(f"{backend} at {n} workers: failed: {type(e).__name__}: {str(e)[:400]}")
                    continue
                samples.setdefault(n, {}).setdefault(backend, []).append(r)
    params = next((r["params"] for by in samples.values() for rs in by.values() for r in rs), None)
    med = {n: {b: {k: median([r[k] for r in rs]) for k in ("step_s", "allreduce_s")} for b, rs in by.items()}
           for n, by in samples.items()}
    rows = []
    for n in workers:
        m = med.get(n, {})
        tw, gl = m.get("twisternet", {}), m.get("gloo", {})
        rows.append([n, _ms(tw.get("step_s")), _ms(gl.get("step_s")), ratio(tw.get("step_s"), gl.get("step_s")),
                     _ms(tw.get("allreduce_s")), _ms(gl.get("allreduce_s")),
                     ratio(tw.get("allreduce_s"), gl.get("allreduce_s"))])
        for what, key, label in (("step", "step_s", f"DDP step ({params} parameters)"),
                                 ("allreduce", "allreduce_s", f"all_reduce {mb} MB")):
            limit = TARGETS[what]
            name = f"{label}, {n} workers: twisternet vs gloo"
            wanted = f"twisternet time <= {limit:.1f}x gloo's"
            q = ratio(tw.get(key), gl.get(key))
            if q is None:
                res.targets.append(Target(name, wanted, "not measured (a backend did not run)", None))
            else:
                res.targets.append(Target(name, wanted, f"{q:.2f}x ({tw[key] * 1e3:.1f} ms vs {gl[key] * 1e3:.1f} ms)",
                                          q <= limit))
    res.tables.append(Table(
        f"torch DDP and all_reduce: twisternet backend (via={via}) vs gloo, ms (median of {repeat} launches)",
        ["workers", "DDP step tn", "DDP step gloo", "step tn/gloo", f"all_reduce {mb} MB tn",
         f"all_reduce {mb} MB gloo", "all_reduce tn/gloo"], rows,
        note=f"MLP of {params} float32 parameters (width {width}), batch 16 per rank, one torch thread per rank; "
             "ratios below 1: twisternet faster"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if max(workers) > cores:
        res.notes.append(f"{max(workers)} workers share {cores} cores: compute dominates the step time and both "
                         "backends run oversubscribed; compare the ratios")
    res.raw = {"workers": workers, "repeat": repeat, "width": width, "steps": steps, "mb": mb, "via": via,
               "params": params, "samples": samples, "median_s": med}
    res.seconds = time.monotonic() - t0
    return res


def cluster(shapes: list[tuple[int, int]], repeat: int, rate: str, mb: int, calls: int) -> list[dict[str, Any]]:
    """The all_reduce of ``mb`` MB per testbed shape (hosts, ranks per host): both backends alternating,
    ``repeat`` launches each, on one testbed per shape (removed after). Prints and returns the rows."""
    from twisternet.testbed import Testbed, unavailable
    why = unavailable()
    if why:
        raise SystemExit(f"the emulated cluster cannot be built here: {why}")
    script = Path(__file__).resolve()
    rows = []
    for hosts, k in shapes:
        got: dict[str, list[float]] = {b: [] for b in BACKENDS}
        with Testbed(hosts=hosts, ranks_per_host=k, rate=rate) as tb:
            for rep in range(repeat):
                for backend in BACKENDS:
                    t0 = time.monotonic()
                    r = tb.twisternet_job(script, ["--worker", "--backend", backend, "--no-ddp", "--mb", str(mb),
                                                   "--calls", str(calls)], ranks_per_host=k, timeout=1200,
                                          env={"GLOO_SOCKET_IFNAME": "eth0"}).check()
                    line = next(ln for ln in r.stdout.splitlines() if TAG in ln)
                    res = json.loads(line.split(TAG, 1)[1])
                    got[backend].append(res["allreduce_s"])
                    print(f"{hosts}x{k} run {rep + 1}/{repeat} {backend}: {res['allreduce_s'] * 1e3:.1f} ms "
                          f"(calls {[round(c * 1e3, 1) for c in res['allreduce_all_s']]}, launch "
                          f"{time.monotonic() - t0:.0f}s)", flush=True)
        tw, gl = median(got["twisternet"]), median(got["gloo"])
        row = {"hosts": hosts, "ranks_per_host": k, "rate": rate, "mb": mb, "twisternet_s": got["twisternet"],
               "gloo_s": got["gloo"], "twisternet_median_s": tw, "gloo_median_s": gl, "ratio": tw / gl}
        print(f"CLUSTER {hosts} hosts x {k}, {rate}, all_reduce {mb} MB: twisternet {tw * 1e3:.1f} ms "
              f"[{min(got['twisternet']) * 1e3:.1f}..{max(got['twisternet']) * 1e3:.1f}], gloo {gl * 1e3:.1f} ms "
              f"[{min(got['gloo']) * 1e3:.1f}..{max(got['gloo']) * 1e3:.1f}], ratio {tw / gl:.2f} "
              f"(target <= 1.0: {'met' if tw <= gl else 'not met'})", flush=True)
        rows.append(row)
    return rows


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        worker(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--cluster", default=None, help="HxK[,HxK...]: the all_reduce on the emulated cluster")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--calls", type=int, default=5)
    a = p.parse_args(argv)
    if a.cluster:
        shapes = [tuple(int(v) for v in x.lower().split("x")) for x in a.cluster.split(",")]
        rows = cluster([(h, k) for h, k in shapes], a.repeat, a.rate, a.mb, a.calls)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
        return 0
    opts = SuiteOptions(quick=a.quick, repeat=a.repeat, workers=[int(x) for x in a.workers.split(",")],
                        repeat_given=True)
    from benchmarks import report
    r = report.run_standalone(NAME, run, opts, a.json)
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
