"""The coflow coordinator service and the workers' fallback to local ordering."""

from __future__ import annotations

import time

import pytest

import collectives as C
from twisternet.coflow.coordinator import SERVICE_NAME, CoflowCoordinator
from twisternet.coflow.live import CoflowRuntime
from twisternet.testing import run_local


def _hello(world=3, policy="sebf"):
    return {"op": "hello", "policy": policy, "world": world, "capacity": 1e6, "interval": 0.1}


def test_coordinator_ranks_job_wide_and_ends_coflows_with_last_rank():
    co = CoflowCoordinator()
    for r in range(3):
        co.handle(r, _hello(), 0.0)
    for r in range(3):
        co.handle(r, {"op": "register", "id": "big", "flows": [[1, 0, 9e6], [2, 0, 9e6]]}, 0.0)
        co.handle(r, {"op": "register", "id": "small", "flows": [[1, 0, 1e3]], "parents": []}, 0.0)
    assert co.next_deadline() is not None
    out = co.tick(time.monotonic())
    assert sorted(r for r, _ in out) == [0, 1, 2]
    prio = out[0][1]["prio"]
    assert prio["small"] < prio["big"]
    rates = out[0][1]["rates"]                       # MADD rates pushed too, per flow in registration order
    assert len(rates["big"]) == 2 and len(rates["small"]) == 1 and rates["small"][0] > 0
    # progress shrinks "big" below "small": SEBF reorders
    co.handle(1, {"op": "progress", "id": "big", "sent": [[1, 0, 9e6 - 10], [2, 0, 9e6 - 10]]}, 0.0)
    assert co.tick(time.monotonic())[0][1]["prio"]["big"] == 0
    for r in range(2):
        co.handle(r, {"op": "unregister", "id": "big"}, 0.0)
    assert "big" in co.table          # rank 2 still has it
    co.handle(2, {"op": "unregister", "id": "big"}, 0.0)
    assert "big" not in co.table and "small" in co.table


def test_coordinator_ignores_bad_messages():
    co = CoflowCoordinator()
    assert co.handle(0, {"op": "register", "id": "x", "flows": [[0, 1, 5]]}, 0.0) == []   # before hello
    co.handle(0, _hello(world=2), 0.0)
    assert co.handle(0, {"op": "register", "id": "x", "flows": [[0, 7, 5]]}, 0.0) == []   # bad rank
    assert co.handle(0, {"op": "what"}, 0.0) == []
    assert "x" not in co.table
    co.handle(0, {"op": "progress", "id": "nope", "sent": [[0, 1, 5]]}, 0.0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


def test_worker_follows_coordinator_then_falls_back_when_it_goes_silent():
    clock = FakeClock()
    rt = CoflowRuntime(2, 0, "sebf", interval=0.1, clock=clock)
    sent: list[dict] = []
    rt.connect(sent.append)
    rt.attach(1, "Gather", [0, 1], [1], size=1e6)
    rt.attach(2, "Gather", [0, 1], [1], size=1e3)
    rt.flush_outbox()
    assert [m["op"] for m in sent] == ["hello", "register", "register"]
    rt.refresh(force=True)
    assert rt.edge_rank(128) < rt.edge_rank(64)      # local SEBF: small first
    rt.on_schedule({"op": "schedule", "prio": {"Gather@1": 0, "Gather@2": 1}, "seq": 1})
    rt.refresh(force=True)
    assert rt.using_coordinator and rt.edge_rank(64) < rt.edge_rank(128)   # the coordinator's word
    clock.t += rt.stale_after + 0.01                  # coordinator gone silent
    rt.refresh(force=True)
    assert not rt.using_coordinator and rt.edge_rank(128) < rt.edge_rank(64)


def test_unreachable_coordinator_does_not_break_sending():
    rt = CoflowRuntime(2, 0, "fifo")

    def dead(msg):
        raise ConnectionError("coordinator gone")
    rt.connect(dead)
    rt.attach(1, "Gather", [0, 1], [1])
    rt.flush_outbox()                                 # swallowed, logged
    rt.refresh(force=True)
    assert rt.edge_rank(64) == 0


def _with_coordinator(ctx):
    with ctx.coflow("stage", size=1e6):
        g = C.Gather(ctx, edge=1)
    ctx.wait_until(lambda: ctx.coflows.using_coordinator, timeout=10)
    g.send(ctx.rank, list(range(1000)))
    g.finish(ctx.rank)
    got = list(g.results()) if ctx.rank == 0 else None
    g.close()
    table_len = None
    if ctx.rank == 0:
        svc = ctx.services.local_service(SERVICE_NAME)
        ctx.wait_until(lambda: "stage" not in svc.table, timeout=10)
        table_len = len(svc.table)
    return got, table_len


@pytest.mark.timeout(60)
def test_coordinator_over_control_edges_local_channel():
    res = run_local(3, _with_coordinator, coflow_policy="sebf", timeout=50)
    got, n = res[0]
    assert got == [(r, list(range(1000))) for r in range(3)]
    assert n == 0


def test_pushed_rates_drive_pacing_and_local_rates_return_when_stale() -> None:
    from twisternet.coflow.live import EDGES_PER_USER_EDGE, CoflowRuntime

    clock = [100.0]
    rt = CoflowRuntime(2, 0, "sebf", clock=lambda: clock[0])
    cid = rt.attach(7, "Gather", [0, 1], [0, 1])
    rt.refresh(force=True)
    ch = 7 * EDGES_PER_USER_EDGE
    # a coordinator's schedule: this coflow at 1000 B/s on every flow
    rt.on_schedule({"op": "schedule", "prio": {str(cid): 0}, "rates": {str(cid): [1000.0, 1000.0]}})
    rt.refresh(force=True)
    assert rt.pace(ch, 1, 1000) == 0.0          # the first burst goes at once
    assert rt.pace(ch, 1, 1000) == pytest.approx(1.0, rel=0.01)   # then 1000 B at 1000 B/s
    clock[0] += 10 * rt.stale_after             # the coordinator went silent: local rates again
    rt.refresh(force=True)
    assert rt.pace(ch, 1, 1000) == 0.0
    assert rt.pace(ch, 1, 1000) < 0.01          # the local policy's share of a 1 Gbit/s port
