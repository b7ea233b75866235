"""In-network aggregation (ATP software switch): what reaches the parameter server with and without the
switch, and how fast the switch aggregates.

For N workers (the suite's worker counts) one float32 allreduce of ``values`` per run goes either
through the software switch (``innet.InnetCluster``: switch and PS threads, one thread per worker) or
straight to the PS (workers with no switch, as after a switch failure). The PS counts the packets it
receives; bytes = packets x the packet size. ATP's claim, and the target here: with enough
aggregators the PS receives at most 1/N of the no-switch bytes (plus 5%). Every result is checked
against the float64 sum within the quantization bound. The switch rate is gradient packets aggregated
per second of the allreduce (Python software switch; a P4 switch does this at line rate).

Multi-tenancy: three jobs at once on a switch with 100%, 50% and 10% of the aggregators they want;
each job's throughput relative to 100% (collided fragments go to the PS).

ECN congestion control on vs off: two jobs of two workers share one switch whose port is rate-limited
(``line_rate`` packets/s, a ``queue_limit``-packet buffer with tail drop: the switch marks ECN on the
queue behind that port, as a hardware switch marks on its egress queue). With ECN on the switch marks
above ``ecn_threshold`` queued packets and the workers halve their windows; with ECN off it never marks
and only losses slow the workers down. Reported: time for both jobs, goodput, tail drops, retransmits.
(A tc-shaped veth link would not do here: the switch cannot see a qdisc's queue, so it could not mark.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import report
from benchmarks.harness import SuiteOptions, SuiteResult, Table, Target

NAME = "innet"
DESCRIPTION = ("in-network aggregation: bytes reaching the PS with and without the ATP software switch, "
               "and the switch's aggregation rate")


def _inputs(world: int, values: int) -> list[np.ndarray]:
    return [(np.random.default_rng([r, values]).standard_normal(values) * 10).astype(np.float32)
            for r in range(world)]


def _check(outs: list[np.ndarray], inputs: list[np.ndarray], scale: float) -> None:
    from innet import error_bound
    ref = sum(a.astype(np.float64) for a in inputs)
    bound = error_bound(ref, scale, len(inputs))
    for o in outs:
        if not (np.abs(o - ref) <= bound).all():
            raise AssertionError("in-network allreduce result outside the quantization bound")


def with_switch(world: int, values: int) -> dict[str, Any]:
    from innet import DEFAULT_SCALE, InnetCluster, JobSpec
    inputs = _inputs(world, values)
    with InnetCluster([JobSpec(1, world)]) as cluster:
        t = time.perf_counter()
        outs = cluster.allreduce(1, inputs)
        dt = time.perf_counter() - t
        _check(outs, inputs, DEFAULT_SCALE)
        ps_packets = cluster.ps.server.stats(1).packets
        counters = cluster.control.counters()
    return {"ps_packets": ps_packets, "seconds": dt, "aggregated": counters["aggregated"],
            "counters": counters}


def _no_switch(world: int, values: int) -> dict[str, Any]:
    import socket
    import threading

    from innet import DEFAULT_SCALE, InnetJob
    from innet.ps import PSJobConfig, PSThread
    inputs = _inputs(world, values)
    nowhere = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)   # a switch address nobody serves
    nowhere.bind(("127.0.0.1", 0))
    try:
        with PSThread() as ps:
            jobs = [InnetJob(1, r, world, None, ps.address) for r in range(world)]
            ps.server.add_job(PSJobConfig(1, world, DEFAULT_SCALE, switch_addr=nowhere.getsockname(),
                                          workers=tuple(j.direct_address for j in jobs)))
            outs: list[Any] = [None] * world
            try:
                def run(r: int) -> None:
                    try:
                        outs[r] = jobs[r].allreduce(inputs[r])
                    except BaseException as e:  # noqa: BLE001 - re-raised below
                        outs[r] = e
                threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
                t = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join(300)
                dt = time.perf_counter() - t
            finally:
                for j in jobs:
                    j.close()
            for o in outs:
                if isinstance(o, BaseException) or o is None:
                    raise RuntimeError(f"no-switch allreduce failed: {o!r}")
            _check(outs, inputs, DEFAULT_SCALE)
            return {"ps_packets": ps.server.stats(1).packets, "seconds": dt}
    finally:
        nowhere.close()


def _jobs_at_once(cluster: Any, inputs: dict[int, list[np.ndarray]]) -> tuple[dict[int, float], float]:
    """Every job of ``cluster`` allreduces its ``inputs`` at the same time, one thread per job; results
    are checked. Returns each job's seconds and the time until all finished."""
    import threading

    from innet import DEFAULT_SCALE
    outs: dict[int, Any] = {}
    seconds: dict[int, float] = {}

    def job(j: int) -> None:
        t = time.perf_counter()
        try:
            outs[j] = cluster.allreduce(j, inputs[j])
        except BaseException as e:  # noqa: BLE001 - raised below
            outs[j] = e
        seconds[j] = time.perf_counter() - t
    threads = [threading.Thread(target=job, args=(j,)) for j in inputs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = time.perf_counter() - t0
    for j in inputs:
        if isinstance(outs[j], BaseException):
            raise outs[j]
        _check(outs[j], inputs[j], DEFAULT_SCALE)
    return seconds, total


def ecn_contention(ecn: bool, values: int, line_rate: float, queue_limit: int,
                   ecn_threshold: int = 16) -> dict[str, Any]:
    """Two 2-worker jobs allreducing ``values`` floats at once through one rate-limited switch port."""
    from innet import InnetCluster, JobSpec
    inputs = {j: [(np.random.default_rng([j, r, values]).standard_normal(values) * 10).astype(np.float32)
                  for r in range(2)] for j in (1, 2)}
    threshold = ecn_threshold if ecn else queue_limit + 1     # off: the queue never exceeds it
    with InnetCluster([JobSpec(1, 2), JobSpec(2, 2)], line_rate=line_rate, queue_limit=queue_limit,
                      ecn_threshold=threshold) as cluster:
        seconds, total = _jobs_at_once(cluster, inputs)
        stats = [h.last_stats for j in (1, 2) for h in cluster.jobs[j]]
        served = cluster.switch.server.packets_in
        return {"seconds": total, "job_seconds": seconds, "tail_drops": cluster.switch.server.tail_drops,
                "retransmits": sum(s.retransmits for s in stats),
                "ecn_signals": sum(s.ecn_signals for s in stats),
                "goodput_mb_s": 2 * 2 * values * 4 / total / 1e6,
                # the port's packets (workers', the PS's) and how busy it was: line_rate x seconds
                "port_packets": served, "port_busy": served / (line_rate * total)}


def _ecn_section(opts: SuiteOptions, res: SuiteResult, raw: dict[str, Any], bar: Any) -> None:
    values = opts.get("ecn_values", 30_000 if opts.quick else 300_000)
    rate = float(opts.get("ecn_line_rate", 5000))
    qlim = int(opts.get("ecn_queue", 32))
    repeat = opts.repeats()
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for rep in range(repeat):
        for mode in ("on", "off"):
            bar.step(f"ECN {mode}, two jobs on a {rate:.0f} pkt/s port, run {rep + 1}/{repeat}")
            runs[mode].append(ecn_contention(mode == "on", values, rate, qlim))
    raw["ecn"] = {"values": values, "line_rate": rate, "queue_limit": qlim, "runs": runs}

    def med(mode: str, key: str) -> float:
        return float(np.median([r[key] for r in runs[mode]]))
    # what the port could carry: the gradient bytes over the fewest packets either mode needed, at line rate
    fewest = min(med(mode, "port_packets") - med(mode, "retransmits") for mode in ("on", "off"))
    link = 2 * 2 * values * 4 / (fewest / rate) / 1e6
    rows = [[mode, round(med(mode, "seconds"), 3), round(med(mode, "goodput_mb_s"), 3),
             f"{med(mode, 'goodput_mb_s') / link:.0%}", f"{med(mode, 'port_busy'):.0%}",
             int(med(mode, "tail_drops")), int(med(mode, "retransmits")), int(med(mode, "ecn_signals"))]
            for mode in ("on", "off")]
    res.tables.append(Table(
        f"ECN on vs off: 2 jobs x 2 workers, {values:,} float32 each, one switch port at {rate:.0f} "
        f"packets/s with a {qlim}-packet buffer, median of {repeat}",
        ["ECN", "s (both jobs)", "goodput MB/s", "of the port's", "port busy", "tail drops", "retransmits",
         "ECN signals"], rows,
        note=f"goodput = gradient bytes of all workers / time until both jobs finished; the port's goodput "
             f"({link:.3f} MB/s) = those bytes over the fewest packets a mode needed (port packets less "
             "retransmits), at line rate; port busy = packets served / (line rate x time); results checked"))
    ratio = med("on", "goodput_mb_s") / med("off", "goodput_mb_s")
    res.targets.append(Target("ECN on vs off, goodput of two jobs on a rate-limited port",
                              ">= 2x (issue 25; ATP reports 3x)", f"{ratio:.2f}x", ratio >= 2.0))
    drops_on, drops_off = med("on", "tail_drops"), med("off", "tail_drops")
    res.targets.append(Target("ECN on vs off, tail drops at the congested port",
                              "<= 10% of the drops without ECN", f"{drops_on:.0f} vs {drops_off:.0f}",
                              drops_on <= 0.1 * drops_off))


def tenancy(fraction: float, values: int, jobs: int = 3, world: int = 2, window: int = 32) -> dict[str, Any]:
    """``jobs`` jobs of ``world`` workers allreducing at once on a switch with ``fraction`` of the
    aggregators they want (``jobs x window``); collisions go to the PS. Results are checked."""
    from innet import InnetCluster, JobSpec
    specs = [JobSpec(j, world, max_window=window) for j in range(1, jobs + 1)]
    wanted = jobs * window
    inputs = {s.job_id: [(np.random.default_rng([s.job_id, r, values]).standard_normal(values) * 10)
                         .astype(np.float32) for r in range(world)] for s in specs}
    with InnetCluster(specs, num_aggregators=max(1, round(fraction * wanted))) as cluster:
        seconds, _ = _jobs_at_once(cluster, inputs)
        collisions = cluster.control.counters()["collisions"]
    mb = values * 4 / 1e6
    return {"aggregators": max(1, round(fraction * wanted)), "wanted": wanted, "collisions": collisions,
            "job_mb_s": [mb / seconds[s.job_id] for s in specs]}


def _tenancy_section(opts: SuiteOptions, res: SuiteResult, raw: dict[str, Any], bar: Any) -> None:
    values = opts.get("tenancy_values", 20_000 if opts.quick else 200_000)
    repeat = opts.repeats()
    runs: dict[float, list[dict[str, Any]]] = {}
    for frac in (1.0, 0.5, 0.1):
        runs[frac] = []
        for rep in range(repeat):
            bar.step(f"3 jobs sharing {frac:.0%} of the wanted aggregators, run {rep + 1}/{repeat}")
            runs[frac].append(tenancy(frac, values))
    raw["tenancy"] = {"values": values, "runs": {str(k): v for k, v in runs.items()}}

    def job_rate(frac: float) -> float:        # median over runs of the mean per-job throughput
        return float(np.median([np.mean(r["job_mb_s"]) for r in runs[frac]]))
    base = job_rate(1.0)
    rows = [[f"{frac:.0%}", runs[frac][0]["aggregators"], round(job_rate(frac), 3),
             round(job_rate(frac) / base, 3), int(np.median([r["collisions"] for r in runs[frac]]))]
            for frac in (1.0, 0.5, 0.1)]
    res.tables.append(Table(
        f"Multi-tenancy: 3 jobs x 2 workers at once, {values:,} float32 per worker, window 32 "
        f"(96 aggregators wanted), median of {repeat}",
        ["aggregators (of wanted)", "aggregators", "job MB/s (mean of jobs)", "vs 100%", "collisions"], rows,
        note="collided fragments are aggregated at the PS; every result checked against the float64 sum"))
    half = job_rate(0.5) / base
    res.targets.append(Target("multi-tenancy, 50% of the wanted aggregators vs 100%",
                              ">= 0.90x the job throughput (ATP: 5-10% loss)", f"{half:.2f}x", half >= 0.90))


def _rate_section(opts: SuiteOptions, res: SuiteResult, raw: dict[str, Any], bar: Any) -> None:
    """Switch packets/s (per-packet, Python batched and compiled dataplanes, through a socket and alone)
    vs the bare receive ceilings, all on one core (CPU seconds of the receiving thread; wall in raw)."""
    from benchmarks import _innet_rate as rate
    from innet import fastpath
    frags = opts.get("rate_fragments", 5_000 if opts.quick else 50_000)
    ref_frags = max(1000, frags // 10)
    repeat = opts.repeats()
    wide = int(opts.get("rate_wide_values", 2048))
    has_c = fastpath.c_available()
    kinds = ["bare", "batched", "per_packet", "dp_batched", "dp_per_packet", "batched_wide"]
    if has_c:
        kinds += ["bare_mmsg", "compiled", "dp_compiled", "compiled_wide"]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for rep in range(repeat):
        bar.step(f"switch packet rate, run {rep + 1}/{repeat}")
        runs["bare"].append(rate.bare_receive(3 * frags))
        runs["batched"].append(rate.switch_rate(True, fragments=frags, dataplane="python"))
        runs["per_packet"].append(rate.switch_rate(False, fragments=ref_frags, dataplane="python"))
        runs["dp_batched"].append(rate.dataplane_rate(True, fragments=frags))
        runs["dp_per_packet"].append(rate.dataplane_rate(False, fragments=ref_frags))
        runs["batched_wide"].append(rate.switch_rate(True, fragments=max(500, frags // 16), V=wide, n_agg=1024,
                                                     dataplane="python"))
        if has_c:
            runs["bare_mmsg"].append(rate.bare_receive_mmsg(3 * frags))
            runs["compiled"].append(rate.switch_rate(True, fragments=frags, dataplane="c"))
            runs["dp_compiled"].append(rate.dataplane_rate(True, fragments=frags, dataplane="c"))
            runs["compiled_wide"].append(rate.switch_rate(True, fragments=max(500, frags // 16), V=wide,
                                                          n_agg=1024, dataplane="c"))
    raw["rate"] = {"fragments": frags, "runs": runs, "c_dataplane": has_c,
                   "c_unavailable": fastpath.c_unavailable_reason()}

    def med(k: str, key: str) -> float:
        return float(np.median([r[key] for r in runs[k]]))
    bare = med("bare", "cpu_pps")
    mb = 62 * 4 / 1e6
    rows = [["bare receive loop (recvfrom_into)", "-", round(bare), round(med("bare", "wall_pps")), 1.0, "-"]]
    for k, label in (("batched", "switch server, batched dataplane (Python)"),
                     ("per_packet", "switch server, per-packet dataplane")):
        rows.append([label, round(med(k, "cpu_agg_pps")), round(med(k, "cpu_pps")), round(med(k, "wall_pps")),
                     round(med(k, "cpu_pps") / bare, 3), round(med(k, "cpu_agg_pps") * mb, 1)])
    for k, label in (("dp_batched", "dataplane alone, batched"), ("dp_per_packet", "dataplane alone, per-packet")):
        rows.append([label, round(med(k, "cpu_agg_pps")), round(med(k, "cpu_pps")), "-",
                     round(med(k, "cpu_pps") / bare, 3), round(med(k, "cpu_agg_pps") * mb, 1)])
    rows.append([f"switch server, batched, {wide}-value packets", round(med("batched_wide", "cpu_agg_pps")),
                 round(med("batched_wide", "cpu_pps")), round(med("batched_wide", "wall_pps")), "-",
                 round(med("batched_wide", "cpu_agg_pps") * wide * 4 / 1e6, 1)])
    if has_c:
        rows.append(["bare receive loop (recvmmsg, C)", "-", round(med("bare_mmsg", "cpu_pps")),
                     round(med("bare_mmsg", "wall_pps")), round(med("bare_mmsg", "cpu_pps") / bare, 3), "-"])
        rows.append(["switch server, compiled dataplane (C)", round(med("compiled", "cpu_agg_pps")),
                     round(med("compiled", "cpu_pps")), round(med("compiled", "wall_pps")),
                     round(med("compiled", "cpu_pps") / bare, 3), round(med("compiled", "cpu_agg_pps") * mb, 1)])
        rows.append(["dataplane alone, compiled (C)", round(med("dp_compiled", "cpu_agg_pps")),
                     round(med("dp_compiled", "cpu_pps")), "-", round(med("dp_compiled", "cpu_pps") / bare, 3),
                     round(med("dp_compiled", "cpu_agg_pps") * mb, 1)])
        rows.append([f"switch server, compiled (C), {wide}-value packets", round(med("compiled_wide", "cpu_agg_pps")),
                     round(med("compiled_wide", "cpu_pps")), round(med("compiled_wide", "wall_pps")), "-",
                     round(med("compiled_wide", "cpu_agg_pps") * wide * 4 / 1e6, 1)])
    res.tables.append(Table(
        f"Switch packet rate on one core: 2 workers' 264-byte gradients + the PS's ACKs, {frags:,} fragments "
        f"prefilled in the switch's socket, median of {repeat}",
        ["what", "aggregated pkts/s (CPU)", "all pkts/s (CPU)", "all pkts/s (wall)", "vs bare receive",
         "aggregated MB/s (CPU)"], rows,
        note="CPU = packets per CPU second of the receiving thread (the one-core rate on a loaded host); "
             "'vs bare receive' is against the Python recvfrom_into loop; the per-packet rows ran on a tenth "
             "of the fragments; wide rows: innet_values-sized packets"
             + ("" if has_c else f"; the C dataplane is not built ({fastpath.c_unavailable_reason()})")))
    py_agg = med("batched", "cpu_agg_pps")
    agg, which = (med("compiled", "cpu_agg_pps"), "compiled (C)") if has_c else (py_agg, "Python batched")
    res.targets.append(Target(f"switch aggregation rate, {which} dataplane, one core",
                              ">= 300,000 aggregated packets/s", f"{agg:,.0f}/s (ceiling: bare receive "
                              f"{bare:,.0f} pkts/s)", agg >= 300_000))
    res.targets.append(Target(f"{which} vs per-packet dataplane (through the socket)", ">= 25x",
                              f"{agg / med('per_packet', 'cpu_agg_pps'):.1f}x",
                              agg / med("per_packet", "cpu_agg_pps") >= 25))


def _load() -> float:
    """The 1-minute load average (timings on a shared host mean little without it)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError):
        return float("nan")


def allreduce_vs_ring(world: int, nbytes: int, via: str, reps: int, values: int = 62) -> dict[str, Any]:
    """One ``twisternet run -n world`` job timing ``reps`` float32 allreduces of ``nbytes`` via ``via``."""
    from benchmarks.common import run_tagged, twisternet_run
    return run_tagged(twisternet_run(world, "benchmarks/_innet_allreduce_worker.py", str(nbytes), str(reps), via),
                      "INNET_AR", timeout=1800, TWISTERNET_INNET_VALUES=str(values))


def _allreduce_section(opts: SuiteOptions, res: SuiteResult, raw: dict[str, Any], bar: Any) -> None:
    nbytes = opts.get("ar_bytes", (1 << 20) if opts.quick else 8 << 20)
    cores = os.cpu_count() or 1
    reps = 2 if opts.quick else 3
    wide = int(opts.get("ar_wide_values", 8192))
    runs: dict[str, Any] = {}
    rows = []
    for n in opts.workers:
        bar.step(f"{n} workers: {nbytes >> 20} MB allreduce via ring, innet (62 values), innet ({wide} values)")
        load = _load()
        ring = allreduce_vs_ring(n, nbytes, "ring", reps)
        atp = allreduce_vs_ring(n, nbytes, "innet", reps)
        wide_r = allreduce_vs_ring(n, nbytes, "innet", reps, wide)
        runs[str(n)] = {"ring": ring, "innet": atp, "innet_wide": wide_r, "load": [load, _load()]}
        best_r = min((atp, wide_r), key=lambda r: r["median_s"])
        best = best_r["median_s"]
        # CPU per call of every process of the job (ranks, switch, PS), and what it means on this
        # machine's cores: no schedule finishes a call sooner than that total over the cores
        cpu_ring, cpu_best = _cpu_per_call(ring), _cpu_per_call(best_r)
        floor = float("nan") if cpu_best is None else cpu_best / cores
        rows.append([n, round(ring["median_s"], 3), round(atp["median_s"], 3), round(wide_r["median_s"], 3),
                     round(atp["median_s"] / ring["median_s"], 1), round(wide_r["median_s"] / ring["median_s"], 1),
                     _ms(cpu_ring), f"{_ms(cpu_best)} ({_ms(best_r.get('cpu_s', {}).get('helpers'))})",
                     f"{floor / ring['median_s']:.1f}x", f"{load:.1f}-{_load():.1f}"])
        res.targets.append(Target(f"via='innet' vs via='ring', {nbytes >> 20} MB float32, {n} workers, loopback",
                                  "<= 2x the ring's time", f"{best / ring['median_s']:.1f}x "
                                  f"({best:.3f} s vs {ring['median_s']:.3f} s; the CPU the innet call takes, over "
                                  f"this machine's {cores} cores: {floor / ring['median_s']:.1f}x the ring's time)",
                                  best <= 2 * ring["median_s"]))
    raw["allreduce"] = {"bytes": nbytes, "runs": runs}
    res.tables.append(Table(
        f"float32 allreduce of {nbytes >> 20} MB under twisternet run (loopback), median of {reps} after a "
        "warm-up call",
        ["workers", "ring s", "innet s (62 values)", f"innet s ({wide} values)", "x ring (62)", f"x ring ({wide})",
         "CPU ms/call ring", "CPU ms/call innet (switch+PS)", "innet CPU / cores, x ring", "load (1 min)"],
        rows, note="innet: switch and PS subprocesses started by the operation; results checked on every rank. "
                   "CPU: user + system time per call of all the job's processes (the faster innet variant); "
                   "over the machine's cores it is a floor under the innet call's time: on loopback every "
                   "byte the switch saves a link costs the same CPU as a byte on a link"))


def _cpu_per_call(run: dict[str, Any]) -> float | None:
    """CPU seconds per call of a run's processes (ranks, and the switch and PS for innet), if reported."""
    cpu = run.get("cpu_s")
    return None if not cpu else cpu["ranks"] + cpu["helpers"]


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f}"


def run(opts: SuiteOptions) -> SuiteResult:
    from innet.wire import DEFAULT_VALUE_COUNT, HEADER_SIZE
    res = SuiteResult(NAME)
    values = opts.get("values", 20_000 if opts.quick else 500_000)
    repeat = opts.repeats()
    packet = HEADER_SIZE + 4 * DEFAULT_VALUE_COUNT
    # --set innet.sections=allreduce (or any of ps,tenancy,ecn,rate,allreduce) runs only those sections
    sections = set(opts.get("sections", ["ps", "tenancy", "ecn", "rate", "allreduce"]))
    bar = opts.bar(NAME)
    bar.set_total(len(opts.workers) * repeat * 2 + 2 * repeat + 3 * repeat + repeat + len(opts.workers))
    rows = []
    raw: dict[str, Any] = {"values": values, "packet_bytes": packet, "runs": {}}
    for n in (opts.workers if "ps" in sections else []):
        sw_runs, ns_runs = [], []
        for rep in range(repeat):
            bar.step(f"{n} workers, run {rep + 1}/{repeat}: through the switch")
            sw_runs.append(with_switch(n, values))
            bar.step(f"{n} workers, run {rep + 1}/{repeat}: straight to the PS")
            ns_runs.append(_no_switch(n, values))
        raw["runs"][n] = {"switch": sw_runs, "no_switch": ns_runs}
        sw_pk = float(np.median([r["ps_packets"] for r in sw_runs]))
        ns_pk = float(np.median([r["ps_packets"] for r in ns_runs]))
        rate = float(np.median([r["aggregated"] / r["seconds"] for r in sw_runs]))
        ratio = sw_pk / ns_pk if ns_pk else float("nan")
        rows.append([n, round(sw_pk * packet / 1e6, 3), round(ns_pk * packet / 1e6, 3), round(ratio, 3),
                     round(1 / n + 0.05, 3), round(rate), round(float(np.median([r["seconds"] for r in sw_runs])), 3),
                     round(float(np.median([r["seconds"] for r in ns_runs])), 3)])
        res.targets.append(Target(f"PS bytes with the switch, {n} workers",
                                  f"<= 1/{n} + 5% of the no-switch bytes (ratio <= {1 / n + 0.05:.3f})",
                                  f"{ratio:.3f}", ratio <= 1 / n + 0.05))
    if rows:
        res.tables.append(Table(
            f"One float32 allreduce of {values:,} values ({values * 4 / 1e6:.1f} MB per worker), median of {repeat}",
            ["workers", "PS MB (switch)", "PS MB (no switch)", "ratio", "target ratio", "switch agg. pkts/s",
             "s (switch)", "s (no switch)"], rows,
            note="PS bytes = packets the PS received x packet size; results checked against the float64 sum"))
    if "tenancy" in sections:
        _tenancy_section(opts, res, raw, bar)
    if "ecn" in sections:
        _ecn_section(opts, res, raw, bar)
    if "rate" in sections and opts.get("rate", True):
        _rate_section(opts, res, raw, bar)
    if "allreduce" in sections and opts.get("allreduce", True):
        _allreduce_section(opts, res, raw, bar)
    res.raw = raw
    bar.finish()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--values", type=int, default=None)
    a = ap.parse_args(argv)
    extra = {"values": a.values} if a.values else {}
    workers = [int(x) for x in a.workers.split(",")]
    report.run_standalone(NAME, run, SuiteOptions(quick=a.quick, repeat=a.repeat, workers=workers,
                                                  extra=extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
