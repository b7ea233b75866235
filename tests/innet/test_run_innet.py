"""``twisternet run --innet`` and the P4Runtime controller that places jobs on a shared switch.

The controller is driven against an in-process SoftwareSwitch behind the real P4Runtime server, and what
it wrote is checked through the switch's own control view; the launcher test runs a real job whose two
operations share the switch the launcher started.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from innet.control import JobEntry, MulticastGroup
from innet.controller import ControllerError, JobPlacement, P4RuntimeController
from innet.p4runtime import serve
from innet.switch import SoftwareSwitch
from twisternet.config import load_config
from twisternet.errors import ConfigError, LaunchError

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "shared_switch_job.py"


@pytest.fixture
def switch_and_controller():
    switch = SoftwareSwitch(num_aggregators=16, value_count=4)
    server = serve(switch, 0)
    try:
        yield switch, P4RuntimeController(server.address, timeout=5.0)
    finally:
        server.stop(grace=0)


WORKERS = [("127.0.0.1", 40001), ("127.0.0.1", 40002), ("127.0.0.1", 40003)]
PS = ("127.0.0.1", 40100)


def test_place_and_remove_a_job(switch_and_controller) -> None:
    switch, ctl = switch_and_controller
    placement = ctl.place_job(1, WORKERS, PS)
    assert placement == JobPlacement(1, (1, 2, 3), 4)
    assert switch.read_ports() == {1: WORKERS[0], 2: WORKERS[1], 3: WORKERS[2], 4: PS}
    assert list(switch.read_jobs()) == [JobEntry(1, fan_in=3, ps_port=4, mcast_group=1, level=0)]
    assert list(switch.read_mcast_groups()) == [MulticastGroup(1, (1, 2, 3))]
    assert list(switch.read_members()) == [(1, 1), (1, 2), (1, 3)]      # the source check's entries
    assert ctl.job_ids() == {1}

    second = ctl.place_job(2, WORKERS[:2], PS)      # the next job gets the next free ports
    assert second == JobPlacement(2, (5, 6), 7)
    ctl.remove_job(placement)
    assert list(switch.read_jobs()) == [JobEntry(2, fan_in=2, ps_port=7, mcast_group=2, level=0)]
    assert set(switch.read_ports()) == {5, 6, 7}
    assert list(switch.read_members()) == [(2, 5), (2, 6)]
    ctl.remove_job(placement)                       # removing twice is harmless
    ctl.remove_job(second)
    assert not switch.read_ports() and not list(switch.read_jobs()) and not list(switch.read_mcast_groups())


def test_the_controller_reads_the_switchs_packet_width(switch_and_controller) -> None:
    switch, ctl = switch_and_controller
    assert ctl.packet_values() == switch.value_count == 4
    wide = SoftwareSwitch(num_aggregators=16, value_count=364)
    server = serve(wide, 0)
    try:
        assert P4RuntimeController(server.address, timeout=5.0).packet_values() == 364
    finally:
        server.stop(grace=0)


def test_free_job_ids_are_random_and_free(switch_and_controller) -> None:
    """Ids are not predictable (not the lowest free one) and never one in use or excluded."""
    _, ctl = switch_and_controller
    for job in range(1, 101):
        ctl.place_job(job, WORKERS[:1], PS) if job <= 3 else None
    seen = {ctl.free_job_id(exclude=range(4, 200)) for _ in range(30)}
    assert seen <= set(range(200, 256)) and len(seen) > 5


def test_a_taken_job_id_fails_cleanly(switch_and_controller) -> None:
    switch, ctl = switch_and_controller
    ctl.place_job(7, WORKERS, PS)
    ports_before = switch.read_ports()
    with pytest.raises(ControllerError, match="already exists"):
        ctl.place_job(7, WORKERS[:2], PS)
    assert switch.read_ports() == ports_before       # the failed placement left nothing behind
    assert len(list(switch.read_jobs())) == 1


def test_limits_are_reported(switch_and_controller) -> None:
    _, ctl = switch_and_controller
    with pytest.raises(ControllerError, match="1..32 workers"):
        ctl.place_job(1, [("127.0.0.1", 41000 + r) for r in range(33)], PS)
    with pytest.raises(ControllerError, match="1..32 workers"):
        ctl.place_job(1, [], PS)
    # fill the 9-bit port space: 511 usable port numbers; 15 jobs of 32 workers + PS take 495
    for job in range(1, 16):
        ctl.place_job(job, [("127.0.0.1", 41000 + r) for r in range(32)], PS)
    with pytest.raises(ControllerError, match="16 free ports, the job needs 33"):
        ctl.place_job(16, [("127.0.0.1", 41000 + r) for r in range(32)], PS)


def test_unreachable_switch_is_an_error_not_a_hang() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]        # nothing listens here once closed
    ctl = P4RuntimeController(f"127.0.0.1:{port}", timeout=2.0)
    with pytest.raises(ControllerError):
        ctl.free_job_id()


def test_config_keys_for_a_shared_switch() -> None:
    cfg = load_config(env={"TWISTERNET_INNET_SWITCH": "10.0.0.1:9000",
                           "TWISTERNET_INNET_P4RUNTIME": "10.0.0.1:9559", "TWISTERNET_INNET_HOST": "10.0.0.2"})
    assert (cfg.innet_switch, cfg.innet_p4runtime, cfg.innet_host) == ("10.0.0.1:9000", "10.0.0.1:9559",
                                                                        "10.0.0.2")
    with pytest.raises(ConfigError, match="innet_p4runtime"):
        load_config(env={"TWISTERNET_INNET_SWITCH": "10.0.0.1:9000"})
    with pytest.raises(ConfigError, match="innet_switch"):
        load_config(innet_switch="nohostport", innet_p4runtime="h:1")


def test_launcher_needs_the_innet_extra(monkeypatch, tmp_path) -> None:
    from twisternet.launcher import run
    monkeypatch.setitem(sys.modules, "grpc", None)   # as if grpcio were not installed
    script = tmp_path / "noop.py"
    script.write_text("print('should not run')\n")
    with pytest.raises(LaunchError, match=r"twisternet\[innet\]"):
        run(1, str(script), innet=True)


def test_run_innet_shares_one_switch_between_operations() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "twisternet", "run", "--innet", "-n", "3", str(SCRIPT)],
                       capture_output=True, text=True, timeout=100, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = re.findall(r"RESULT rank=(\d) op=(\d) size=\d+ ok=(\w+) fallback=(\w+) own_switch=(\w+) job=(\d+)",
                         p.stdout)
    assert len(results) == 12, p.stdout
    assert all(ok == "True" and fb == "False" and own == "False" for _, _, ok, fb, own, _ in results), p.stdout
    jobs = {(op, job) for _, op, _, _, _, job in results}
    assert len(jobs) == 2 and len({job for _, job in jobs}) == 2                      # two jobs, one switch
    m = re.search(r"JOBS \[(\d+), (\d+)\] on_switch=(\[.*\])", p.stdout)
    assert m and sorted(eval(m.group(3))) == sorted(int(j) for _, j in jobs), p.stdout
    assert "AFTER on_switch=[]" in p.stdout
    m = re.search(r"in-network switch on udp [\d.]+:\d+ \(P4Runtime ([\d.]+):(\d+)\)", p.stderr)
    assert m, p.stderr
    with socket.socket() as s:                      # the launcher stopped the switch with the job
        assert s.connect_ex((m.group(1), int(m.group(2)))) != 0
