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


def test_helpers_are_spawned_not_forked(monkeypatch) -> None:
    """gRPC is loaded in this (pytest) process; a fork would run its fork handlers in the child, which
    abort it when gRPC threads are busy. Helpers are started with posix_spawn: no fork handlers run."""
    import grpc  # noqa: F401 - loaded, as in a rank that talks P4Runtime
    from innet.service import start_ps, stop_process
    spawned: list[str] = []
    real = os.posix_spawn

    def recording(path, argv, env, **kw):
        spawned.append(path)
        return real(path, argv, env, **kw)

    monkeypatch.setattr(os, "posix_spawn", recording)
    proc, _ = start_ps(3, 2, ("127.0.0.1", 9))
    try:
        assert spawned == [sys.executable]
    finally:
        stop_process(proc)


@pytest.mark.timeout(120)
def test_the_launcher_does_not_load_grpc_before_forking_workers() -> None:
    """``twisternet run --innet`` forks its workers with a preexec_fn after starting the switch: gRPC
    must not be loaded in the launcher then."""
    code = textwrap.dedent('''
        import sys
        from twisternet.launcher import _start_innet_switch
        env = {}
        sw = _start_innet_switch("127.0.0.1", env, "job token")
        try:
            print("GRPC", "grpc" in sys.modules, "TWISTERNET_INNET_P4RUNTIME" in env, flush=True)
        finally:
            sw.close()
    ''')
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "GRPC False True" in p.stdout, p.stdout + p.stderr


@pytest.mark.timeout(180)
def test_cluster_mode_rank0_killed_leaves_no_switch_or_ps(tmp_path) -> None:
    """``twisternet master`` + ``twisternet worker`` x 2; rank 0 (which started the switch and PS) is
    SIGKILLed: both helpers exit, and rank 1 fails (lost peer) instead of waiting for its timeout."""
    import re
    script = Path(__file__).parent / "scripts" / "cluster_rank0_killed.py"
    token = tmp_path / "token"
    token.write_text("cluster-token-0123456789")
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWISTERNET_")}
    env.update(PYTHONPATH=str(ROOT), TWISTERNET_HEARTBEAT_INTERVAL="0.2", TWISTERNET_PEER_TIMEOUT="3")
    master = subprocess.Popen([sys.executable, "-m", "twisternet", "master", "--world", "2", "--host", "127.0.0.1",
                               "--token-file", str(token)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    workers: list[subprocess.Popen] = []
    pids: list[int] = []
    try:
        m = re.search(r"listening on [\d.]+:(\d+)", master.stderr.readline())
        assert m
        for rank in (0, 1):
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "twisternet", "worker", "--master", f"127.0.0.1:{m.group(1)}",
                 "--token-file", str(token), "--rank", str(rank), str(script)],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        out0 = []
        for line in workers[0].stdout:
            out0.append(line)
            if line.startswith("PIDS"):
                pids = [int(x) for x in line.split()[1:]]
            if line.startswith("READY"):
                break
        assert pids, "".join(out0)
        assert all(_alive(p) for p in pids)
        workers[0].kill()
        workers[0].wait(10)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "the switch/PS outlived rank 0"
        rest = workers[1].communicate(timeout=50)[0]
        assert workers[1].returncode != 0 and "lost" in rest.lower(), rest[-2000:]
    finally:
        for p in (*workers, master):
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
