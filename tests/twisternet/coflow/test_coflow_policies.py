"""Policies on hand-worked examples: the Varys-style two-coflow example, deadline admission control,
JIT latest arrival times and the LAT LP, starvation avoidance, and the plug-in registry."""

from __future__ import annotations

import numpy as np
import pytest

from twisternet.coflow import (Allocation, Coflow, CoflowError, JobDag, PortCapacities, Scheduler,
                               UnknownPolicyError, get_policy, register_policy, simulate,
                               unregister_policy)
from twisternet.coflow.policies import DagScheduler, DeadlineScheduler, SebfScheduler

UNIT3 = PortCapacities.uniform(3, 1.0)


def varys_example() -> list[Coflow]:
    """The illustrative setting of the Varys paper: a 3x3 fabric, unit-rate ports (one data unit per
    time unit), two coflows arriving together. (Sizes are our own, chosen so the policies differ.)

    C1 ("narrow but long"): one flow in1->out1 of 4 units.      Γ(C1) = 4 (in1 and out1 carry 4).
    C2 ("wide but short"):  in1->out2, in2->out3, in3->out1, 2 units each; every port it uses
                            carries 2 units, so Γ(C2) = 2 although C2 has more bytes (6 > 4).
    Ports are 0-based below: in1 = 0, out1 = 0, and so on.
    """
    return [Coflow("C1", 0.0, [(0, 0, 4.0)]),
            Coflow("C2", 0.0, [(0, 1, 2.0), (1, 2, 2.0), (2, 0, 2.0)])]


def ccts(policy, **opts) -> dict:
    res = simulate(varys_example(), policy, UNIT3, **opts)
    return {r.id: r.cct for r in res.coflows}


def test_varys_example_sebf() -> None:
    # SEBF serves C2 first (Γ 2 < 4). MADD: each C2 flow gets 2/2 = 1, filling in1 and out1, so C1
    # gets nothing (its Γ' over the residual is infinite) and backfill has nothing at in1/out1 either.
    # t=2: C2 done. C1 then runs at 1 and finishes at 2 + 4 = 6.  CCTs: C2 = 2, C1 = 6, mean 4.
    assert ccts("sebf", starvation_period=None) == pytest.approx({"C1": 6.0, "C2": 2.0})


def test_varys_example_fair() -> None:
    # Per-flow fairness: in1 = {C1, C2:in1->out2}, out1 = {C1, C2:in3->out1} -> 1/2 each; C2's
    # in2->out3 is alone -> 1. t=2: in2->out3 done (2 units); the other C2 flows have 1 unit left, C1 3.
    # Shares unchanged until t=4, when C2's last two flows finish (C2 = 4). C1 has 4 - 4*0.5 = 2 left,
    # now alone at rate 1: done at t=6. CCTs: C1 = 6, C2 = 4, mean 5 (SEBF's 4 is 20% better).
    assert ccts("fair") == pytest.approx({"C1": 6.0, "C2": 4.0})


def test_varys_example_fifo() -> None:
    # FIFO: C1 (listed first) takes in1/out1 at full rate; C2 can only use in2->out3 (rate 1).
    # t=2: that flow is done; t=4: C1 done (CCT 4); C2's two blocked flows then run at 1 -> t=6.
    # CCTs: C1 = 4, C2 = 6, mean 5.
    assert ccts("fifo") == pytest.approx({"C1": 4.0, "C2": 6.0})


def test_fifo_head_takes_only_what_its_bottleneck_needs() -> None:
    # C1 (first): a in0->out0 4 units, b in1->out1 1 unit; Γ(C1) = 4. C2: in1->out1, 1 unit.
    # MADD FIFO: C1 gets a = 1, b = 1/4 (b needs no more to finish with a at t=4); C2 gets in1's other
    # 3/4 and finishes at 4/3; C1 still finishes at 4. The old greedy FIFO let C1's b take all of in1
    # until t=1, so C2 waited and finished at 2 without C1 finishing any sooner.
    caps = PortCapacities.uniform(2, 1.0)
    cfs = [Coflow("C1", 0.0, [(0, 0, 4.0), (1, 1, 1.0)]), Coflow("C2", 0.0, [(1, 1, 1.0)])]
    madd = {r.id: r.cct for r in simulate(cfs, "fifo", caps).coflows}
    greedy = {r.id: r.cct for r in simulate(cfs, "fifo", caps, madd=False).coflows}
    assert madd == pytest.approx({"C1": 4.0, "C2": 4.0 / 3.0})
    assert greedy == pytest.approx({"C1": 4.0, "C2": 2.0})


