"""Tests of ``twisternet run`` / ``worker`` / the CLI with real processes (twisternet.launcher, cli)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from twisternet import cli
from twisternet.bootstrap import Master
from twisternet.errors import TwisternetError
from twisternet.launcher import describe_exit, exit_status

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("scripts") / "boot_worker.py")
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
for _k in ("TWISTERNET_MASTER", "TWISTERNET_TOKEN", "TWISTERNET_RANK", "TWISTERNET_WORLD"):
    ENV.pop(_k, None)


def launch(*args: str, timeout: float = 60) -> tuple[int, bytes, bytes, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "twisternet", "run", *args], cwd=ROOT, env=ENV,
                       capture_output=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def pids_in(piddir: Path, n: int, timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(piddir.glob("*.pid"))
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError(f"workers did not start: {list(piddir.iterdir())}")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_no_orphans(pids: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if alive(p)]
    for p in survivors:
        os.kill(p, signal.SIGKILL)
    assert not survivors, f"workers outlived the launcher: {survivors}"


def test_exit_helpers() -> None:
    assert exit_status(-9) == 137 and exit_status(3) == 3 and exit_status(0) == 0
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(2) == "exited with code 2"


def test_output_is_prefixed_by_rank_line_by_line(tmp_path: Path) -> None:
    rc, out, err, _ = launch("-n", "3", WORKER, "--lines", "40", "--piddir", str(tmp_path))
    assert rc == 0, err.decode(errors="replace")
    line_re = re.compile(rb"^\[(\d)\] (out|err) (\d) line (\d+) ([xy]+)$")
    for stream, kind, fill in ((out, b"out", b"x" * 200), (err, b"err", b"y" * 200)):
        counts = {0: 0, 1: 0, 2: 0}
        for line in stream.splitlines():
            m = line_re.match(line)
            if m is None:
                assert stream is err and line.startswith(b"twisternet"), line  # launcher/log lines only
                continue
            assert m.group(1) == m.group(3), line  # the prefix names the rank that wrote the line
            assert m.group(2) == kind and m.group(5) == fill, line  # stdout->stdout, whole lines only
            counts[int(m.group(1))] += 1
        assert counts == {0: 40, 1: 40, 2: 40}
    assert_no_orphans(pids_in(tmp_path, 3))


def test_output_is_byte_safe_and_completes_partial_lines() -> None:
    rc, out, err, _ = launch("-n", "3", WORKER, "--lines", "0", "--mode", "0=binary", "--mode", "1=partial")
    assert rc == 0, err
    assert b"[0] bytes \xff\xfe\x00 end\n" in out
    assert b"[1] no newline at the end\n" in out


def test_exit_code_is_the_first_nonzero_and_survivors_learn_of_it(tmp_path: Path) -> None:
    rc, out, err, elapsed = launch("-n", "3", WORKER, "--lines", "1", "--mode", "1=exit3",
                                   "--default", "wait_lost", "--piddir", str(tmp_path))
    assert rc == 3, err
    text = err.decode()
    assert "twisternet: rank 1 exited with code 3" in text
    # the survivors were told by the master (report_lost / dropped link) and exited by themselves
    assert "[0] rank 0 saw a lost peer" in text and "[2] rank 2 saw a lost peer" in text
    assert "SIGTERM" not in text
    assert elapsed < 20
    assert_no_orphans(pids_in(tmp_path, 3))


def test_run_in_process_with_a_setup_hook_and_custom_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    from twisternet.launcher import run
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    installed = []
    # what SIGINT does before the run: Python's default, or SIG_IGN when started as a background
    # job of a non-interactive shell (as CI may be)
    before = signal.getsignal(signal.SIGINT)

    def setup(master: Master) -> None:
        installed.append(master.world)
        master.add_service("echo", lambda src, msg: [(src, {"echo": msg["x"] * 10})])
    out, err = io.BytesIO(), io.BytesIO()
    rc = run(3, WORKER, ["--lines", "0", "--default", "service"], grace=2, stdout=out, stderr=err,
             setup=setup)
    assert rc == 0, err.getvalue()
    assert installed == [3]
    assert sorted(out.getvalue().splitlines()) == [b"[0] ECHO 0 service", b"[1] ECHO 10 service",
                                                   b"[2] ECHO 20 service"]
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_no_fork_handlers_run_in_workers_of_a_process_that_loaded_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    """With gRPC loaded in the calling process, workers are spawned without a preexec function (which
    would make subprocess fork and run gRPC's fork handlers in them: SIGABRT while its threads are
    busy); without gRPC they get the one that ties them to the launcher (PR_SET_PDEATHSIG, Linux)."""
    import io
    import types

    from twisternet import launcher
    monkeypatch.delitem(sys.modules, "grpc", raising=False)    # (earlier tests of this process load it)
    if sys.platform.startswith("linux"):
        assert launcher.spawn_preexec() is not None
    monkeypatch.setitem(sys.modules, "grpc", types.ModuleType("grpc"))
    assert launcher.spawn_preexec() is None
    seen: list[object] = []
    popen = subprocess.Popen

    def spy(*args: object, **kwargs: object) -> subprocess.Popen:
        seen.append(kwargs.get("preexec_fn"))
        return popen(*args, **kwargs)  # type: ignore[call-overload]
    monkeypatch.setattr(launcher.subprocess, "Popen", spy)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    out, err = io.BytesIO(), io.BytesIO()
    rc = launcher.run(2, WORKER, ["--lines", "1"], grace=2, stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    assert seen == [None, None]


def test_worker_exiting_before_joining_fails_the_others_fast() -> None:
    rc, out, err, elapsed = launch("-n", "3", WORKER, "--mode", "1=quit", "--default", "ok")
    assert rc == 1, err
    assert err.count(b"PeerLostError: peer rank 1 was lost") == 2, err
    assert elapsed < 15


def test_self_killed_worker_is_named_and_others_stopped_after_grace(tmp_path: Path) -> None:
    rc, out, err, elapsed = launch("--grace", "1", "-n", "3", WORKER, "--lines", "1", "--mode", "1=selfkill",
                                   "--default", "hold", "--piddir", str(tmp_path))
    assert rc == 128 + signal.SIGKILL, err
    text = err.decode()
    assert "twisternet: rank 1 was killed by SIGKILL" in text
    assert "stopping rank(s) 0, 2 with SIGTERM" in text
    assert elapsed < 15
    assert_no_orphans(pids_in(tmp_path, 3))


def test_worker_ignoring_sigterm_gets_sigkill(tmp_path: Path) -> None:
    rc, out, err, elapsed = launch("--grace", "0.5", "-n", "2", WORKER, "--lines", "0", "--mode", "1=exit2",
                                   "--default", "ignore_term", "--piddir", str(tmp_path))
    assert rc == 2, err
    assert "rank(s) 0 still running; sending SIGKILL" in err.decode()
    assert 3.0 < elapsed < 20
    assert_no_orphans(pids_in(tmp_path, 2))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signalled_launcher_leaves_no_workers(tmp_path: Path, sig: signal.Signals) -> None:
    p = subprocess.Popen([sys.executable, "-m", "twisternet", "run", "-n", "3", WORKER, "--lines", "0",
                          "--default", "hold", "--piddir", str(tmp_path)], cwd=ROOT, env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        pids = pids_in(tmp_path, 3)
        time.sleep(0.5)
        assert all(alive(pid) for pid in pids)
        p.send_signal(sig)
        rc = p.wait(15)
        assert rc == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig)
        # SIGKILL'd launcher: its workers die by PR_SET_PDEATHSIG
        assert_no_orphans(pids)
    finally:
        p.kill()
        p.wait(5)


def test_worker_command_runs_the_script_and_forwards_its_exit_code(tmp_path: Path) -> None:
    token = "worker-command-token"
    master = Master(1, token.encode(), "127.0.0.1", 0, peer_timeout=5, heartbeat_interval=0.2).start()
    token_file = tmp_path / "tok"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    try:
        p = subprocess.run([sys.executable, "-m", "twisternet", "worker", "--master",
                            f"127.0.0.1:{master.address[1]}", "--token-file", str(token_file), "--rank", "0",
                            "--world", "1", WORKER, "--lines", "1", "--default", "exit4"],
                           cwd=ROOT, env=ENV, capture_output=True, timeout=30)
        assert p.returncode == 4, p.stderr
        assert p.stdout.startswith(b"out 0 line 0 ")  # unprefixed: it is the script's own output
    finally:
        master.stop()
    p = subprocess.run([sys.executable, "-m", "twisternet", "worker", WORKER], cwd=ROOT, env=ENV,
                       capture_output=True, timeout=30)
    assert p.returncode == 2 and b"no master address" in p.stderr


def test_cli_errors_and_delegates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(cli.DELEGATES, "nothing-here", ("twisternet_no_such_module.sub:main", "a test tool"))
    assert cli.main(["nothing-here", "--x"]) == 1
    assert "not installed" in capsys.readouterr().err

    fake = tmp_path / "fake_tool.py"
    fake.write_text("def main(argv):\n    print('got', argv)\n    return 5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.DELEGATES, "fake", ("fake_tool:main", "a test tool"))
    assert cli.main(["fake", "-n", "3", "--help"]) == 5
    assert "got ['-n', '3', '--help']" in capsys.readouterr().out

    monkeypatch.delenv("TWISTERNET_TOKEN", raising=False)
    assert cli.main(["master", "--world", "2", "--port", "0"]) == 1
    assert "no job token" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["run", "-n", "0", "x.py"])
    assert cli.main([]) == 2


def test_token_file_is_created_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "token"
    with pytest.raises(TwisternetError, match="cannot create token file"):
        cli.read_or_create_token(path)  # missing directory: a clear error, not a crash
    path = tmp_path / "token"
    token, created = cli.read_or_create_token(path)
    assert created and len(token) >= 32 and (path.stat().st_mode & 0o777) == 0o600
    assert cli.read_or_create_token(path) == (token, False)


def test_cli_refuses_missing_script_and_missing_worker_token_file(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "twisternet", "run", "-n", "2", str(tmp_path / "nope.py")],
                       cwd=ROOT, env=ENV, capture_output=True, timeout=30)
    assert p.returncode == 2 and b"no such script" in p.stderr
    p = subprocess.run([sys.executable, "-m", "twisternet", "worker", "--master", "127.0.0.1:9",
                        "--token-file", str(tmp_path / "missing"), WORKER], cwd=ROOT, env=ENV,
                       capture_output=True, timeout=30)
    assert p.returncode == 1 and b"does not exist" in p.stderr
    assert not (tmp_path / "missing").exists()  # a worker never invents a token


def test_master_command_stops_on_sigterm_and_tells_workers(tmp_path: Path) -> None:
    from twisternet.bootstrap import join
    env = {**ENV, "TWISTERNET_TOKEN": "env-token-12345", "TWISTERNET_HEARTBEAT_INTERVAL": "0.2",
           "TWISTERNET_PEER_TIMEOUT": "3"}
    p = subprocess.Popen([sys.executable, "-m", "twisternet", "master", "--world", "1", "--host", "127.0.0.1"],
                         cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()  # type: ignore[union-attr]
        m = re.search(r"listening on [\d.]+:(\d+)", line)
        assert m, line
        session = join(f"127.0.0.1:{m.group(1)}", b"env-token-12345", listen={}, timeout=10,
                       heartbeat_interval=0.2, peer_timeout=3)
        events: list[dict] = []
        session.on_event(events.append)
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 130
        deadline = time.monotonic() + 3
        while not events and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [e["type"] for e in events] == ["master_shutdown"]
        session.close()
    finally:
        p.kill()
        p.wait(5)


def test_a_worker_that_never_joins_ends_the_job_with_the_masters_reason():
    """`twisternet run`'s master gives up after connect_timeout and tells the joined workers who came."""
    from tests.jobs import run_tcp
    script = Path(__file__).parent / "scripts" / "one_rank_never_joins.py"
    start = time.monotonic()
    proc = run_tcp(2, script, timeout=120, grace=2, TWISTERNET_CONNECT_TIMEOUT="5")
    assert proc.returncode != 0
    assert "JOINED" not in proc.stdout
    assert "only 1 of 2 workers joined" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 60, proc.stderr[-3000:]
