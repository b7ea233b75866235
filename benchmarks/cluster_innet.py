"""In-network allreduce across the emulated cluster (issue #25): H hosts x 1 rank on links shaped to a
rate, the ATP software switch (with its P4Runtime server) on a service host whose link is unshaped, a
standing parameter server on another service host shaped like the rank hosts, the job pointed at them
by ``innet_switch`` / ``innet_p4runtime`` / ``innet_ps``; against the twisternet allreduces that do not
use the switch (``auto``, ``ring``, ``hier``), on the same testbed, launches alternating.

    python benchmarks/cluster_innet.py [--hosts 4] [--rate 100mbit] [--size 64M] [--reps 3]
                                       [--repeat 3] [--values 364] [--vias auto,ring,hier] [--json OUT]

Every launch checks its first call (innet: within ``innet.error_bound``; the others: float32 rounding),
then times ``reps`` calls after barriers; a figure is the median over launches of the slowest rank's
median. Theory: each worker sends and receives S through its link via the switch (S/B), a ring
2(H-1)/H x S each way; with frame headers (Ethernet + IP + UDP + 16-byte ATP header per 4V payload
bytes; TCP's 1448 of 1514) both grow a little. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cluster import rate_bits
from benchmarks.common import ROOT, fmt_size, median
from benchmarks.harness import Table

WORKER = ROOT / "benchmarks" / "_cluster_innet_worker.py"
#: bytes on the wire per full frame: Ethernet header 14 (tc counts it), IPv4 20, UDP 8 / TCP 32 with options
ETH, IP, UDP, ATP_HEADER, TCP_PAYLOAD, MTU = 14, 20, 8, 16, 1448, 1500


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 64M)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def theory(size: int, hosts: int, rate: str, values: int) -> dict[str, float]:
    """Seconds per call at line rate: payload only, and with the frames' headers."""
    b = rate_bits(rate) / 8
    payload = 4 * values
    datagram = IP + UDP + ATP_HEADER + payload
    frames = -(-datagram // MTU)                     # IP fragments of one datagram
    innet_wire = (datagram + frames * ETH + (frames - 1) * IP) / payload
    ring_wire = (MTU + ETH) / TCP_PAYLOAD
    ring = 2 * (hosts - 1) / hosts * size / b
    return {"innet": size / b, "ring": ring, "innet_wire": size / b * innet_wire, "ring_wire": ring * ring_wire}


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def results(stdout: str, world: int) -> list[dict[str, Any]]:
    dec, found, pos = json.JSONDecoder(), {}, stdout.find("INNETBENCH {")
    while pos >= 0:
        obj, end = dec.raw_decode(stdout, pos + len("INNETBENCH "))
        found[obj["rank"]] = obj
        pos = stdout.find("INNETBENCH {", end)
    if sorted(found) != list(range(world)):
        raise RuntimeError(f"expected INNETBENCH lines of ranks 0..{world - 1}, got {sorted(found)}:\n{stdout[-3000:]}")
    return [found[r] for r in range(world)]


def run(hosts: int, rate: str, size: int, reps: int, repeat: int, values: int, vias: list[str],
        ecn_threshold: int | None = None) -> dict[str, Any]:
    """Every via ``repeat`` times on one testbed; per launch the slowest rank's median, link bytes and CPU."""
    from twisternet.testbed import Testbed
    loads = [Path("/proc/loadavg").read_text().split()[:3]]
    launches: dict[str, list[dict[str, Any]]] = {}
    with Testbed(hosts=hosts, ranks_per_host=1, rate=rate, service_hosts=2, service_rate=[None, rate]) as tb:
        token = secrets.token_hex(16)
        switch, env = tb.start_innet_switch(tb.service_host_ids[0], token, values=values,
                                            ecn_threshold=ecn_threshold)
        ps, ps_env = tb.start_innet_ps(tb.service_host_ids[1], token, values=values)
        env.update(ps_env)
        helpers = {"switch": switch.main[0].proc.pid, "ps": ps.main[0].proc.pid}
        for rep in range(repeat):
            for via in ["innet", *vias]:
                before = {k: proc_cpu(p) for k, p in helpers.items()}
                t0 = time.monotonic()
                r = tb.twisternet_job(WORKER, [via, str(size), str(reps)], token=token, env=env,
                                      timeout=1800).check()
                ranks = results(r.stdout, hosts)
                moved = r.link_bytes()
                launches.setdefault(via, []).append({
                    "slowest_median_s": max(x["median_s"] for x in ranks),
                    "worst": max(x["worst"] for x in ranks),
                    "ranks_cpu_s_per_call": sum(x["cpu_s"] for x in ranks) / reps,
                    "helpers_cpu_s": {k: proc_cpu(p) - before[k] for k, p in helpers.items()},
                    "host_link_bytes_per_call": {h: moved[h] / (reps + 1) for h in range(tb.hosts + 2)},
                    "stats": [x["stats"] for x in ranks], "launch_s": time.monotonic() - t0,
                    "load": Path("/proc/loadavg").read_text().split()[:3]})
                print(f"run {rep + 1}/{repeat} {via}: {launches[via][-1]['slowest_median_s']:.2f} s, load "
                      f"{' '.join(launches[via][-1]['load'])}", file=sys.stderr, flush=True)
    loads.append(Path("/proc/loadavg").read_text().split()[:3])
    return {"hosts": hosts, "rate": rate, "size": size, "reps": reps, "repeat": repeat, "values": values,
            "ecn_threshold": ecn_threshold,
            "launches": launches, "theory_s": theory(size, hosts, rate, values), "load_before_after": loads}


def table(res: dict[str, Any]) -> Table:
    th = res["theory_s"]
    med = {via: median([x["slowest_median_s"] for x in runs]) for via, runs in res["launches"].items()}
    others = [v for v in med if v != "innet"]
    best = min(others, key=lambda v: med[v]) if others else None
    rows = []
    for via, t in med.items():
        runs = res["launches"][via]
        link = median([median(list(x["host_link_bytes_per_call"].values())[:res["hosts"]]) for x in runs])
        rows.append([via, t, ", ".join(f"{x['slowest_median_s']:.2f}" for x in runs), link / 1e6,
                     max(x["worst"] for x in runs), median([x["ranks_cpu_s_per_call"] for x in runs]),
                     t / med[best] if best else None])
    hosts, rate, size = res["hosts"], res["rate"], res["size"]
    return Table(f"{fmt_size(size)} float32 allreduce, {hosts} hosts x 1 rank, links {rate}: seconds per call "
                 f"(slowest rank, median of {res['repeat']} launches x {res['reps']} calls)",
                 ["via", "s per call", "per launch", "MB per rank host link per call (both ways)",
                  "worst error / bound", "ranks' CPU s per call", f"x best without the switch ({best})"], rows,
                 note=f"theory at line rate: via the switch S/B = {th['innet']:.2f} s, ring 2(H-1)/H x S/B = "
                      f"{th['ring']:.2f} s (ratio {th['innet'] / th['ring']:.2f}); with frame headers "
                      f"{th['innet_wire']:.2f} s vs {th['ring_wire']:.2f} s (ratio "
                      f"{th['innet_wire'] / th['ring_wire']:.2f}); {res['values']} values per packet, switch "
                      f"ECN threshold {res['ecn_threshold'] or 'default'}; load "
                      f"before/after {res['load_before_after']}")


def main(argv: list[str] | None = None) -> int:
    from benchmarks import report
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--size", default="64M")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per launch")
    ap.add_argument("--repeat", type=int, default=3, help="launches per via")
    ap.add_argument("--values", type=int, default=364, help="values per packet of the switch (364: one frame)")
    ap.add_argument("--vias", default="auto,ring,hier", help="the allreduces without the switch")
    ap.add_argument("--ecn-threshold", type=int, default=None,
                    help="the switch's ECN threshold in packets (default: the switch's own)")
    ap.add_argument("--json", help="write the raw results here")
    a = ap.parse_args(argv)
    res = run(a.hosts, a.rate, parse_size(a.size), a.reps, a.repeat, a.values, a.vias.split(","), a.ecn_threshold)
    print(report.render_table(table(res)))
    med = {via: median([x["slowest_median_s"] for x in runs]) for via, runs in res["launches"].items()}
    best = min(t for v, t in med.items() if v != "innet")
    ratio = med["innet"] / best
    print(f"- target: via the switch <= 0.75x the best without it; measured {ratio:.2f}x; "
          f"{'MET' if ratio <= 0.75 else 'MISSED'}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