def test_sebf_order_and_priorities() -> None:
    sched = get_policy("sebf", starvation_period=None)
    alloc = sched.allocate(varys_example(), 0.0, UNIT3)
    assert alloc.order == ["C2", "C1"]
    assert alloc.priorities() == {"C2": 0, "C1": 1}
    assert alloc.rates["C2"] == pytest.approx([1.0, 1.0, 1.0])
    assert alloc.rates["C1"] == pytest.approx([0.0])


def test_sebf_backfill_uses_leftover() -> None:
    # C3: in0->out0 (3 units) and in1->out0 (1 unit): Γ = 4 (out0 carries 4) -> MADD 3/4 and 1/4, so
    # in1 keeps 3/4 free. C4: in1->out1, 8 units, Γ 8: served second, its Γ' over the residual is
    # 8 / (3/4) -> MADD rate 3/4. Then backfill: C3's flows sit on the saturated out0, C4's on the
    # saturated in1 - nothing is left idle that any flow could use.
    caps = PortCapacities.uniform(3, 1.0)
    c3 = Coflow("C3", 0.0, [(0, 0, 3.0), (1, 0, 1.0)])
    c4 = Coflow("C4", 0.0, [(1, 1, 8.0)])  # Γ 8: served last, gets in1's leftover 3/4
    alloc = SebfScheduler(starvation_period=None).allocate([c3, c4], 0.0, caps)
    assert alloc.rates["C3"] == pytest.approx([0.75, 0.25])
    assert alloc.rates["C4"] == pytest.approx([0.75])


def test_starvation_windows_and_timer() -> None:
    s = SebfScheduler(starvation_period=2.0, starvation_duration=0.5)
    assert not s.windows.active(0.0) and not s.windows.active(1.9)
    assert s.windows.active(2.0) and s.windows.active(2.4) and not s.windows.active(2.5)
    assert s.next_timer(0.0) == pytest.approx(2.0)
    assert s.next_timer(2.0) == pytest.approx(2.5)
    assert s.next_timer(2.5) == pytest.approx(4.0)
    with pytest.raises(CoflowError):
        SebfScheduler(starvation_period=1.0, starvation_duration=1.0)


def starvation_workload(n_small: int) -> list[Coflow]:
    # A big coflow (3 units, Γ 3) at t=0 behind a stream of 1-unit coflows (Γ 1) on the same ports,
    # one per time unit: the stream alone keeps port 0 100% busy, so pure SEBF never serves the big one
    # while the stream lasts.
    big = Coflow("big", 0.0, [(0, 0, 3.0)])
    small = [Coflow(f"s{k}", float(k), [(0, 0, 1.0)]) for k in range(n_small)]
    return [big] + small


@pytest.mark.timeout(60)
def test_starvation_freedom() -> None:
    n = 60
    caps = PortCapacities.uniform(1, 1.0)
    pure = simulate(starvation_workload(n), "sebf", caps, starvation_period=None)
    big_pure = next(r for r in pure.coflows if r.id == "big")
    # Starved: it only finishes after the whole stream (60 units of work) plus its own 3.
    assert big_pure.finish == pytest.approx(n + 3.0)
    fair_windows = simulate(starvation_workload(n), "sebf", caps, starvation_period=2.0,
                            starvation_duration=0.5)
    big = next(r for r in fair_windows.coflows if r.id == "big")
    # With fair-share windows it completes while small coflows are still arriving.
    assert big.finish < n - 1
    assert all(r.finish is not None for r in fair_windows.coflows)


# --------------------------------------------------------------------------- deadline
def deadline_example() -> list[Coflow]:
    # Unit ports, all arrive at t=0 in this order.
    #   C1: in0->out0, 4 units, deadline 5.   Γ = 4 <= 5: admitted, reserves 4/5 = 0.8 on in0/out0.
    #   C2: in0->out1, 1 unit,  deadline 1.5. Unreserved in0 = 0.2 -> Γ = 1/0.2 = 5 > 1.5: rejected.
    #   C3: in1->out1, 1 unit,  deadline 1.5. Γ = 1 <= 1.5: admitted, reserves 1/1.5 on in1/out1.
    return [Coflow("C1", 0.0, [(0, 0, 4.0)], deadline=5.0),
            Coflow("C2", 0.0, [(0, 1, 1.0)], deadline=1.5),
            Coflow("C3", 0.0, [(1, 1, 1.0)], deadline=1.5)]


