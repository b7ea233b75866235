"""The switch and PS a rank starts end with that rank, however it ends (here: SIGKILL), and never see
the job token: what ``twisternet worker`` (cluster mode) relies on when rank 0 is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PARENT = textwrap.dedent('''
    import sys, threading, time
    from innet.service import InnetService, free_udp_port

    def launch():
        box.append(InnetService.launch(9, [("127.0.0.1", 40001), ("127.0.0.1", 40002)],
                                       switch_port=free_udp_port(), ps_port=free_udp_port()))

    box = []
    if sys.argv[1] == "thread":          # started from a thread that has ended by the time we die
        t = threading.Thread(target=launch)
        t.start()
        t.join()
    else:
        launch()
    svc = box[0]
    print(f"PIDS {svc.switch_proc.pid} {svc.ps_proc.pid}", flush=True)
    time.sleep(600)
''')


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"     # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["main", "thread"])
def test_helpers_exit_when_their_parent_is_killed(where: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TWISTERNET_TOKEN": "the job token"}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, where], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    pids: list[int] = []
    try:
        line = parent.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(x) for x in line.split()[1:]]
        for pid in pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert b"TWISTERNET_TOKEN" not in environ and b"the job token" not in environ
        parent.kill()                                   # SIGKILL: no atexit, no finalizer runs
        parent.wait(10)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "the switch/PS outlived the rank that started them"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        parent.stdout.close()
