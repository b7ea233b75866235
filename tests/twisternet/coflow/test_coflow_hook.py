"""The coflow hook: CoflowRuntime bookkeeping, ctx.coflow groups, and collectives under scheduling."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from twisternet.coflow import CoflowError
from twisternet.coflow.live import DEFAULT_FLOW_BYTES, EDGES_PER_USER_EDGE, CoflowRuntime
from twisternet.config import load_config
from twisternet.errors import ConfigError
from twisternet.testing import run_local


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_sebf_ranks_announced_small_coflow_first():
    rt = CoflowRuntime(4, 0, "sebf")
    with rt.group("big", size=40e6):
        rt.attach(1, "Gather", [0, 1, 2, 3], [0])
    with rt.group("small", size=1e6):
        rt.attach(2, "Gather", [0, 1, 2, 3], [0])
    rt.refresh(force=True)
    assert rt.edge_rank(2 * EDGES_PER_USER_EDGE + 5) < rt.edge_rank(1 * EDGES_PER_USER_EDGE)
    assert rt.coflow_of(2 * EDGES_PER_USER_EDGE) == "small"
    # control / unknown edges are never held back
    assert rt.edge_rank(10**6 * EDGES_PER_USER_EDGE) < 0


def test_fifo_ranks_by_arrival_and_detach_releases():
    clock = FakeClock()
    rt = CoflowRuntime(3, 0, "fifo", clock=clock)
    a = rt.attach(1, "Partition", [0, 1, 2], [0, 1, 2], size=50e6)
    clock.t += 1
    b = rt.attach(2, "Gather", [0, 1, 2], [0], size=1e3)
    rt.refresh(force=True)
    assert rt.edge_rank(64) < rt.edge_rank(128)
    assert set(rt.coflows()) == {a, b}
    rt.detach(1)
    rt.refresh(force=True)
    assert set(rt.coflows()) == {b} and rt.edge_rank(128) == 0
    rt.detach(2)
    rt.detach(2)  # idempotent
    assert len(rt) == 0 and len(rt.table) == 0


def test_group_merges_operations_and_flows_split_size():
    rt = CoflowRuntime(2, 0, "sebf")
    with rt.group("stage", size=8e6) as g:
        rt.attach(3, "Gather", [0, 1], [0])
        rt.attach(4, "Broadcast", [0], [0, 1])
    assert g.edges == {3, 4}
    flows = {(s, d): b for s, d, b in rt.coflows()["stage"]["flows"]}
    # gather: only 1->0 crosses the network; broadcast: only 0->1; each announced size split per op
    assert flows == {(1, 0): 8e6, (0, 1): 8e6}
    rt.detach(3)
    assert "stage" in rt.coflows()
    rt.detach(4)
    assert rt.coflows() == {}


def test_unannounced_size_uses_default_estimate():
    rt = CoflowRuntime(2, 1, "sebf")
    rt.attach(5, "Gather", [0, 1], [0])
    (flow,) = rt.coflows()["Gather@5"]["flows"]
    assert flow == (1, 0, float(DEFAULT_FLOW_BYTES))


def test_dag_parents_wait_for_their_parent():
    rt = CoflowRuntime(2, 0, "sebf")
    with rt.group("s1", size=10e6):
        rt.attach(1, "Gather", [0, 1], [0])
    with rt.group("s2", size=1e3, parents=["s1"]):
        rt.attach(2, "Gather", [0, 1], [0])
    rt.refresh(force=True)
    # s2 is smaller but waits on s1: s1 ranks first
    assert rt.edge_rank(64) < rt.edge_rank(128)
    rt.detach(1)
    rt.refresh(force=True)
    assert rt.edge_rank(128) == 0


def test_progress_reports_reduce_remaining():
    rt = CoflowRuntime(2, 0, "sebf")
    rt.attach(1, "Gather", [0, 1], [1], size=1000)
    rt.report_sent(64 + 3, 1, 400)
    rt.refresh(force=True)
    assert rt.table.remaining("Gather@1") == [600.0]


def test_bad_groups_raise():
    rt = CoflowRuntime(2, 0, "sebf")
    with pytest.raises(CoflowError), rt.group("x", size=-1):
        pass
    with pytest.raises(CoflowError), rt.group("x", deadline=0):
        pass
    with rt.group("y"):
        rt.attach(1, "Gather", [0, 1], [0])
        with pytest.raises(CoflowError), rt.group("y"):
            pass
    with pytest.raises(CoflowError):
        rt.attach(1, "Gather", [0, 1], [0])


def test_pacing_token_bucket():
    clock = FakeClock()
    rt = CoflowRuntime(2, 0, "fair", rank_capacity=1000, clock=clock)
    rt.attach(1, "Gather", [0, 1], [1], size=10_000)
    rt.refresh(force=True)
    rate = rt.table.rates()["Gather@1"][0]
    assert rate > 0
    assert rt.pace(64, 1, 500) == 0.0           # first message: a burst of one message goes
    wait = rt.pace(64, 1, 500)
    assert wait == pytest.approx(500 / rate, rel=1e-6)
    clock.t += wait
    assert rt.pace(64, 1, 500) == 0.0
    assert rt.pace(10**6, 1, 10**9) == 0.0      # unscheduled edge: never paced


def test_config_validation():
    assert load_config(env={}).coflow_policy == "none"
    assert load_config(env={}, coflow_policy="dag").coflow_policy == "dag"
    with pytest.raises(ConfigError):
        load_config(env={}, coflow_policy="shortest")
    with pytest.raises(ConfigError):
        load_config(env={}, coflow_interval=0)
    with pytest.raises(ConfigError):
        load_config(env={}, coflow_inflight=0)
    assert load_config(env={"TWISTERNET_COFLOW_POLICY": "fifo"}).coflow_policy == "fifo"


def _two_gathers(ctx):
    big_arrays = [np.arange(200_000, dtype=np.float64) * (ctx.rank + 1) + i for i in range(3)]
    with ctx.coflow("big", size=4.8e6 * ctx.world):
        big = C.Gather(ctx, edge=1)
    with ctx.coflow("small", size=1e3):
        small = C.Gather(ctx, edge=2)
    seen = set(ctx.coflows.coflows()) if ctx.coflows is not None else None
    for a in big_arrays:
        big.send(ctx.rank, a)
    big.finish(ctx.rank)
    small.send(ctx.rank, ("hello", ctx.rank))
    small.finish(ctx.rank)
    out = None
    if ctx.rank == 0:
        out = (list(big.results()), list(small.results()))
    big.close()
    small.close()
    after = len(ctx.coflows) if ctx.coflows is not None else None
    return seen, out, after


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["none", "sebf", "fifo"])
def test_collectives_correct_under_scheduling(policy):
    world = 3
    res = run_local(world, _two_gathers, coflow_policy=policy, coflow_pacing=(policy == "fifo"),
                    timeout=50)
    seen, (big, small), _ = res[0]
    if policy == "none":
        assert seen is None
    else:
        assert seen == {"big", "small"}
        assert all(r[2] == 0 for r in res)
    exp_big = [(r, np.arange(200_000, dtype=np.float64) * (r + 1) + i) for r in range(world) for i in range(3)]
    assert len(big) == len(exp_big)
    for (t, a), (et, ea) in zip(big, exp_big):
        assert t == et and np.array_equal(np.asarray(a), ea)
    assert sorted(small) == [(r, ("hello", r)) for r in range(world)] or \
        sorted(small) == [(r, ["hello", r]) for r in range(world)]


def test_streaming_windows_are_successive_coflows():
    rt = CoflowRuntime(2, 0, "sebf")
    sent: list[dict] = []
    rt.connect(sent.append)
    first = rt.attach(1, "Gather", [0, 1], [1], size=100)
    w1 = rt.new_window(1, size=50)
    w2 = rt.new_window(1)
    assert (first, w1, w2) == ("Gather@1", "Gather@1#1", "Gather@1#2")
    assert set(rt.coflows()) == {w2} and rt.coflows()[w2]["flows"] == [(0, 1, float(DEFAULT_FLOW_BYTES))]
    rt.flush_outbox()
    ops = [(m["op"], m.get("id")) for m in sent]
    # registrations never sent (superseded before a flush) are not unregistered either
    assert ops == [("hello", None), ("register", "Gather@1#2")]
    with pytest.raises(CoflowError):
        rt.new_window(9)