def test_deadline_admission_control() -> None:
    caps = PortCapacities.uniform(2, 1.0)
    s = DeadlineScheduler(backfill=False)
    c1, c2, c3 = deadline_example()
    assert s.on_arrival(c1, 0.0, caps) is True
    assert s.on_arrival(c2, 0.0, caps) is False
    assert s.on_arrival(c3, 0.0, caps) is True
    assert s.rejected == ["C2"]
    alloc = s.allocate([c1, c3], 0.0, caps)
    # MADD reservations that finish exactly at the deadline.
    assert alloc.rates["C1"] == pytest.approx([0.8])
    assert alloc.rates["C3"] == pytest.approx([1 / 1.5])
    assert alloc.order == ["C3", "C1"]  # earliest deadline first


def test_deadline_policy_beats_fair_on_deadlines() -> None:
    caps = PortCapacities.uniform(2, 1.0)
    d = simulate(deadline_example(), "deadline", caps)
    # With backfill C3 runs at 1 (done t=1), C1 at 1 (done t=4); C2 was dropped: 2 of 3 met.
    got = {r.id: r.cct for r in d.coflows}
    assert got == {"C1": pytest.approx(4.0), "C2": None, "C3": pytest.approx(1.0)}
    assert d.rejected == 1 and d.deadlines_met == pytest.approx(2 / 3)
    # Fair: C1 and C2 share in0, C2 and C3 share out1 -> all at 1/2 until t=2, so C2 and C3 (deadline
    # 1.5) miss; C1 sends 1 by t=2 and the other 3 alone by t=5 = its deadline: 1 of 3 met.
    f = simulate(deadline_example(), "fair", caps)
    assert {r.id: r.cct for r in f.coflows} == pytest.approx({"C1": 5.0, "C2": 2.0, "C3": 2.0})
    assert f.deadlines_met == pytest.approx(1 / 3)


def test_deadline_serve_rejected_best_effort() -> None:
    caps = PortCapacities.uniform(2, 1.0)
    d = simulate(deadline_example(), "deadline", caps, serve_rejected=True)
    got = {r.id: r for r in d.coflows}
    assert not got["C2"].admitted and got["C2"].finish is not None  # served late from leftover
    assert got["C1"].met_deadline and got["C3"].met_deadline


# --------------------------------------------------------------------------- DAG / LAT
def test_latest_arrival_times_hand_example() -> None:
    # Stages: A (2 s), B (5 s) feed C (1 s), which feeds D (1 s).
    # Transfers: T1 A->C takes 1 s, T2 B->C 2 s, T3 C->D 0.5 s.
    # Forward: A 0..2, B 0..5; T1 arrives 3, T2 arrives 7 -> C 7..8; T3 arrives 8.5 -> D 8.5..9.5.
    # Backward from F = 9.5: LST(D) = 8.5 = LAT(T3); LFT(C) = 8.5 - 0.5 = 8, LST(C) = 7 = LAT(T1) = LAT(T2).
    # LFT(A) = 7 - 1 = 6, LFT(B) = 7 - 2 = 5.  Slack: T1 7 - 3 = 4, T2 0, T3 0.
    dag = JobDag()
    for name, t in (("A", 2.0), ("B", 5.0), ("C", 1.0), ("D", 1.0)):
        dag.add_stage(name, t)
    dag.add_transfer(("T1", 1.0), "A", "C").add_transfer(("T2", 2.0), "B", "C")
    dag.add_transfer(("T3", 0.5), "C", "D")
    tm = dag.timing(start=10.0)  # absolute times shift by the start
    assert tm.finish == pytest.approx(19.5)
    assert tm.latest_arrival == pytest.approx({"T1": 17.0, "T2": 17.0, "T3": 18.5})
    assert tm.latest_finish["A"] == pytest.approx(16.0) and tm.latest_finish["B"] == pytest.approx(15.0)
    assert tm.slack("T1") == pytest.approx(4.0) and tm.slack("T2") == pytest.approx(0.0)


