"""The testbed itself: hosts that look like separate machines, shaped links, links down/up, the command
line, and that everything it creates goes away (also on errors, Ctrl-C and a killed owner)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import require_emulated_cluster
from twisternet.testbed import STATE_ROOT, Testbed, TestbedError, cluster, list_testbeds, unavailable

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def leftovers(prefix: str) -> list[str]:
    """Namespaces, mounts and state of ``prefix`` still present."""
    found = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
             if ns.startswith(prefix)]
    found += [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if prefix in line]
    if (STATE_ROOT / prefix).exists():
        found.append(str(STATE_ROOT / prefix))
    return found


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "twisternet", "testbed", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_unavailable_says_why_without_root(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in (unavailable() or "")
    with pytest.raises(TestbedError, match="root"):
        Testbed(2).up()


def test_hosts_look_like_separate_machines(testbed: Testbed) -> None:
    probe = ("import socket, os, json; from twisternet.bootstrap import host_id; "
             "open('/dev/shm/tntb-probe', 'a').close(); "
             "print(json.dumps([socket.gethostname(), host_id(), sorted(os.listdir('/dev/shm'))]))")
    seen = []
    for h in range(testbed.hosts):
        r = testbed.run(h, [sys.executable, "-c", probe], env=testbed.job_env(), check=True)
        seen.append(json.loads(r.stdout))
    assert [s[0] for s in seen] == testbed.hostnames
    assert len({s[1] for s in seen}) == testbed.hosts                     # host detection: H machines
    assert all(s[2] == ["tntb-probe"] for s in seen)                       # own, empty /dev/shm each
    assert not Path("/dev/shm/tntb-probe").exists()                        # not the machine's /dev/shm
    addr = testbed.run(1, ["ip", "-o", "-4", "addr", "show", "dev", "eth0"], check=True).stdout
    assert testbed.addresses[1] + "/24" in addr


def test_links_are_shaped_on_both_ends(testbed: Testbed) -> None:
    for h, ns in enumerate(testbed.namespaces):
        host_side = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True).stdout
        bridge_side = subprocess.run(["ip", "netns", "exec", testbed.bridge_ns, "tc", "qdisc", "show", "dev",
                                      f"v{h}"], capture_output=True, text=True).stdout
        for out in (host_side, bridge_side):
            assert "tbf" in out and "rate 1Gbit" in out, out


def test_link_down_cuts_the_host_off_and_up_restores_it(testbed: Testbed) -> None:
    server = [sys.executable, "-c", "import socket; s = socket.create_server(('0.0.0.0', 47001)); "
              "print('LISTENING', flush=True); s.settimeout(60)\nwhile True: s.accept()[0].close()"]
    client = [sys.executable, "-c", f"import socket; socket.create_connection(('{testbed.addresses[0]}', 47001), "
              "timeout=5).close(); print('CONNECTED')"]
    srv = testbed.popen(0, server)
    try:
        assert srv.stdout.readline().strip() == "LISTENING"
        assert "CONNECTED" in testbed.run(1, client).stdout
        before = testbed.counters()[1]
        testbed.link_down(1)
        r = testbed.run(1, client)
        assert r.returncode != 0 and "CONNECTED" not in r.stdout
        assert testbed.status()["hosts"][1]["link"] == "DOWN"
        testbed.link_up(1)
        assert "CONNECTED" in testbed.run(1, client).stdout
        assert testbed.counters()[1].tx_bytes > before.tx_bytes
    finally:
        testbed.link_up(1)
        srv.kill()
        srv.wait()


def test_contiguous_ranks_put_host_h_on_ranks_hk_to_hk_plus_k(testbed: Testbed, tmp_path) -> None:
    script = tmp_path / "where.py"
    script.write_text("import socket, twisternet as tn\nwith tn.init() as ctx:\n"
                      "    print('WHERE', ctx.rank, socket.gethostname(), flush=True)\n")
    res = testbed.twisternet_job(script, contiguous_ranks=True, timeout=120).check()
    where = dict(line.split()[1:] for line in res.stdout.splitlines() if line.startswith("WHERE"))
    k = testbed.ranks_per_host
    assert where == {str(r): testbed.hostnames[r // k] for r in range(testbed.hosts * k)}, where


def test_service_hosts_get_no_ranks_and_their_own_link_rate(emulated_cluster, tmp_path) -> None:
    """A service host (a switch's or a PS's) is a host like the others on the bridge, with its own link
    rate (here one unshaped, one at 200 Mbit/s, the rank hosts at 100 Mbit/s), and jobs put no rank there."""
    tb = emulated_cluster(hosts=2, ranks_per_host=1, rate="100mbit", service_hosts=2, service_rate=[None, "200mbit"])
    svc = tb.service_host_ids[0]
    assert tb.service_host_ids == [2, 3] and tb.hostnames[2:] == ["svc0", "svc1"]
    rates = {0: "rate 100Mbit", 1: "rate 100Mbit", 2: None, 3: "rate 200Mbit"}
    for h, ns in enumerate(tb.namespaces):
        host_side = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True).stdout
        bridge_side = subprocess.run(["ip", "netns", "exec", tb.bridge_ns, "tc", "qdisc", "show", "dev", f"v{h}"],
                                     capture_output=True, text=True).stdout
        for out in (host_side, bridge_side):
            want = rates[h]
            assert ("tbf" in out) == (want is not None) and (want is None or want in out), (h, out)
    assert tb.run(svc, ["hostname"], check=True).stdout.strip() == "svc0"
    server = [sys.executable, "-c", "import socket; s = socket.create_server(('0.0.0.0', 47002)); "
              "print('LISTENING', flush=True); s.settimeout(60)\nwhile True: s.accept()[0].close()"]
    srv = tb.popen(svc, server)
    try:
        assert srv.stdout.readline().strip() == "LISTENING"
        client = [sys.executable, "-c", f"import socket; socket.create_connection(('{tb.addresses[svc]}', 47002), "
                  "timeout=5).close(); print('CONNECTED')"]
        assert "CONNECTED" in tb.run(1, client).stdout
    finally:
        srv.kill()
        srv.wait()
    res = tb.twisternet_job(Path(__file__).parent / "scripts" / "whoami.py", timeout=120).check()
    assert sorted(p.host for p in res.workers) == [0, 1], res.describe()
    assert [h["role"] for h in tb.status()["hosts"]] == ["ranks", "ranks", "service", "service"]


def test_everything_is_removed_on_error_and_interrupt() -> None:
    require_emulated_cluster()
    for exc in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(exc), Testbed(2, 1, "100mbit") as tb:
            prefix = tb.prefix
            job = tb.start_processes([(0, ["sleep", "300"]), (1, ["sleep", "300"])])
            assert leftovers(prefix)
            raise exc("boom")
        assert leftovers(prefix) == []
        assert all(c.proc.poll() is not None for c in job.main)


def test_a_killed_owners_testbed_is_swept_by_the_next(emulated_cluster) -> None:
    code = textwrap.dedent("""
        import os, sys
        from twisternet.testbed import Testbed
        tb = Testbed(2, 1, None).up()
        print(tb.prefix, flush=True)
        os.kill(os.getpid(), 9)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    prefix = p.stdout.strip()
    assert prefix.startswith("tntb-") and leftovers(prefix), p.stderr
    emulated_cluster(hosts=1, ranks_per_host=1)
    assert leftovers(prefix) == []


