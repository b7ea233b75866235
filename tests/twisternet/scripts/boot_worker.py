"""Test helper for the launcher: one worker of ``twisternet run``; what it does depends on its rank.

Usage: boot_worker.py [--mode R=MODE ...] [--default MODE] [--piddir DIR] [--lines N]
Modes: ok (print to stdout and stderr, leave cleanly), exitN (print, exit with code N without leaving),
selfkill (SIGKILL itself), wait_lost (exit 1 once the master reports a lost peer, like PeerLostError),
hold (stay until killed), ignore_term (ignore SIGTERM and stay), partial (print a line without newline),
binary (print bytes that are not UTF-8), quit (exit 0 before joining), service (echo through
the master's "echo" service).
"""

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path


from twisternet.bootstrap import join


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", action="append", default=[])
    ap.add_argument("--default", default="ok")
    ap.add_argument("--piddir")
    ap.add_argument("--lines", type=int, default=3)
    ns = ap.parse_args()
    rank = int(os.environ["TWISTERNET_RANK"])
    world = int(os.environ["TWISTERNET_WORLD"])
    modes = dict(m.split("=", 1) for m in ns.mode)
    mode = modes.get(str(rank), ns.default)
    if ns.piddir:
        Path(ns.piddir, f"{rank}.pid").write_text(str(os.getpid()))
    if mode == "quit":  # leave before joining the job at all
        return 0
    session = join(os.environ["TWISTERNET_MASTER"], os.environ["TWISTERNET_TOKEN"].encode(),
                   listen={"rank_hint": rank}, rank=rank, world=world, timeout=30,
                   heartbeat_interval=0.2, peer_timeout=5)
    lost = threading.Event()
    session.on_event(lambda ev: lost.set() if ev.get("type") == "peer_lost" else None)
    assert session.rank == rank
    for i in range(ns.lines):
        print(f"out {rank} line {i} " + "x" * 200)
        print(f"err {rank} line {i} " + "y" * 200, file=sys.stderr)
    sys.stdout.flush(), sys.stderr.flush()
    if mode == "ok":
        session.close()
        return 0
    if mode.startswith("exit"):
        return int(mode[4:])
    if mode == "selfkill":
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "wait_lost":
        if lost.wait(30):
            print(f"rank {rank} saw a lost peer", file=sys.stderr, flush=True)
            session.close()
            return 1
        return 9
    if mode == "service":  # round trip through a master-side service installed by the launcher
        replies = []
        got = threading.Event()
        session.on_event(lambda ev: (replies.append(ev), got.set()) if ev.get("service") == "echo" else None)
        session.send({"service": "echo", "x": rank})
        if not got.wait(10):
            return 8
        print(f"ECHO {replies[0]['echo']} {replies[0]['type']}", flush=True)
        session.close()
        return 0
    if mode == "partial":
        sys.stdout.write("no newline at the end")
        session.close()
        return 0
    if mode == "binary":
        sys.stdout.buffer.write(b"bytes \xff\xfe\x00 end\n")
        session.close()
        return 0
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:  # hold / ignore_term
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
