"""float32 allreduce on an emulated cluster (twisternet.testbed): H hosts as network namespaces, every
host's link shaped to a rate (1 Gbit/s by default), k ranks per host. twisternet over its master/worker
TCP path with via auto / ring / tree (ranks numbered host by host by the master; and the flat ring with
ranks interleaving the hosts when k > 1, as connection order used to number them) vs MPICH
(mpi4py Allreduce, ofi/tcp netmod over the links) vs torch.distributed gloo (when torch imports) vs
the bandwidth bound 2(H-1)/H * S/B of an allreduce of S bytes over links of B bytes/s. With one rank per
host, also the raw round trip: a plain Python TCP ping-pong of S bytes between hosts 0 and 1, the
wire's price of one exchange (target: a 1 KB call on 2 hosts x 1 within 3x of it).

    python -m benchmarks --suite cluster [--repeat 3] [--plot DIR]
           [--set cluster.hosts=4] [--set cluster.ranks_per_host=1,2] [--set cluster.rate=1gbit]
           [--set cluster.sizes=1K,64K,1M,16M,64M] [--set cluster.vias=auto,ring,tree] [--set cluster.raw=0]
    python benchmarks/cluster.py [--hosts 4] [--ranks-per-host 1,2] [--rate 1gbit] [--sizes ...]
                                 [--repeat 3] [--quick] [--plot DIR] [--json OUT]

Each figure is the median over ``repeat`` job launches of the slowest rank's median call time (every
call starts after a barrier). Needs root (namespaces); otherwise the suite reports why it cannot run.
MPICH busy-polls: with more ranks than cores its figures (and the others', run in turn, not at once)
come from a machine held at 100 % by MPICH's own ranks while they wait.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, fmt_size, median
from benchmarks.harness import Chart, SuiteOptions, SuiteResult, Table, Target, ratio

NAME = "cluster"
DESCRIPTION = ("float32 allreduce 1 KB..64 MB on an emulated cluster (H namespaced hosts, shaped links, k "
               "ranks per host): twisternet auto/ring/tree vs MPICH vs torch gloo vs the bandwidth bound")

KB, MB = 1 << 10, 1 << 20
FULL_SIZES = [1 * KB, 64 * KB, 1 * MB, 16 * MB, 64 * MB]
QUICK_SIZES = [1 * KB, 64 * KB]
WORKER = ROOT / "benchmarks" / "_cluster_worker.py"
#: The raw baseline's row (one rank per host): a plain TCP ping-pong between two hosts.
RAW = "raw TCP round trip"
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def rate_bits(rate: str) -> float:
    """A tc rate ("1gbit", "100mbit", "1.5Gbit") in bits per second (tc's units are decimal)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)bit\s*", rate.lower())
    if not m:
        raise ValueError(f"not a tc rate in bits: {rate!r} (use e.g. 1gbit, 100mbit)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def bound_s(size: int, hosts: int, rate: str) -> float:
    """The bandwidth bound of an allreduce of ``size`` bytes across ``hosts`` links of ``rate``."""
    return 2 * (hosts - 1) / hosts * size / (rate_bits(rate) / 8)


def reps_for(size: int) -> int:
    """Timed calls per launch: many for small sizes, a few for large ones. 200 up to 64 KB (as the
    allreduce suite): with 30, nine runs of 3 launches put the 4 x 2 1 KB call at 0.705-0.898 ms."""
    return 200 if size <= 64 * KB else 8 if size <= 4 * MB else 3


def slowest(stdout: str, world: int) -> dict[int, float]:
    """The per-size maximum over ranks of the ``CLUSTER`` lines in ``stdout`` (each rank's median)."""
    dec, found, pos = json.JSONDecoder(), {}, stdout.find("CLUSTER {")
    while pos >= 0:
        try:
            obj, end = dec.raw_decode(stdout, pos + len("CLUSTER "))
            found[obj["rank"]] = obj
        except (json.JSONDecodeError, KeyError, TypeError):
            end = pos + 1
        pos = stdout.find("CLUSTER {", end)
    if sorted(found) != list(range(world)):
        raise RuntimeError(f"expected CLUSTER lines of ranks 0..{world - 1}, got {sorted(found)}:\n{stdout[-2000:]}")
    sizes = found[0]["median_s"].keys()
    return {int(s): max(float(found[r]["median_s"][s]) for r in found) for s in sizes}


def raw_round_trips(tb: Any, args: list[str]) -> dict[int, float]:
    """The raw baseline: a plain TCP ping-pong between hosts 0 and 1 of ``tb`` (worker ``rawtcp``)."""
    port = 28500 + os.getpid() % 1000
    cmds = [(h, [sys.executable, str(WORKER), "rawtcp", *args, str(h), f"{tb.addresses[0]}:{port}"]) for h in (0, 1)]
    return slowest(tb.start_processes(cmds).wait(900).check().stdout, 2)


def rtt_target(m: dict[str, dict[int, float]]) -> Target:
    """The small-message target on 2 hosts x 1 (``m``: peer -> size -> median seconds): a 1 KB call of
    ``tn auto`` within 3x the raw TCP round trip between the two hosts."""
    wanted = "<= 3x the raw TCP round trip"
    tn, raw = m.get("tn auto", {}).get(KB), m.get(RAW, {}).get(KB)
    q = ratio(tn, raw)
    if tn is None or raw is None or q is None:
        return Target("1 KB allreduce, 2 hosts x 1", wanted, "not measured", None)
    return Target("1 KB allreduce, 2 hosts x 1", wanted, f"{q:.2f}x ({tn * 1e6:.0f} µs vs {raw * 1e6:.0f} µs)",
                  q <= 3.0)


def report(res: SuiteResult, m: dict[str, dict[int, float]], k: int, hosts: int, sizes: list[int], rate: str,
           repeat: int) -> None:
    """The table, chart and target of ``k`` ranks per host into ``res`` (``m``: peer -> size -> median s)."""
    names = list(m)
    tn_best = [n for n in names if n.startswith("tn ")]
    rows: list[list[Any]] = []
    for s in sizes:
        b = bound_s(s, hosts, rate)
        best = min((m[n][s] for n in tn_best), default=None)
        mpich = m.get("MPICH", {}).get(s)
        auto = m.get("tn auto", {}).get(s)
        rows.append([fmt_size(s), *(m[n][s] * 1e3 for n in names), b * 1e3,
                     ratio(auto, mpich), ratio(best, mpich), ratio(best, b),
                     ratio(auto, m.get("torch gloo", {}).get(s)), ratio(auto, m.get(RAW, {}).get(s))])
    res.tables.append(Table(
        f"allreduce on {hosts} hosts x {k} rank(s) per host, links {rate}: ms per call, slowest rank "
        f"(median of {repeat} launches)",
        ["size", *names, "bound", "auto/MPICH", "best tn/MPICH", "best tn/bound", "auto/gloo", "auto/raw RTT"],
        rows,
        note=f"bound = 2(H-1)/H * S/B with H={hosts}, B={rate}; ratios are times (below 1: twisternet "
             "faster); 'best tn' is the fastest twisternet variant at that size; n/a: not measured. MPICH "
             f"(ofi/tcp over eth0) busy-polls: {hosts * k} ranks on {os.cpu_count()} cores hold the "
             f"machine at 100 % during its runs. {RAW}: a plain TCP ping-pong of the size each way "
             "between hosts 0 and 1 (one rank per host only), the wire's cost of one exchange"))
    if k == 1 and hosts == 2 and KB in sizes:
        res.targets.append(rtt_target(m))
    series = {n: [(s, m[n][s] * 1e3) for s in sizes] for n in names}
    series["bound"] = [(s, bound_s(s, hosts, rate) * 1e3) for s in sizes]
    res.charts.append(Chart(f"cluster_time_vs_size_{hosts}h{k}k", f"allreduce, {hosts} hosts x {k}, {rate}",
                            "message size (bytes)", "ms per call (slowest rank)", series, logx=True, logy=True))


def torch_reason() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch gloo: torch is not installed (pip install torch==2.13.0, the CPU build)"
    return None


def run(opts: SuiteOptions) -> SuiteResult:
    """Every peer at every k and size on one testbed; tables (ms and ratios), charts, raw samples."""
    from twisternet.testbed import Testbed, unavailable
    t0 = time.monotonic()
    res = SuiteResult(suite=NAME, description=DESCRIPTION)
    why = unavailable()
    if why:
        res.status = "not available"
        res.error = f"the emulated cluster cannot be built here: {why}"
        return res
    hosts = int(opts.get("hosts", 2 if opts.quick else 4))
    ks = sorted({int(k) for k in opts.get("ranks_per_host", [1] if opts.quick else [1, 2])})
    rate = str(opts.get("rate", "1gbit"))
    sizes = sorted(opts.get("sizes", QUICK_SIZES if opts.quick else FULL_SIZES))
    vias = list(opts.get("vias", ["auto"] if opts.quick else ["auto", "ring", "tree"]))
    want_mpich = bool(opts.get("mpich", True))
    netmod = str(opts.get("netmod", "ofi"))
    rate_bits(rate)
    if hosts < 2 or not ks or min(ks) < 1 or not sizes:
        raise ValueError(f"cluster needs hosts >= 2, ranks_per_host >= 1 and sizes (got {hosts}, {ks}, {sizes})")
    repeat = opts.repeats()
    reps = [reps_for(s) for s in sizes]
    args = [",".join(map(str, sizes)), ",".join(map(str, reps))]
    py = sys.executable
    have_mpi = want_mpich and importlib.util.find_spec("mpi4py") is not None \
        and (Path(py).parent / "mpiexec").exists()
    if want_mpich and not have_mpi:
        res.skipped.append("MPICH: mpi4py or the mpich wheel's mpiexec is missing (pip install '.[mpi]')")
    gloo_why = torch_reason() if opts.get("gloo", True) else "torch gloo: disabled with --set cluster.gloo=0"
    if gloo_why:
        res.skipped.append(gloo_why)

    def peers(tb: Testbed, k: int) -> dict[str, Callable[[], dict[int, float]]]:
        world = hosts * k
        out: dict[str, Callable[[], dict[int, float]]] = {}

        def tn(via: str, interleaved: bool) -> Callable[[], dict[int, float]]:
            def go() -> dict[int, float]:
                r = tb.twisternet_job(WORKER, ["tn", via, *args], ranks_per_host=k, timeout=900,
                                      interleaved_ranks=interleaved).check()
                return slowest(r.stdout, world)
            return go
        for via in vias:
            out[f"tn {via}"] = tn(via, False)
        if k > 1 and "ring" in vias and opts.get("interleaved", True):
            out["tn ring, interleaved ranks"] = tn("ring", True)   # what connection order used to give
        if have_mpi:
            out["MPICH"] = lambda: slowest(tb.mpich_job([py, str(WORKER), "mpi4py", *args], ranks_per_host=k,
                                                        netmod=netmod, timeout=900).check().stdout, world)
        if not gloo_why:
            def gloo() -> dict[int, float]:
                port = 29500 + os.getpid() % 1000
                cmds = [(h, [py, str(WORKER), "gloo", *args, str(n), str(world), f"{tb.addresses[0]}:{port}"])
                        for n, h in enumerate(tb.placement(k))]
                # gloo finds its own address from the hostname, which resolves to nothing in a host
                r = tb.start_processes(cmds, env={"GLOO_SOCKET_IFNAME": "eth0"}).wait(900).check()
                return slowest(r.stdout, world)
            out["torch gloo"] = gloo
        if k == 1 and opts.get("raw", True):
            out[RAW] = lambda: raw_round_trips(tb, args)
        return out

    bar = opts.bar(NAME)
    samples: dict[int, dict[str, list[dict[int, float]]]] = {}
    failures: dict[str, str] = {}
    with Testbed(hosts=hosts, ranks_per_host=max(ks), rate=rate) as tb:
        bar.set_total(sum(len(peers(tb, k)) for k in ks) * repeat)
        for k in ks:
            for rep in range(repeat):
                for name, fn in peers(tb, k).items():
                    bar.step(f"{hosts} hosts x {k}, run {rep + 1}/{repeat}: {name}")
                    try:
                        samples.setdefault(k, {}).setdefault(name, []).append(fn())
                    except Exception as e:  # noqa: BLE001 - a peer failing is reported, the others go on
                        failures.setdefault(f"{name} (k={k})", f"{type(e).__name__}: {str(e).strip()[:800]}")
    for name, why in failures.items():
        res.skipped.append(f"{name}: failed in this run: {why}")
    med = {k: {name: {s: median([r[s] for r in runs]) for s in sizes} for name, runs in by.items() if runs}
           for k, by in samples.items()}
    for k in ks:
        report(res, med.get(k, {}), k, hosts, sizes, rate, repeat)
    res.raw = {"hosts": hosts, "ranks_per_host": ks, "rate": rate, "sizes": sizes, "repeat": repeat,
               "calls_per_launch": reps, "samples_s": samples, "median_s": med,
               "bound_s": {s: bound_s(s, hosts, rate) for s in sizes}}
    res.seconds = time.monotonic() - t0
    return res


WORDCOUNT_WORKER = ROOT / "benchmarks" / "_wordcount_worker.py"


def pair_bytes(words: set[str]) -> int:
    """Bytes of the distinct (word, count) pairs: each word's UTF-8 bytes and an 8-byte count."""
    return sum(len(w.encode()) + 8 for w in words)


def wordcount_links(hosts: int, k: int, rate: str, words: int, repeat: int = 1) -> Table:
    """Word count of ``words`` Zipf words (KeyedReduce, batch) on ``hosts`` x ``k``: the bytes the hosts'
    links sent during the reduce with flat trees vs host-aware trees, against the bytes of the distinct
    (word, count) pairs of each host (what must cross at least once if every key went elsewhere)."""
    from twisternet.testbed import Testbed
    rows = []
    with Testbed(hosts=hosts, ranks_per_host=k, rate=rate) as tb:
        for rep in range(repeat):
            for trees in ("flat", "host"):
                r = tb.twisternet_job(WORDCOUNT_WORKER, [str(words), trees], ranks_per_host=k, timeout=1800).check()
                dec = json.JSONDecoder()
                found = [dec.raw_decode(line.split("WC ", 1)[1])[0] for line in r.stdout.splitlines() if "WC " in line]
                if len(found) != hosts * k or sum(f["words"] for f in found) != words:
                    raise RuntimeError(f"word count {trees}: wrong rows or total:\n{r.stdout[-2000:]}")
                by_host: dict[str, list[dict]] = {}
                for f in found:
                    by_host.setdefault(f["host"], []).append(f)
                sent = sum(min(fs, key=lambda f: f["rank"])["tx_bytes"] for fs in by_host.values())
                distinct = sum(pair_bytes({w for f in fs for w in f["distinct"]}) for fs in by_host.values())
                remote = distinct * (hosts - 1) / hosts
                rows.append([trees, rep + 1, sent, distinct, ratio(sent, distinct), ratio(sent, remote),
                             max(f["seconds"] for f in found)])
    return Table(f"word count of {words:,} Zipf words on {hosts} hosts x {k}, links {rate}: bytes sent over the "
                 "host links during the reduce",
                 ["trees", "run", "bytes sent on links", "distinct pair bytes (sum over hosts)", "sent/distinct",
                  "sent/(distinct x (H-1)/H)", "seconds (slowest rank)"], rows,
                 note="bytes sent: sum over hosts of eth0 tx_bytes between two barriers around the reduce, as "
                      "read inside each host's namespace (TCP/IP headers, acks and the barriers included); "
                      "distinct pair bytes: per host, the UTF-8 bytes of each distinct word plus 8 for its count. "
                      "flat: KaryTree per destination over the ranks; host: routing.HostTree")


def wordcount_vs_spark(hosts: int, k: int, rate: str, words: int, repeat: int = 1) -> tuple[Table, list[Target]]:
    """Word count of ``words`` Zipf words: twisternet KeyedReduce (batch, host-aware trees) on ``hosts`` x
    ``k`` ranks of the emulated cluster vs PySpark ``local[hosts * k]`` (the same task slots on the same
    machine; ``benchmarks/_spark_peer.py``) over the same H*k shares of the text, each answer checked
    against ``collections.Counter``; medians of ``repeat``. Without pyspark or java the table says why
    and the target is not measured (issue #21: twisternet faster)."""
    from collections import Counter

    from benchmarks import _spark_peer
    from benchmarks.common import spark_missing
    from benchmarks.wordcount import digest
    from twisternet.testbed import Testbed
    sys.path.insert(0, str(ROOT / "examples"))
    from wordcount import generated_words
    world = hosts * k
    ref = digest(dict(Counter(w for r in range(world) for w in generated_words(r, world, words))))
    tn_s, spark_s, startup, tn_cpu, spark_cpu = [], [], [], [], []
    why = spark_missing()
    with Testbed(hosts=hosts, ranks_per_host=k, rate=rate) as tb:
        for _ in range(repeat):
            r = tb.twisternet_job(WORDCOUNT_WORKER, [str(words), "host"], ranks_per_host=k, timeout=1800).check()
            dec = json.JSONDecoder()
            found = [dec.raw_decode(line.split("WC ", 1)[1])[0] for line in r.stdout.splitlines() if "WC " in line]
            merged: dict[str, int] = {}
            for f in found:
                merged.update(f["counts"])
            if len(found) != world or digest(merged) != ref:
                raise RuntimeError(f"twisternet word count on {hosts} x {k}: counts differ from Counter's")
            tn_s.append(max(f["seconds"] for f in found))
            tn_cpu.append(sum(f["cpu_s"] for f in found))
    for _ in range(repeat if why is None else 0):
        d = _spark_peer.run("wordcount", world, words, world)
        if d["words"] != words or digest(d["counts"]) != ref:
            raise RuntimeError(f"PySpark local[{world}] word count: counts differ from Counter's")
        spark_s.append(d["seconds"])
        startup.append(d["startup_s"])
        spark_cpu.append(d["cpu_s"])
    t = median(tn_s)
    rows: list[list[Any]] = [[f"twisternet KeyedReduce, {hosts} hosts x {k} (links {rate})", t, words / t, 1.0,
                              median(tn_cpu), 1.0]]
    target = Target(f"word count, {hosts} hosts x {k}: twisternet vs PySpark local[{world}]", "faster",
                    f"not measured: {why}", None)
    if spark_s:
        s = median(spark_s)
        rows.append([f"PySpark local[{world}] reduceByKey (JVM start-up {median(startup):.1f} s, not timed)",
                     s, words / s, s / t, median(spark_cpu), median(spark_cpu) / median(tn_cpu)])
        target = Target(target.name, "faster", f"{s / t:.2f}x ({t:.2f} s vs {s:.2f} s)", s > t)
    table = Table(f"word count of {words:,} Zipf words: twisternet on {hosts} hosts x {k} vs PySpark "
                  f"local[{world}] (median of {repeat})",
                  ["implementation", "seconds", "words/s", "time / twisternet's", "CPU s",
                   "CPU / twisternet's"], rows,
                  note="every answer checked against collections.Counter over the same text; twisternet: "
                       "slowest rank, from a start barrier to its keys reduced; PySpark: from submitting "
                       "reduceByKey to the collected counts (input generated and cached before); CPU s: user+system "
                       "seconds of all its processes in that time (load-independent)"
                       + ("" if why is None else f"; PySpark not run: {why}"))
    return table, [target]


def main(argv: list[str] | None = None) -> int:
    """The standalone script: same as ``python -m benchmarks --suite cluster``, plus ``--plot DIR``."""
    from benchmarks import report
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts")
    ap.add_argument("--ranks-per-host", help="e.g. 1,2")
    ap.add_argument("--rate", help="tc rate of every link, e.g. 1gbit, 100mbit")
    ap.add_argument("--sizes", help="e.g. 1K,1M,64M")
    ap.add_argument("--vias", help="e.g. auto,ring,tree")
    ap.add_argument("--repeat", type=int)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plot", metavar="DIR", help="write the charts as PNGs into DIR")
    ap.add_argument("--json")
    ap.add_argument("--no-mpich", action="store_true", help="leave MPICH out")
    ap.add_argument("--no-gloo", action="store_true", help="leave torch gloo out")
    ap.add_argument("--wordcount", type=int, metavar="WORDS",
                    help="instead: word count of WORDS words, bytes on the links with flat vs host trees")
    ap.add_argument("--spark", type=int, default=1,
                    help="with --wordcount: 1 (default) also compares with PySpark local[H*k], 0 leaves it out")
    a = ap.parse_args(argv)
    if a.wordcount:
        ks = [int(x) for x in (a.ranks_per_host or "2").split(",")]
        for k in ks:
            print(report.render_table(wordcount_links(int(a.hosts or 4), k, a.rate or "1gbit", a.wordcount,
                                                      a.repeat or 1)))
            if a.spark:
                tab, targets = wordcount_vs_spark(int(a.hosts or 4), k, a.rate or "1gbit", a.wordcount,
                                                  a.repeat or 1)
                print(report.render_table(tab))
                for t in targets:
                    print(f"- target: {t.name}: wanted {t.wanted}; measured {t.measured}; "
                          f"{ {True: 'MET', False: 'MISSED', None: 'not measured'}[t.met] }")
        return 0
    extra: dict[str, Any] = {k: v for k, v in (("hosts", a.hosts), ("ranks_per_host", a.ranks_per_host),
                                               ("rate", a.rate), ("sizes", a.sizes), ("vias", a.vias)) if v}
    if a.no_mpich:
        extra["mpich"] = False
    if a.no_gloo:
        extra["gloo"] = False
    opts = SuiteOptions(quick=a.quick, repeat=a.repeat or 3, repeat_given=bool(a.repeat), extra=extra)
    result = report.run_standalone(NAME, run, opts, a.json)
    if a.plot:
        if not report.have_matplotlib():
            sys.stderr.write("cluster: --plot needs matplotlib (pip install matplotlib)\n")
            return 1
        written = report.write_charts([result], a.plot)
        sys.stderr.write(f"cluster: wrote {len(written)} chart(s) to {a.plot}\n")
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
