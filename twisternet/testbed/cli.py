"""``twisternet testbed``: build, use and remove an emulated cluster from the shell.

    twisternet testbed up --hosts 4 --rate 1gbit [-k 2]       # prints its NAME; it stays until `down`
    twisternet testbed status [NAME]                          # every testbed here, or one in detail
    twisternet testbed run NAME HOST -- CMD ...               # CMD inside host HOST (0-based)
    twisternet testbed job [--name NAME | --hosts 4 --rate 1gbit] [-k 2] [--mpi] script.py [args]
    twisternet testbed down NAME ... | --all                  # remove (--all: every testbed here)

``job`` without ``--name`` builds a testbed for the job and removes it afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ..errors import TwisternetError
from .cluster import Testbed, TestbedError, list_testbeds, remove_testbed, sweep_stale, unavailable

__all__ = ["main"]


def _rate(text: str) -> str | None:
    return None if text.lower() in ("none", "0", "") else text


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="twisternet testbed",
                                 description="An emulated cluster: hosts as network namespaces on a shaped bridge.")
    sub = ap.add_subparsers(dest="action", metavar="ACTION", required=True)

    def shape(p: argparse.ArgumentParser) -> None:
        p.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
        p.add_argument("-k", "--ranks-per-host", type=int, default=1, help="ranks per host of jobs (default 1)")
        p.add_argument("--rate", type=_rate, default="1gbit",
                       help="link rate per host and direction, a tc rate like 1gbit or 100mbit; 'none' for "
                            "unshaped links (default 1gbit)")

    up = sub.add_parser("up", help="build a testbed that stays until 'down'; prints its name")
    shape(up)
    st = sub.add_parser("status", help="list the testbeds here, or show one")
    st.add_argument("name", nargs="?")
    st.add_argument("--json", action="store_true", help="print JSON")
    run = sub.add_parser("run", help="run a command inside one host of a testbed")
    run.add_argument("name")
    run.add_argument("host", type=int)
    run.add_argument("argv", nargs=argparse.REMAINDER, help="the command (after --)")
    job = sub.add_parser("job", help="run a twisternet (or, with --mpi, an MPICH) job with k ranks per host")
    shape(job)
    job.add_argument("--name", help="use this testbed (from 'up') instead of building one for the job")
    job.add_argument("--mpi", action="store_true", help="launch with MPICH's mpiexec across the hosts")
    job.add_argument("--netmod", choices=["ofi", "ucx"], default="ofi", help="MPICH network module (default ofi)")
    job.add_argument("--contiguous-ranks", action="store_true",
                     help="twisternet jobs: the workers of host h request ranks h*k..h*k+k-1 (the master "
                          "numbers them so anyway)")
    job.add_argument("--interleaved-ranks", action="store_true",
                     help="twisternet jobs: local worker j of host h requests rank j*H+h (ranks alternate hosts)")
    job.add_argument("--timeout", type=float, default=600.0, help="seconds before the job is killed (default 600)")
    job.add_argument("script")
    job.add_argument("args", nargs=argparse.REMAINDER)
    down = sub.add_parser("down", help="remove testbeds")
    down.add_argument("names", nargs="*")
    down.add_argument("--all", action="store_true", help="remove every testbed on this machine")
    return ap


def _print_status(tb: Testbed, as_json: bool) -> None:
    st = tb.status()
    if as_json:
        print(json.dumps(st, indent=1))
        return
    print(f"{st['name']}: {len(st['hosts'])} hosts, links {st['rate'] or 'unshaped'}, "
          f"{st['ranks_per_host']} rank(s) per host")
    for h in st["hosts"]:
        print(f"  host {h['host']}: {h['hostname']:<8} {h['address']:<12} netns {h['namespace']}  link "
              f"{h['link']}  rx {h['rx_bytes']} B  tx {h['tx_bytes']} B")


def _job(ns: argparse.Namespace) -> int:
    own = ns.name is None
    tb = Testbed(ns.hosts, ns.ranks_per_host, ns.rate) if own else Testbed.attach(ns.name)
    k = ns.ranks_per_host if own or ns.ranks_per_host != 1 else tb.ranks_per_host
    try:
        if own:
            tb.up()
        if ns.mpi:
            res = tb.mpich_job([sys.executable, ns.script, *ns.args], ranks_per_host=k, netmod=ns.netmod,
                               timeout=ns.timeout)
        else:
            res = tb.twisternet_job(ns.script, ns.args, ranks_per_host=k, timeout=ns.timeout,
                                    contiguous_ranks=ns.contiguous_ranks,
                                    interleaved_ranks=ns.interleaved_ranks)
        for p in res.procs:
            for stream, text in ((sys.stdout, p.stdout), (sys.stderr, p.stderr)):
                for line in text.splitlines():
                    if not line.startswith("HYDRA_LAUNCH"):
                        stream.write(f"[host{p.host} {p.role} {p.index}] {line}\n")
        moved = res.link_bytes()
        sys.stderr.write(f"twisternet testbed: job {'ok' if res.ok else 'FAILED'}"
                         f"{' (timed out)' if res.timed_out else ''} in {res.seconds:.2f} s; bytes through "
                         "the links: " + ", ".join(f"host{h} {b}" for h, b in sorted(moved.items())) + "\n")
        return 0 if res.ok else 1
    finally:
        if own:
            tb.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``twisternet testbed``; returns the exit status."""
    ns = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if ns.action in ("up", "job", "run") and (why := unavailable()):
            raise TestbedError(f"cannot build a testbed here: {why}")
        if ns.action == "up":
            tb = Testbed(ns.hosts, ns.ranks_per_host, ns.rate, keep=True).up()
            tb.detach()
            print(tb.prefix)
            _print_status(tb, False)
            return 0
        if ns.action == "status":
            if ns.name:
                _print_status(Testbed.attach(ns.name), ns.json)
                return 0
            found = list_testbeds()
            if ns.json:
                print(json.dumps(found, indent=1))
            for prefix in sorted(found):
                print(prefix)
            return 0
        if ns.action == "run":
            argv_ = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
            if not argv_:
                raise TestbedError("no command: twisternet testbed run NAME HOST -- CMD ...")
            cmd = Testbed.attach(ns.name).command(ns.host, argv_)
            sys.stdout.flush()
            os.execvp(cmd[0], cmd)
        if ns.action == "job":
            return _job(ns)
        if ns.action == "down":
            if not ns.names and not ns.all:
                raise TestbedError("name the testbeds to remove, or pass --all")
            swept = sweep_stale()
            names = sorted(list_testbeds()) if ns.all else ns.names
            problems = [p for name in names for p in remove_testbed(name)]
            for name in names + swept:
                print(f"removed {name}")
            if problems:
                raise TestbedError("; ".join(problems))
            return 0
    except TwisternetError as e:
        sys.stderr.write(f"twisternet testbed: error: {e}\n")
        return 1
    return 2