def test_remove_refuses_names_that_are_not_testbeds() -> None:
    with pytest.raises(TestbedError, match="not a testbed name"):
        cluster._remove("some-other-netns")


def test_cli_up_status_run_job_down(tmp_path) -> None:
    require_emulated_cluster()
    r = cli("up", "--hosts", "2", "--rate", "100mbit")
    assert r.returncode == 0, r.stderr
    name = r.stdout.split()[0]
    try:
        assert name in cli("status").stdout
        st = json.loads(cli("status", name, "--json").stdout)
        assert [h["hostname"] for h in st["hosts"]] == ["host0", "host1"] and st["rate"] == "100mbit"
        r = cli("run", name, "1", "--", "hostname")
        assert (r.returncode, r.stdout.strip()) == (0, "host1"), r.stderr
        script = tmp_path / "hello.py"
        script.write_text("import socket, twisternet as tn\nwith tn.init() as ctx:\n"
                          "    print('HELLO', ctx.rank, ctx.world, socket.gethostname(), flush=True)\n")
        r = cli("job", "--name", name, "-k", "2", str(script))
        assert r.returncode == 0, r.stdout + r.stderr
        hellos = sorted(line.split("HELLO ")[1] for line in r.stdout.splitlines() if "HELLO " in line)
        assert len(hellos) == 4 and sorted(h.split()[2] for h in hellos) == ["host0", "host0", "host1", "host1"]
        assert "bytes through the links" in r.stderr
    finally:
        r = cli("down", name)
    assert r.returncode == 0 and f"removed {name}" in r.stdout, r.stderr
    assert leftovers(name) == [] and name not in list_testbeds()
    assert cli("down", "not-a-testbed").returncode == 1


