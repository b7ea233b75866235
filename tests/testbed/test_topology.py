"""Topology without namespaces: host groups, host-contiguous rank numbering, the algorithm selection,
and the hierarchical allreduce on the local channel with hosts given in the task plan (threads of one
process posing as ranks of several hosts), checked against the flat algorithms."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest

import collectives as C
from collectives.allreduce import shm as shm_path
from collectives.allreduce.select import choose, leader_algorithm
from twisternet.errors import ConfigError, MismatchError
from twisternet.task_plan import TaskPlan
from twisternet.testing import run_local
from twisternet.topology import Topology, assign_ranks, from_channel, number_workers


# ---------------------------------------------------------------------- Topology
def test_groups_leaders_and_contiguity() -> None:
    t = Topology({0: "a", 1: "b", 2: "a", 3: "b", 4: "c"})
    assert t.groups == [[0, 2], [1, 3], [4]]
    assert t.leaders == [0, 1, 4]
    assert t.group(3) == [1, 3] and t.leader(3) == 1 and not t.is_leader(3) and t.is_leader(4)
    assert t.nhosts == 3 and t.max_per_host == 2
    assert not t.contiguous()
    assert Topology({0: "a", 1: "a", 2: "b", 3: "b"}).contiguous()
    assert t.restrict([2, 3, 4]).groups == [[2], [3], [4]]


def test_task_plan_records_hosts_and_refuses_a_second_host() -> None:
    plan = TaskPlan(4)
    assert plan.topology() is None
    plan.set_hosts({0: "a", 1: "a"})
    assert plan.topology() is None and plan.topology([0, 1]) == Topology({0: "a", 1: "a"})
    plan.set_hosts({2: "b", 3: "b", 0: "a"})
    assert plan.topology().groups == [[0, 1], [2, 3]]
    with pytest.raises(ConfigError, match="rank 0 was on host 'a'"):
        plan.set_hosts({0: "b"})
    with pytest.raises(ConfigError, match="outside"):
        plan.set_hosts({4: "b"})


def test_from_channel_reads_the_bootstrap_table() -> None:
    ch = SimpleNamespace(world=2, session=SimpleNamespace(table=[{"host_id": "h0/x/1"}, {"host_id": "h1/x/2"}]))
    assert from_channel(ch) == {0: "h0/x/1", 1: "h1/x/2"}
    assert from_channel(SimpleNamespace(world=2, session=None)) is None
    bad = SimpleNamespace(world=2, session=SimpleNamespace(table=[{"host_id": "h0"}, {}]))
    assert from_channel(bad) is None
    # the MPI channel's ids, gathered at its start
    assert from_channel(SimpleNamespace(world=3, host_ids=["a", "b", "a"])) == {0: "a", 1: "b", 2: "a"}
    assert from_channel(SimpleNamespace(world=3, host_ids=["a", "b"], session=None)) is None
    assert from_channel(SimpleNamespace(world=2, host_ids=["a", ""], session=None)) is None


# ---------------------------------------------------------------------- rank numbering
def _workers(hosts: int, k: int) -> list[tuple[None, str, str, int]]:
    return [(None, f"host{h}/boot/{h}", f"10.77.0.{h + 1}:{40000 + 7 * h + j}", 100 * h + j)
            for h in range(hosts) for j in range(k)]


@pytest.mark.parametrize("hosts,k", [(4, 2), (3, 3), (2, 1), (11, 2)])
def test_ranks_are_host_contiguous_whatever_the_join_order(hosts: int, k: int) -> None:
    workers = _workers(hosts, k)
    rng = random.Random(hosts * 10 + k)
    for _ in range(20):
        order = workers[:]
        rng.shuffle(order)
        ranks = assign_ranks(order, hosts * k)
        assert sorted(ranks) == list(range(hosts * k))
        for w, r in zip(order, ranks):
            h = int(w[1][4:].split("/")[0])
            assert h * k <= r < (h + 1) * k, (w, r)   # hosts in address order (10.77.0.10 after .9)
        # within a host: pid order, so the numbering is the same on every run
        by_pid = {w[3]: r for w, r in zip(order, ranks)}
        assert by_pid == {w[3]: r for w, r in zip(workers, assign_ranks(workers, hosts * k))}


def test_requested_ranks_are_kept_and_the_rest_fill_host_by_host() -> None:
    workers = _workers(2, 2)
    workers[3] = (0,) + workers[3][1:]            # host1's second worker asks for rank 0
    ranks = assign_ranks(workers, 4)
    assert ranks[3] == 0
    assert ranks[:3] == [1, 2, 3]


def test_the_master_hook_numbers_its_connections() -> None:
    conns = [SimpleNamespace(rank=None, peer=peer, hello={"host_id": hid, "pid": pid})
             for _, hid, peer, pid in reversed(_workers(3, 2))]
    number_workers(conns, 6)
    assert [c.rank for c in conns] == [5, 4, 3, 2, 1, 0]


# ---------------------------------------------------------------------- selection
TWO_HOSTS = Topology({0: "a", 1: "a", 2: "b", 3: "b"})
ONE_HOST = Topology({0: "a", 1: "a", 2: "a", 3: "a"})


@pytest.mark.parametrize("topo,array_ok,shm_offered,nbytes,want", [
    (TWO_HOSTS, True, True, 64 << 20, "hier"),
    (TWO_HOSTS, True, False, 1024, "hier"),
    (TWO_HOSTS, False, False, 0, "tree"),       # not an array of numbers with a named reduction
    (ONE_HOST, True, True, 64 << 20, "shm"),
    (ONE_HOST, True, False, 64 << 20, "ring"),  # the local channel: no segment offered
    (ONE_HOST, True, False, 1024, "doubling"),   # over sockets, small: recursive doubling
    (ONE_HOST, False, False, 1024, "tree"),
    (None, True, False, 64 << 20, "ring"),
    (None, True, False, (1 << 20) - 1, "doubling"),
    (None, True, False, 100, "doubling"),
    (None, False, False, 100, "tree"),
])
def test_auto_selection(topo, array_ok, shm_offered, nbytes, want) -> None:
    got = choose("auto", nranks=4, array_ok=array_ok, ring_ok=array_ok, nbytes=nbytes, ring_threshold=1 << 20,
                 topology=topo, shm_offered=shm_offered)
    assert got == want


def test_forced_and_trivial_selection() -> None:
    for via in ("tree", "ring", "doubling", "shm", "hier"):
        assert choose(via, nranks=4, array_ok=True, ring_ok=True, nbytes=1, ring_threshold=1,
                      topology=TWO_HOSTS, shm_offered=True) == via
    assert choose("auto", nranks=1, array_ok=True, ring_ok=True, nbytes=1, ring_threshold=1,
                  topology=None, shm_offered=True) == "one"


def test_leader_algorithm_by_size() -> None:
    assert leader_algorithm(64 << 20, 16 << 20, 4, 1 << 20) == "ring"
    assert leader_algorithm(2 << 20, 1 << 19, 4, 1 << 20) == "ring"
    assert leader_algorithm(1 << 20, 1 << 18, 4, 1 << 20) == "doubling"   # measured: doubling wins at 1 MB
    assert leader_algorithm(1024, 256, 4, 1 << 20) == "doubling"
    assert leader_algorithm(64 << 20, 3, 4, 1 << 20) == "doubling"    # fewer elements than hosts
    assert leader_algorithm(64 << 20, 16 << 20, 1, 1 << 20) == "none"


# ---------------------------------------------------------------------- hierarchical == flat (local channel)
HOSTS = {
    4: {0: "a", 1: "a", 2: "b", 3: "b"},
    5: {0: "a", 1: "b", 2: "a", 3: "c", 4: "b"},      # interleaved, a host with one rank, H=3 (folding)
    6: {0: "a", 1: "b", 2: "c", 3: "d", 4: "e", 5: "e"},
    7: {0: "a", 1: "b", 2: "c", 3: "a", 4: "b", 5: "c"},   # 3 hosts x 2, interleaved: one ring per local rank
}
SIZES = [1, 5, 1000, 70_000, 70_001]      # odd: shares of one element more or less


def _allreduce_all(ctx, via: str, reduce: str, dtype: str, sizes: list[int]) -> list[np.ndarray]:
    op = C.AllReduce(ctx, edge=3, op=reduce, via=via, ring_threshold=16 << 10, chunk_bytes=16 << 10,
                     shm_chunk_bytes=8192)
    rng = np.random.default_rng(ctx.rank)
    out = []
    for n in sizes:
        if dtype == "int64":
            v = rng.integers(-1000, 1000, n).astype(np.int64)
        else:
            v = rng.standard_normal(n).astype(dtype)
        out.append(op.allreduce(v.reshape(-1, 1) if n % 5 == 0 else v, timeout=60))
    op.close()
    return out


def _plan(world: int) -> TaskPlan:
    hosts = HOSTS[world]
    plan = TaskPlan(len(hosts))
    plan.set_hosts(hosts)
    return plan


@pytest.mark.parametrize("shape,reduce,dtype,shm_ok", [
    (4, "sum", "int64", True), (5, "sum", "int64", True), (6, "max", "float64", True), (7, "sum", "int64", True),
    (5, "sum", "float32", False), (7, "sum", "float64", False), (4, "prod", "int64", False)])
def test_hierarchical_equals_flat(monkeypatch: pytest.MonkeyPatch, shape: int, reduce: str, dtype: str,
                                  shm_ok: bool) -> None:
    """``shape`` names a host layout of HOSTS; 4 and 7 have equal hosts (one ring per local rank for the
    large sizes), 5 and 6 do not (the leaders' ring); small sizes go by recursive doubling."""
    world = len(HOSTS[shape])
    if not shm_ok:
        monkeypatch.setattr(shm_path, "supported", lambda: False)    # local phases over sockets
    elif not shm_path.supported():
        pytest.skip("needs /dev/shm on an x86-64 machine")
    sizes = SIZES if reduce != "prod" else [1, 5, 40]
    multi = []
    orig = C.allreduce.RankAllReduce._multi_ring

    def spy(self, *a, **k):
        multi.append(self.op.rank)
        return orig(self, *a, **k)
    monkeypatch.setattr(C.allreduce.RankAllReduce, "_multi_ring", spy)
    hier = run_local(world, _allreduce_all, "hier", reduce, dtype, sizes, plan=_plan(shape), timeout=120)
    # flat: "auto" without hosts in the plan (one host, the local channel: the ring or the tree by size)
    flat = run_local(world, _allreduce_all, "auto", reduce, dtype, sizes, timeout=120)
    for r in range(world):
        for h, f in zip(hier[r], flat[r]):
            assert h.shape == f.shape and h.dtype == f.dtype
            if dtype == "int64" or reduce == "max":
                assert np.array_equal(h, f)
            else:
                np.testing.assert_allclose(h, f, rtol=1e-5, atol=1e-5)
    assert sorted(set(multi)) == (list(range(world)) if shape in (4, 7) and reduce != "prod" else [])
    for a, b in itertools.combinations(range(world), 2):      # bit-identical on every rank
        for x, y in zip(hier[a], hier[b]):
            assert np.array_equal(x, y)


def _allreduce_into(ctx, mode: str, sizes: list[int]) -> list[np.ndarray]:
    """The calls of :func:`_allreduce_all` (hier, float64 sums) with ``out=`` a fresh array ("out") or the
    value itself ("inplace"): the result must be that very array."""
    op = C.AllReduce(ctx, edge=3, op="sum", via="hier", ring_threshold=16 << 10, chunk_bytes=16 << 10,
                     shm_chunk_bytes=8192)
    rng = np.random.default_rng(ctx.rank)
    got = []
    for n in sizes:
        v = rng.standard_normal(n)
        keep = v.copy()
        out = v if mode == "inplace" else np.full_like(v, np.nan)
        res = op.allreduce(v, out=out, timeout=60)
        assert res is out
        if mode == "out":
            assert np.array_equal(v, keep)                 # the input is only read
        got.append(res.copy())
    op.close()
    return got


@pytest.mark.parametrize("shape", [5, 6, 7])
@pytest.mark.parametrize("mode", ["out", "inplace"])
def test_hierarchical_writes_into_out(shape: int, mode: str) -> None:
    """The leaders' ring writes straight into ``out`` (also in place, with no host phase before it: the
    one-rank hosts of 5 and 6); every rank gets the same array as without ``out``."""
    world = len(HOSTS[shape])
    sizes = [1, 1000, 70_000]
    into = run_local(world, _allreduce_into, mode, sizes, plan=_plan(shape), timeout=120)
    plain = run_local(world, _allreduce_all, "hier", "sum", "float64", sizes, plan=_plan(shape), timeout=120)
    for r in range(world):
        for a, b in zip(into[r], plain[r]):
            assert np.array_equal(a, b.reshape(-1))


def test_auto_uses_the_hierarchy_when_the_plan_says_several_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    used = []
    orig = C.allreduce.RankAllReduce._hier

    def spy(self, *a, **k):
        used.append(self.op.rank)
        return orig(self, *a, **k)
    monkeypatch.setattr(C.allreduce.RankAllReduce, "_hier", spy)
    res = run_local(4, _allreduce_all, "auto", "sum", "int64", [1000], plan=_plan(4), timeout=60)
    assert sorted(used) == [0, 1, 2, 3]
    assert all(np.array_equal(r[0], res[0][0]) for r in res)


@pytest.mark.parametrize("odd_rank", [1, 2])     # a non-leader (caught inside its host) / a leader
def test_hierarchical_mismatch_raises_on_every_rank(odd_rank: int) -> None:
    def body(ctx):
        op = C.AllReduce(ctx, edge=3, op="sum", via="hier")
        n = 11 if ctx.rank == odd_rank else 10
        with pytest.raises(MismatchError):
            op.allreduce(np.ones(n), timeout=30)
        return True
    assert run_local(4, body, plan=_plan(4), timeout=90) == [True] * 4


# ---------------------------------------------------------------------- host-aware trees
from collectives import routing
from collectives.routing import HostTree, KaryTree, tree_for


@pytest.mark.parametrize("root", [0, 3, 7])
def test_host_tree_crosses_each_host_link_once(root: int) -> None:
    topo = Topology({r: f"h{r % 4}" for r in range(12)})       # 4 hosts x 3, interleaved
    t = HostTree(root, range(12), 2, topo)
    assert sorted(t.order) == list(range(12)) and t.order[0] == root
    cross = [(r, t.parent(r)) for r in range(12) if t.parent(r) is not None
             and topo.host_of[r] != topo.host_of[t.parent(r)]]
    assert len(cross) == 3                                     # one edge per other host, into the root
    assert all(p == root for _, p in cross)
    for r in range(12):                                        # a tree: every rank reaches the root
        seen, x = set(), r
        while x is not None:
            assert x not in seen
            seen.add(x)
            x = t.parent(x)
        assert r in t.subtree(root)
        assert all(t.parent(c) == r for c in t.children(r))
        assert t.level(r) == (0 if r == root else t.level(t.parent(r)) + 1)
    flat = KaryTree(root, range(12), 2)
    assert sum(topo.host_of[r] != topo.host_of[flat.parent(r)] for r in range(12) if r != root) > 3


def test_tree_for_uses_the_plans_hosts_only_when_they_help(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = SimpleNamespace(plan=TaskPlan(6), channel=None)
    assert type(tree_for(ctx, 0, range(6))) is KaryTree              # hosts unknown
    ctx.plan.set_hosts({r: f"h{r % 2}" for r in range(6)})
    assert isinstance(tree_for(ctx, 0, range(6)), HostTree)
    assert type(tree_for(ctx, 0, [0, 1])) is KaryTree                # one rank per host: nothing to gain
    monkeypatch.setattr(routing, "HOST_TREES", False)
    assert type(tree_for(ctx, 0, range(6))) is KaryTree


@pytest.mark.parametrize("mode", ["batch", "streaming"])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_operation_over_host_trees(mode: str, seed: int) -> None:
    """The collectives matrix on the local channel with 3 hosts x 2 (interleaved) in the plan: every
    reduce/gather/broadcast tree is a HostTree; results as the sequential reference says."""
    from tests.collectives.reference import check, random_case
    from tests.collectives.scenarios import OPS, run_op
    world = 6
    for op in OPS:
        for kind in ("numpy", "strings"):
            p = random_case(world, op, mode, kind, seed)
            plan = TaskPlan(world, {int(t): r for t, r in p["plan"].items()})
            plan.set_hosts({r: f"h{r % 3}" for r in range(world)})
            res = run_local(world, run_op, p, plan=plan, timeout=120)
            merged = {int(d): items for r in res for d, items in r.items()}
            check(p, merged)


def test_cluster_chart_writes_an_svg_and_a_table() -> None:
    import xml.etree.ElementTree as ET

    from benchmarks.cluster_chart import markdown, svg_chart
    series = {"tn auto": [(1024, 40.0), (64 << 20, 900.0)], "MPICH": [(1024, 30.0), (64 << 20, 2000.0)],
              "bound": [(1024, 0.012), (64 << 20, 805.0)]}
    root = ET.fromstring(svg_chart("t", series, dashed=["bound"]))
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(lines) == 3 and "stroke-dasharray" in lines[2].attrib
    table = markdown(series).splitlines()
    assert table[0] == "| size | tn auto | MPICH | bound |" and table[2].startswith("| 1 KB | 40 | 30 |")
    assert table[3].startswith("| 64 MB | 900 | 2,000 | 805")


def test_hier_refuses_a_value_it_cannot_take_on_every_rank() -> None:
    from twisternet.errors import TwisternetError

    def body(ctx):
        op = C.AllReduce(ctx, edge=3, op="sum", via="hier")
        value = [1, 2] if ctx.rank == 3 else np.ones(4)
        with pytest.raises(TwisternetError) as got:
            op.allreduce(value, timeout=30)
        return type(got.value).__name__, str(got.value)
    res = run_local(4, body, plan=_plan(4), timeout=90)
    assert res[3][0] == "ConfigError"
    assert all("via='hier' needs" in msg for _, msg in res), res


@pytest.mark.parametrize("dies", [1, 2, 3])   # a non-leader on the other host / a leader / its partner
def test_a_rank_lost_on_another_host_ends_every_hierarchical_call(dies: int) -> None:
    """Every surviving rank raises PeerLostError (none waits for its timeout), wherever it waits: in the
    leaders' exchange, or in its host's shared-memory phase behind a leader that is still alive."""
    from twisternet.errors import PeerLostError

    import time
    seen: dict[int, tuple[str, float]] = {}

    def body(ctx):
        op = C.AllReduce(ctx, edge=3, op="sum", via="hier")
        if ctx.rank == dies:
            op.allreduce(np.ones(10), timeout=60)        # set-up done, every path warm
            raise RuntimeError("this rank dies")
        t0 = time.monotonic()
        try:     # the first call may already see the loss (the dying rank did its part of it)
            op.allreduce(np.ones(10), timeout=60)
            op.allreduce(np.ones(10), timeout=60)
            seen[ctx.rank] = ("no error", 0.0)
        except Exception as e:  # noqa: BLE001 - recorded for the assertion below
            seen[ctx.rank] = (type(e).__name__, time.monotonic() - t0)
        return True
    plan = TaskPlan(4)
    plan.set_hosts({0: "a", 1: "a", 2: "b", 3: "b"})
    with pytest.raises(RuntimeError, match="this rank dies"):
        run_local(4, body, plan=plan, timeout=90)
    assert sorted(seen) == sorted({0, 1, 2, 3} - {dies})
    assert all(name == PeerLostError.__name__ and took < 50 for name, took in seen.values()), seen


def test_ranks_on_this_kernel_count_namespaces_of_one_machine_together() -> None:
    """The busy-poll rule counts the ranks that share this machine's cores: network namespaces (the
    emulated cluster's hosts) and containers of one kernel share its boot id."""
    from twisternet.topology import kernel_of, ranks_on_this_kernel
    ids = ["h0/boot-a/1", "h0/boot-a/1", "h1/boot-a/2", "h1/boot-a/2", "h2/boot-b/1", "odd", "odd"]
    assert kernel_of("h0/boot-a/1") == "boot-a" and kernel_of("odd") == "odd"
    assert kernel_of("h/no-boot-id/3") == "h/no-boot-id/3"         # no boot id: the whole id
    assert ranks_on_this_kernel(ids, 0) == 4 and ranks_on_this_kernel(ids, 3) == 4
    assert ranks_on_this_kernel(ids, 4) == 1 and ranks_on_this_kernel(ids, 5) == 2
    assert ranks_on_this_kernel(dict(enumerate(ids)), 2) == 4