def test_lat_uses_coflow_bottleneck_and_rejects_cycles() -> None:
    # T1 as a coflow of 4 bytes on 2 B/s ports -> duration Γ = 2 s.
    dag = JobDag().add_stage("A", 1.0).add_stage("B", 1.0)
    dag.add_transfer(Coflow("T1", 0.0, [(0, 1, 4.0)]), "A", "B")
    tm = dag.timing(0.0, PortCapacities.uniform(2, 2.0))
    assert tm.transfer_duration["T1"] == pytest.approx(2.0)
    assert tm.latest_arrival["T1"] == pytest.approx(3.0)  # F = 1 + 2 + 1 = 4, LST(B) = 3
    assert dag.transfers["T1"][2].dag_node == "B"
    cyc = JobDag().add_stage("x", 1.0).add_stage("y", 1.0)
    cyc.add_transfer(("e1", 1.0), "x", "y").add_transfer(("e2", 1.0), "y", "x")
    with pytest.raises(CoflowError, match="cycle"):
        cyc.timing()


def test_dag_lp_meets_feasible_lats_first() -> None:
    # One unit port pair 0. X: 2 bytes, LAT now+2 -> needs rate 1. Y: 1 byte, LAT now+4 -> needs 0.25.
    # Both need 1.25 > 1. LP: max y_X + y_Y s.t. 1*y_X + 0.25*y_Y <= 1 -> y_Y = 1, y_X = 0.75
    # (value 1.75 beats y_X = 1, y_Y = 0 with 1.0). Rates: X 0.75, Y 0.25; no capacity left.
    caps = PortCapacities.uniform(2, 1.0)
    x = Coflow("X", 0.0, [(0, 0, 2.0)])
    y = Coflow("Y", 0.0, [(0, 1, 1.0)])
    s = DagScheduler(lats={"X": 2.0, "Y": 4.0})
    alloc = s.allocate([x, y], 0.0, caps)
    assert alloc.rates["X"] == pytest.approx([0.75], abs=1e-6)
    assert alloc.rates["Y"] == pytest.approx([0.25], abs=1e-6)
    assert alloc.order == ["X", "Y"]


def test_dag_freed_bandwidth_goes_to_earliest_lat() -> None:
    # X: 1 byte LAT 2 (needs 0.5), Y: 1 byte LAT 4 (needs 0.25): both fit (0.75 of 1). The free 0.25
    # goes to X, the earlier LAT: X 0.75, Y 0.25.
    caps = PortCapacities.uniform(2, 1.0)
    x = Coflow("X", 0.0, [(0, 0, 1.0)])
    y = Coflow("Y", 0.0, [(0, 1, 1.0)])
    alloc = DagScheduler(lats={"X": 2.0, "Y": 4.0}).allocate([y, x], 0.0, caps)
    assert alloc.rates["X"] == pytest.approx([0.75], abs=1e-6)
    assert alloc.rates["Y"] == pytest.approx([0.25], abs=1e-6)


def test_dag_policy_in_simulation_with_jobs_and_parents() -> None:
    # Two-stage job on unit ports: coflow M (map shuffle, 2 bytes) then R (reduce output, 1 byte),
    # R's parent is M. A competing coflow Z (4 bytes on the same ports, no DAG) arrives at 0 as well.
    caps = PortCapacities.uniform(2, 1.0)
    m = Coflow("M", 0.0, [(0, 0, 2.0)])
    r = Coflow("R", 0.0, [(0, 1, 1.0)], parents=["M"])
    z = Coflow("Z", 0.0, [(0, 0, 4.0)])
    dag = JobDag().add_stage("map", 0.0).add_stage("shuffle", 0.0).add_stage("out", 0.0)
    dag.add_transfer(m, "map", "shuffle").add_transfer(r, "shuffle", "out")
    res = simulate([m, r, z], "dag", caps, jobs=[(dag, 0.0)])
    got = {x.id: x for x in res.coflows}
    # LAT(M) = 2, LAT(R) = 3, Z's fallback LAT = 0 + 1 * Γ = 4. The LP can meet M (rate 1) but then
    # not Z; M done at 2, R runs 2..3, Z gets what is left and finishes at 7 (7 units total on in0).
    assert got["M"].finish == pytest.approx(2.0)
    assert got["R"].finish == pytest.approx(3.0) and got["R"].release == pytest.approx(2.0)
    assert got["Z"].finish == pytest.approx(7.0)