def test_sigterm_removes_everything() -> None:
    """``timeout 60 python script-with-a-testbed.py`` ending in SIGTERM leaves nothing behind."""
    require_emulated_cluster()
    code = textwrap.dedent("""
        import sys, time
        from twisternet.testbed import Testbed
        with Testbed(2, 1, "100mbit") as tb:
            tb.start_processes([(0, ["sleep", "300"])])
            print(tb.prefix, flush=True)
            time.sleep(300)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    prefix = p.stdout.readline().strip()
    assert prefix.startswith("tntb-") and leftovers(prefix)
    p.terminate()
    assert p.wait(60) == 128 + 15
    assert leftovers(prefix) == []


def _timed_out_one_process_job(script: str) -> tuple[subprocess.Popen, Any, threading.Event]:
    """Run ``script`` (which prints READY, then blocks) as a one-process testbed Job, let the job time
    out with SIGUSR1 as its dump signal; ``(process, JobResult, whether the job reported its end)``.
    No testbed needed: Job only asks its host for counters and says when it ended."""
    from twisternet.testbed.processes import Job, OutputCollector

    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    ended = threading.Event()

    class Host:  # what Job needs of a Testbed
        def counters(self) -> dict:
            return {}

        def _job_ended(self, job: Job) -> None:
            ended.set()

    collector = OutputCollector(proc, 0, "worker", 0)
    job = Job(Host(), [collector])  # type: ignore[arg-type]
    collector.wait_for_line(re.compile("READY"), 60)
    return proc, job.wait(0.0, dump_signal=signal.SIGUSR1), ended


def test_a_timed_out_job_dumps_the_stacks_of_its_python_processes() -> None:
    """``Job.wait(dump_signal=...)``: a job past its deadline first shows where each process that asked
    for dumps is stuck (its faulthandler output is in the result), then is killed."""
    script = ("import faulthandler, signal, threading\n"
              "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
              "def blocked_here():\n"
              "    print('READY', flush=True)\n"
              "    threading.Event().wait()\n"
              "blocked_here()\n")
    proc, res, ended = _timed_out_one_process_job(script)
    assert res.timed_out and ended.is_set()
    err = res.procs[0].stderr
    assert "Current thread 0x" in err and "blocked_here" in err, err
    assert proc.poll() is not None, "the job was not killed after its dump"


def test_a_dump_preempted_after_its_header_is_waited_for_whole() -> None:
    """A dump whose writer is held up after its first line (as a busy machine can preempt it) is still
    read whole before the job is killed: here a Python handler writes the header, keeps its CPU busy for
    0.3 s, then writes the rest."""
    script = ("import signal, sys, threading, time\n"
              "def dump(signum, frame):\n"
              "    sys.stderr.write('Current thread 0x1 (most recent call first):\\n'); sys.stderr.flush()\n"
              "    end = time.monotonic() + 0.3\n"
              "    while time.monotonic() < end: pass\n"
              "    sys.stderr.write('  File \"x.py\", line 1 in blocked_here\\nDUMP-END\\n'); sys.stderr.flush()\n"
              "signal.signal(signal.SIGUSR1, dump)\n"
              "print('READY', flush=True)\n"
              "threading.Event().wait()\n")
    _, res, _ = _timed_out_one_process_job(script)
    assert res.timed_out
    assert "DUMP-END" in res.procs[0].stderr, res.procs[0].stderr
