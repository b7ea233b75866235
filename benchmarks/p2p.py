"""Point-to-point bandwidth and latency: twisternet over UDS, TCP and MPI vs raw sockets and raw mpi4py.

    python benchmarks/p2p.py [--sizes 1K,...] [--repeat 3] [--quick] [--json OUT] [--plot OUT.png]

One-way bandwidth sends ``budget`` bytes (at least 3 messages) of each size from rank 0 to rank 1;
latency is half a ping-pong round trip. The raw baseline is plain ``sendall``/``recv_into`` between
two processes over the same kind of socket; for the MPI channel it is mpi4py ``Send``/``Recv`` into a
reused buffer under the same ``mpiexec`` (skipped, with the reason printed, without mpi4py). Every figure is the median of ``--repeat`` runs, and
the runs of twisternet and of the baseline alternate so that both see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _raw_sockets as raw  # noqa: E402
from benchmarks.common import fmt_size, median, mpiexec_run, run_tagged, table, twisternet_run  # noqa: E402

KB, MB = 1 << 10, 1 << 20
DEFAULT_SIZES = [1 * KB, 16 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB]
LAT_SIZES = [1 * KB, 64 * KB, 1 * MB]


def parse_sizes(text: str) -> list[int]:
    out = []
    for tok in text.split(","):
        tok = tok.strip().upper()
        mult = {"K": KB, "M": MB, "G": 1 << 30}.get(tok[-1:], 1)
        out.append(int(tok[:-1] if mult > 1 else tok) * mult)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget", type=parse_sizes, default=[512 * MB], help="bytes per bandwidth run")
    ap.add_argument("--quick", action="store_true", help="small sizes and budget (smoke run)")
    ap.add_argument("--json", help="write raw numbers here")
    ap.add_argument("--plot", help="write a PNG chart here (needs matplotlib)")
    a = ap.parse_args(argv)
    sizes, budget, repeat = a.sizes, a.budget[0], a.repeat
    lat_sizes = LAT_SIZES
    if a.quick:
        sizes, budget, repeat, lat_sizes = [1 * KB, 1 * MB, 4 * MB], 16 * MB, 1, [1 * KB]
    transports = {"uds": {}, "tcp": {"TWISTERNET_FORCE_TCP": "1"}}
    import importlib.util
    if importlib.util.find_spec("mpi4py") is not None and mpiexec_run(2, "x") is not None:
        transports["mpi"] = {}
    else:
        print("[p2p] skipping the MPI channel: mpi4py/mpiexec missing (pip install '.[mpi]')", file=sys.stderr)
    worker_args = [",".join(map(str, sizes)), str(budget), ",".join(map(str, lat_sizes))]
    runs: dict[str, dict[str, list]] = {}
    for rep in range(repeat):
        for kind, env in transports.items():
            if kind == "mpi":
                for name, script in (("twisternet-mpi", "benchmarks/_p2p_worker.py"),
                                     ("raw-mpi", "benchmarks/_p2p_mpi4py.py")):
                    print(f"[p2p] run {rep + 1}/{repeat}: {name} ...", file=sys.stderr, flush=True)
                    r = run_tagged(mpiexec_run(2, script, *worker_args), "P2P")
                    runs.setdefault(name, {}).setdefault("bw", []).append(
                        {int(k): v for k, v in r["bandwidth"].items()})
                    runs[name].setdefault("lat", []).append({int(k): v for k, v in r["latency"].items()})
                continue
            print(f"[p2p] run {rep + 1}/{repeat}: twisternet over {kind} ...", file=sys.stderr, flush=True)
            r = run_tagged(twisternet_run(2, "benchmarks/_p2p_worker.py", ",".join(map(str, sizes)),
                                          str(budget), ",".join(map(str, lat_sizes))), "P2P", **env)
            runs.setdefault(f"twisternet-{kind}", {}).setdefault("bw", []).append(
                {int(k): v for k, v in r["bandwidth"].items()})
            runs[f"twisternet-{kind}"].setdefault("lat", []).append({int(k): v for k, v in r["latency"].items()})
            print(f"[p2p] run {rep + 1}/{repeat}: raw sockets over {kind} ...", file=sys.stderr, flush=True)
            runs.setdefault(f"raw-{kind}", {}).setdefault("bw", []).append(
                {s: raw.bandwidth(kind, s, budget) for s in sizes})
            runs[f"raw-{kind}"].setdefault("lat", []).append({s: raw.latency(kind, s) for s in lat_sizes})
    med = {name: {"bw": {s: median([r[s] for r in d["bw"]]) for s in sizes},
                  "lat": {s: median([r[s] for r in d["lat"]]) for s in lat_sizes}}
           for name, d in runs.items()}
    rows = []
    for s in sizes:
        row = [fmt_size(s)]
        for kind in transports:
            t, b = med[f"twisternet-{kind}"]["bw"][s], med[f"raw-{kind}"]["bw"][s]
            row += [f"{t / 1e9:.2f}", f"{b / 1e9:.2f}", f"{t / b:.2f}"]
        rows.append(row)
    print(f"\nOne-way bandwidth, GB/s (median of {repeat}; ratio = twisternet / raw socket or raw mpi4py)")
    heads = ["size"] + [h for k in transports for h in (f"tn {k.upper()}", f"raw {k.upper()}", "ratio")]
    print(table(heads, rows))
    lrows = []
    for s in lat_sizes:
        row = [fmt_size(s)]
        for kind in transports:
            t, b = med[f"twisternet-{kind}"]["lat"][s], med[f"raw-{kind}"]["lat"][s]
            row += [f"{t * 1e6:.0f}", f"{b * 1e6:.0f}", f"{t / b:.1f}"]
        lrows.append(row)
    print(f"\nOne-way latency (half round trip), µs (median of {repeat}; ratio = twisternet / raw)")
    print(table(heads, lrows))
    big = [s for s in sizes if s >= 4 * MB]
    if big:
        worst = min(med[f"twisternet-{k}"]["bw"][s] / med[f"raw-{k}"]["bw"][s] for k in transports for s in big)
        print(f"\nTarget: >= 0.85 of raw bandwidth at >= 4 MB; worst ratio measured: {worst:.2f} "
              f"({'met' if worst >= 0.85 else 'MISSED'})")
    if a.json:
        Path(a.json).write_text(json.dumps({"sizes": sizes, "runs": runs, "median": med}, indent=1))
    if a.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, d in med.items():
            ax.plot(sizes, [d["bw"][s] / 1e9 for s in sizes], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("GB/s")
        ax.set_title("one-way bandwidth")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