# --------------------------------------------------------------------------- registry
class LongestFirst(Scheduler):
    """A toy plug-in: serve the coflow with the most remaining bytes first."""

    def allocate(self, coflows, now, capacities) -> Allocation:
        from twisternet.coflow.rate_allocation import ResidualCapacity, greedy_fill
        order = sorted(range(len(coflows)), key=lambda i: -coflows[i].remaining_bytes)
        rates = [np.zeros(len(c)) for c in coflows]
        greedy_fill(coflows, order, ResidualCapacity(capacities), rates)
        return Allocation({c.id: r for c, r in zip(coflows, rates)}, [coflows[i].id for i in order])


def test_register_custom_policy() -> None:
    register_policy("longest-first", LongestFirst)
    try:
        sched = get_policy("longest-first")
        assert sched.name == "longest-first"
        res = simulate(varys_example(), sched, UNIT3)
        # C2 (6 bytes) before C1 (4): same schedule as SEBF here -> C2 = 2, C1 = 6.
        assert {r.id: r.cct for r in res.coflows} == pytest.approx({"C1": 6.0, "C2": 2.0})
        with pytest.raises(CoflowError):
            register_policy("longest-first", SebfScheduler)
    finally:
        unregister_policy("longest-first")
    with pytest.raises(UnknownPolicyError, match="longest-first"):
        get_policy("longest-first")
    with pytest.raises(CoflowError, match="bad options"):
        get_policy("sebf", no_such_option=1)


def _coflowsim_fifo_example() -> list[Coflow]:
    """Three coflows arriving together (in this order) on 2 ingress x 3 egress ports of 128 units/s
    (128 MB/s, about 1 Gbit/s, in MB): A in0->out0 128; B in0->out1 128 and in1->out1 1280; C (small)
    in0->out2 12.8 and in1->out2 12.8."""
    return [Coflow("A", 0.0, [(0, 0, 128.0)]),
            Coflow("B", 0.0, [(0, 1, 128.0), (1, 1, 1280.0)]),
            Coflow("C", 0.0, [(0, 2, 12.8), (1, 2, 12.8)])]


def test_fifo_skipped_coflows_queue_in_arrival_order() -> None:
    # t=0: A's MADD fills in0 (Γ 1 s); B and C need in0, so MADD skips both. The refill in arrival
    # order gives B's in1->out1 all of in1; C's in1->out2 gets nothing. t=1: A done; B has 128 + 1152
    # left, Γ = 1280/128 = 10 s, MADD 12.8 on in0 and 115.2 on in1; C on the residual: in1 has 12.8
    # left for 12.8 units, Γ' = 1 s. C done at 2, B at 11. Mean (1 + 11 + 2) / 3 = 4.667.
    caps = PortCapacities(np.full(2, 128.0), np.full(3, 128.0))
    res = simulate(_coflowsim_fifo_example(), "fifo", caps)
    assert {r.id: r.cct for r in res.coflows} == pytest.approx({"A": 1.0, "B": 11.0, "C": 2.0})


def test_fifo_share_skipped_pools_the_skipped_coflows() -> None:
    # coflowsim's FIFO: the skipped B and C share in1 max-min: 64 each. t=0.2: C's in1->out2 done
    # (12.8 at 64); B's in1->out1 then has in1 alone. t=1: A done; B sent 12.8 + 0.8 x 128 = 115.2 of
    # 1280, so it has 128 + 1164.8 left at out1: Γ = 10.1 s, in0->out1 at 128/10.1. C's last flow
    # (in0->out2, 12.8) gets MADD on in0's residual 128 - 128/10.1: done at 1 + 12.8 / that.
    caps = PortCapacities(np.full(2, 128.0), np.full(3, 128.0))
    res = simulate(_coflowsim_fifo_example(), "fifo", caps, share_skipped=True)
    c_cct = 1.0 + 12.8 / (128.0 - 128.0 / 10.1)
    assert {r.id: r.cct for r in res.coflows} == pytest.approx({"A": 1.0, "B": 11.1, "C": c_cct})
    assert res.avg_cct < simulate(_coflowsim_fifo_example(), "fifo", caps).avg_cct
