"""One service host for the TCP bootstrap master and MPI rank 0: a job that uses the coflow coordinator
and a PartialBarrier at once gets each service's own answers under either transport (the master used
to hand every service the instance of whichever was created first)."""

from __future__ import annotations

import pytest

from tests.jobs import lines, run_mpi, run_tcp
from twisternet.services import ServiceHost, install_on_master

from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "twisternet" / "scripts" / "services_both.py"


def _expected(world: int) -> list[str]:
    passed = ",".join(f"rank{r}:{r}" for r in range(world))
    return sorted(f"SERVICES rank={r} round={k} coflow=ok barrier=fire passed={passed}"
                  for r in range(world) for k in range(2))


class _FakeMaster:
    def __init__(self) -> None:
        self.services: dict = {}
        self.hooks: list = []

    def add_service(self, name, handle, tick=None, next_deadline=None):
        self.services[name] = (handle, tick, next_deadline)

    def on_peer_lost(self, hook):
        self.hooks.append(hook)


def test_each_service_on_the_master_gets_its_own_instance():
    m = _FakeMaster()
    host = install_on_master(m)
    assert isinstance(host, ServiceHost)
    coflow_handle = m.services["coflow"][0]
    barrier_handle = m.services["barrier"][0]
    coflow_handle(0, {"payload": {"op": "hello", "policy": "fair", "world": 2, "capacity": 1e8,
                                  "interval": 0.1}})
    assert m.services["coflow"][2]() is not None        # the coordinator wants to push a schedule
    assert m.services["barrier"][2]() is None           # the barrier service does not exist yet
    barrier_handle(0, {"payload": {"op": "enter", "id": 1, "name": "b", "label": "x",
                                   "spec": {"kind": "barrier", "max": 1}}})
    assert sorted(host.names()) == ["barrier", "coflow"]
    assert type(host.service("coflow")).__name__ == "CoflowCoordinator"
    assert type(host.service("barrier")).__name__ == "BarrierService"


@pytest.mark.timeout(180)
def test_coflow_coordinator_and_partial_barrier_in_one_tcp_job():
    p = run_tcp(3, SCRIPT, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(lines(p, "SERVICES")) == _expected(3), p.stdout[-3000:]


@pytest.mark.timeout(180)
def test_coflow_coordinator_and_partial_barrier_in_one_mpi_job():
    p = run_mpi(3, SCRIPT, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(lines(p, "SERVICES")) == _expected(3), p.stdout[-3000:]


def test_the_master_tells_its_services_when_a_rank_is_lost():
    """Rank 0 holds the only place of a semaphore and dies without a goodbye: the barrier service hears
    of it from the master at once and admits rank 1 (before, only a hold timeout could)."""
    import queue
    import threading

    from collectives.barrier.specs import SemaphoreSpec
    from twisternet.bootstrap import Master, join

    token = b"9f2c41d7e8b05a3364c1fd0e72ab8c55"
    master = Master(2, token, "127.0.0.1", 0, heartbeat_interval=0.2, peer_timeout=30.0)
    install_on_master(master)
    master.start()
    addr = f"127.0.0.1:{master.address[1]}"
    sessions: dict = {}

    def joiner(rank: int) -> None:
        sessions[rank] = join(addr, token, listen={}, rank=rank, world=2, timeout=30,
                              heartbeat_interval=0.2, peer_timeout=30.0)

    threads = [threading.Thread(target=joiner, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    events: dict[int, queue.Queue] = {r: queue.Queue() for r in range(2)}
    for r in range(2):
        sessions[r].on_event(events[r].put)
    spec = SemaphoreSpec(n=1).to_dict()
    try:
        sessions[0].send({"service": "barrier", "payload": {"op": "acquire", "id": 1, "name": "s",
                                                            "label": "a", "spec": spec}})
        ev = events[0].get(timeout=30)
        assert ev["payload"]["op"] == "admitted", ev
        sessions[1].send({"service": "barrier", "payload": {"op": "acquire", "id": 1, "name": "s",
                                                            "label": "b", "spec": spec}})
        with pytest.raises(queue.Empty):
            events[1].get(timeout=0.5)          # the place is held
        sessions[0].sever()                     # rank 0 dies: no goodbye
        while True:
            ev = events[1].get(timeout=20)
            if ev.get("type") == "service":
                break
        assert ev["payload"]["op"] == "admitted" and ev["payload"]["admission"]["label"] == "b", ev
    finally:
        for s in sessions.values():
            s.close()
        master.stop()
