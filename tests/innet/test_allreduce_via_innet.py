"""``AllReduce(..., via="innet")``: the collectives' allreduce through the ATP software switch and PS."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

import collectives as C
from innet import DEFAULT_SCALE, error_bound
from tests.jobs import lines, run_mpi, run_tcp
from twisternet.errors import ConfigError
from twisternet.testing import run_local

S = Path(__file__).parent / "scripts" / "innet_allreduce_job.py"


def _value(rank: int, size: int) -> np.ndarray:
    return (np.random.default_rng([rank, size]).standard_normal(size) * 50).astype(np.float32)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 5, 8])
def test_results_within_the_quantization_bound(world: int) -> None:
    sizes = [1, 61, 62, 63, 5000]

    def body(ctx):
        op = C.AllReduce(ctx, edge=4, op="sum", via="innet")
        with op:
            out = [op.allreduce(_value(ctx.rank, n)) for n in sizes]
            x64 = op.allreduce(np.full((3, 4), 0.25, np.float64) * (ctx.rank + 1))   # other dtypes, shapes
        return out, x64

    res = run_local(world, body, timeout=200)
    for k, n in enumerate(sizes):
        ref = sum(_value(r, n).astype(np.float64) for r in range(world))
        bound = error_bound(ref, DEFAULT_SCALE, world)
        for out, _ in res:
            assert out[k].dtype == np.float32 and out[k].shape == (n,)
            assert (np.abs(out[k] - ref) <= bound).all()
    want = 0.25 * world * (world + 1) / 2
    for _, x64 in res:
        assert x64.dtype == np.float64 and x64.shape == (3, 4)
        assert np.allclose(x64, want, atol=float(error_bound(np.array([want]), DEFAULT_SCALE, world)[0]))


@pytest.mark.timeout(240)
def test_float64_results_within_the_quantization_bound() -> None:
    """float64 values that float32 cannot hold: quantized from float64, within the bound everywhere."""
    world, n = 3, 30_000

    def value(rank: int) -> np.ndarray:
        return np.random.default_rng([rank, 64]).standard_normal(n) * 50

    def body(ctx):
        with C.AllReduce(ctx, edge=7, op="sum", via="innet") as op:
            return op.allreduce(value(ctx.rank))

    ref = sum(value(r) for r in range(world))
    bound = error_bound(ref, DEFAULT_SCALE, world)
    for out in run_local(world, body, timeout=200):
        assert out.dtype == np.float64
        bad = np.abs(out - ref) > bound
        assert not bad.any(), f"{int(bad.sum())} of {n} elements outside the bound"


def test_float64_beyond_the_int32_range_within_the_documented_bound() -> None:
    """Overflow fragments of float64 inputs travel as float32: the documented extra term covers them."""
    from innet import InnetCluster, JobSpec
    world = 3
    inputs = [np.random.default_rng([r, 65]).standard_normal(500) * 1e4 for r in range(world)]
    inputs[0][:10] = 1e4 + 1 / 3                             # and some that cancel
    inputs[1][:10] = -1e4
    with InnetCluster([JobSpec(1, world)]) as cluster:
        outs = cluster.allreduce(1, inputs)
    ref = np.sum(inputs, axis=0)
    bound = error_bound(ref, DEFAULT_SCALE, world, overflow_abs_sum=np.sum(np.abs(inputs), axis=0))
    assert all((np.abs(o.astype(np.float64) - ref) <= bound).all() for o in outs)
    assert all(h.last_stats.overflow_fragments > 0 for h in cluster.jobs[1])


@pytest.mark.timeout(120)
def test_the_operation_timeout_bounds_a_call() -> None:
    """The call's timeout (default: the operation's, default tn.init(timeout=...)) bounds an in-network
    call too (it was always 300 s)."""
    import threading
    from twisternet.errors import OperationTimeout
    release = threading.Event()

    def body(ctx):
        with C.AllReduce(ctx, edge=8, op="sum", via="innet", timeout=60.0) as op:
            op.allreduce(np.ones(10, np.float32))              # set-up, together (slow on a busy machine)
            if ctx.rank == 1:
                release.wait(60)                               # alive, but never calls again
                return None
            t0 = time.monotonic()
            try:
                op.allreduce(np.ones(10, np.float32), timeout=3.0)
                return "no error"
            except OperationTimeout as e:
                return type(e).__name__, time.monotonic() - t0
            finally:
                release.set()

    res = run_local(2, body, timeout=100)
    name, took = res[0]
    assert name == "OperationTimeout" and took < 30


@pytest.mark.timeout(120)
def test_a_lost_peer_ends_the_call_at_once() -> None:
    """A rank that dies mid-job: the others' in-network call raises PeerLostError, no wait for the timeout."""
    from twisternet.errors import PeerLostError
    seen: dict = {}

    def body(ctx):
        with C.AllReduce(ctx, edge=9, op="sum", via="innet", timeout=90.0) as op:
            op.allreduce(np.ones(10, np.float32))
            if ctx.rank == 1:
                raise RuntimeError("rank 1 dies")
            t0 = time.monotonic()
            try:
                op.allreduce(np.ones(10, np.float32))
            except PeerLostError as e:
                seen["error"] = (e.rank, time.monotonic() - t0)
                raise

    with pytest.raises(RuntimeError, match="rank 1 dies"):
        run_local(2, body, timeout=100)
    rank, took = seen["error"]
    assert rank == 1 and took < 30


def test_unreachable_innet_host_is_a_config_error() -> None:
    from collectives.innet_allreduce import _check_reachable
    _check_reachable("op", [0, 1], "127.0.0.1", [("127.0.0.1", 1), ("127.0.0.1", 2)])
    _check_reachable("op", [0, 1], "10.0.0.1", [("10.0.0.1", 1), ("10.0.0.2", 2)])
    with pytest.raises(ConfigError, match="innet_host.*rank.s. 1 at 10.0.0.2"):
        _check_reachable("op", [0, 1], "127.0.0.1", [("127.0.0.1", 1), ("10.0.0.2", 2)])
    with pytest.raises(ConfigError, match="bind loopback"):
        _check_reachable("op", [0, 3], "10.0.0.1", [("10.0.0.1", 1), ("127.0.0.1", 2)])
    # all on loopback, but two hosts (an MPI job across machines with the default innet_host)
    _check_reachable("op", [0, 1], "127.0.0.1", [("127.0.0.1", 1), ("127.0.0.1", 2)], [7, 7])
    with pytest.raises(ConfigError, match="rank.s. 1 at 127.0.0.1 of another host"):
        _check_reachable("op", [0, 1], "127.0.0.1", [("127.0.0.1", 1), ("127.0.0.1", 2)], [7, 8])


def test_innet_host_defaults_to_the_interface_towards_the_master() -> None:
    from collectives.innet_allreduce import _innet_host
    from twisternet.config import load_config
    assert _innet_host(load_config(env={})) == "127.0.0.1"                      # no master: loopback
    assert _innet_host(load_config(env={}, master="127.0.0.1:9")) == "127.0.0.1"
    assert _innet_host(load_config(env={}, master="127.0.0.1:9", innet_host="127.0.0.2")) == "127.0.0.2"
    assert _innet_host(load_config(env={}, master="127.0.0.1:9", advertise_host="127.0.0.3")) == "127.0.0.3"


def test_bad_input_is_refused_before_anything_starts() -> None:
    def body(ctx):
        errors = []
        with C.AllReduce(ctx, edge=5, op="max", via="innet") as op:
            try:
                op.allreduce(np.ones(3, np.float32))
            except ConfigError as e:
                errors.append("op" in str(e) and "sum" in str(e))
        with C.AllReduce(ctx, edge=6, op="sum", via="innet") as op:
            for bad in (np.ones(3, np.int32), [1.0, 2.0]):
                try:
                    op.allreduce(bad)
                except TypeError as e:
                    errors.append("float" in str(e))
            assert op._rank_allreduce.innet.job is None        # nothing was set up
        return errors

    assert run_local(2, body, timeout=60) == [[True, True, True]] * 2


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.timeout(200)
@pytest.mark.parametrize("n", [2, 4])
def test_in_a_tcp_job_and_nothing_is_left_running(n: int) -> None:
    p = run_tcp(n, S, "1,1000,100000", timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = lines(p, "RESULT")
    assert len(res) == 3 * n and all("ok=True" in r and "fallback=False" in r for r in res), res
    pids = [int(x) for x in lines(p, "PIDS")[0].split()[1:]]
    assert _gone(pids), f"switch/PS processes {pids} outlived the job"


@pytest.mark.timeout(200)
def test_under_mpiexec(mpiexec: str) -> None:
    p = run_mpi(3, S, "10,20000", timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    oks = re.findall(r"RESULT rank=\d+ call=\d+ size=\d+ ok=(\w+)", p.stdout)   # mpiexec may glue lines together
    assert oks == ["True"] * 6, p.stdout[-2000:]


@pytest.mark.timeout(200)
def test_switch_killed_mid_job_finishes_through_the_ps() -> None:
    p = run_tcp(3, S, "20000,20000,20000", "kill", timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = lines(p, "RESULT")
    assert len(res) == 9 and all("ok=True" in r for r in res), res
    # the calls after the kill, by call index: the ranks' lines interleave in any order
    after = [r for r in res if int(re.search(r"call=(\d+)", r).group(1)) > 0]
    assert len(after) == 6 and all("fallback=True" in r for r in after), res
    assert "falling back" in p.stdout + p.stderr or "fell back" in p.stdout + p.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_64mb_through_the_switch() -> None:
    p = run_tcp(2, S, str(16 << 20), timeout=850)      # 16 Mi float32 values = 64 MB
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert all("ok=True" in r for r in lines(p, "RESULT"))


@pytest.mark.timeout(240)
def test_wide_packets_from_the_first_ranks_innet_values() -> None:
    """innet_values widens the packets of the switch, PS and workers the operation starts (ranks that
    disagree follow the first rank, so nobody sends packets the switch would drop as the wrong size)."""
    world, n = 3, 10_000
    seen: list[int] = []

    def body(ctx):
        with C.AllReduce(ctx, edge=9, op="sum", via="innet") as op:
            out = op.allreduce(_value(ctx.rank, n))
            seen.append(op._rank_allreduce.innet.job.worker.value_count)
            return out

    res = run_local(world, body, timeout=200, innet_values=1000)
    assert seen == [1000] * world
    ref = sum(_value(r, n).astype(np.float64) for r in range(world))
    for out in res:
        assert (np.abs(out - ref) <= error_bound(ref, DEFAULT_SCALE, world)).all()


def test_innet_values_out_of_range_is_a_config_error() -> None:
    from twisternet.config import load_config
    for bad in (0, 16001):
        with pytest.raises(ConfigError, match="innet_values"):
            load_config(env={}, innet_values=bad)


@pytest.mark.timeout(120)
def test_innet_values_unlike_the_shared_switchs_is_a_config_error_on_every_rank() -> None:
    """A shared switch carries its own width (read from its P4Info): a different innet_values would be
    dropped there as the wrong size (a hang until the timeout), so every rank refuses it at once."""
    from innet.service import start_switch

    def body(ctx):
        with C.AllReduce(ctx, edge=9, op="sum", via="innet") as op:
            try:
                op.allreduce(np.ones(10, np.float32))
            except ConfigError as e:
                return str(e)
            return "no error"

    switch = start_switch("127.0.0.1")                     # 62 values, P4Runtime without a token
    try:
        res = run_local(2, body, timeout=60, innet_values=1000,
                        innet_switch="{}:{}".format(*switch.udp_addr),
                        innet_p4runtime="{}:{}".format(*switch.p4runtime_addr))
    finally:
        switch.close()
    assert all("innet_values" in r and "shared switch" in r and "carries 62" in r for r in res), res


@pytest.mark.timeout(180)
def test_a_shared_switchs_width_is_read_from_its_p4info() -> None:
    """innet_values left unset: the job takes a wide shared switch's width (negotiated through the
    controller), and the results are exact within the bound."""
    from innet.service import start_switch

    world, size, width = 3, 20_000, 300

    def value(r: int) -> np.ndarray:
        return (np.random.default_rng([r, size]).standard_normal(size) * 20).astype(np.float32)

    def body(ctx):
        with C.AllReduce(ctx, edge=9, op="sum", via="innet") as op:
            out = [op.allreduce(value(ctx.rank)) for _ in range(2)]
            path = op._rank_allreduce.innet
            return out, path.job.worker.value_count, path.last_stats.fallback

    switch = start_switch("127.0.0.1", value_count=width)
    try:
        res = run_local(world, body, timeout=150, innet_switch="{}:{}".format(*switch.udp_addr),
                        innet_p4runtime="{}:{}".format(*switch.p4runtime_addr))
    finally:
        switch.close()
    ref = sum(value(r).astype(np.float64) for r in range(world))
    bound = error_bound(ref, DEFAULT_SCALE, world)
    for out, values, fallback in res:
        assert values == width and not fallback
        for got in out:
            assert (np.abs(got - ref) <= bound).all()


@pytest.mark.timeout(240)
def test_the_jobs_innet_engine_settings_reach_the_switch_ps_and_workers(monkeypatch) -> None:
    """innet_dataplane, innet_ps_core and innet_hostio (config keys, so also settable in a config file)
    pick the switch's dataplane and the PS's packet path of the helpers the operation starts (whose
    environment carries no TWISTERNET_* setting) and the workers' datagram I/O; old code validated
    them and left every helper on "auto"."""
    from innet import service

    started: list[tuple[str, list[str]]] = []
    real = service._start_cli

    def spy(module, args, *a, **kw):
        started.append((module, list(args)))
        return real(module, args, *a, **kw)

    monkeypatch.setattr(service, "_start_cli", spy)

    def body(ctx):
        with C.AllReduce(ctx, edge=4, op="sum", via="innet") as op:
            out = op.allreduce(_value(ctx.rank, 100))
            return out, op._rank_allreduce.innet.job.worker._io.compiled

    res = run_local(2, body, timeout=200, innet_dataplane="python", innet_ps_core="python",
                    innet_hostio="python")
    ref = sum(_value(r, 100).astype(np.float64) for r in range(2))
    for out, compiled in res:
        assert (np.abs(out - ref) <= error_bound(ref, DEFAULT_SCALE, 2)).all()
        assert compiled is False
    args = dict(started)
    assert "--core" in args["innet.ps"] and args["innet.ps"][args["innet.ps"].index("--core") + 1] == "python"
    sw = args["innet.switch_server"]
    assert "--dataplane" in sw and sw[sw.index("--dataplane") + 1] == "python"


def test_a_worker_asked_for_compiled_io_that_is_not_built_says_so(monkeypatch) -> None:
    from innet import hostio
    from innet.worker import AtpWorker

    with pytest.raises(ValueError, match="auto, c or python"):
        AtpWorker(1, 0, 2, None, ("127.0.0.1", 9), hostio="fast")
    monkeypatch.setattr(hostio, "_hostio", None)
    with pytest.raises(RuntimeError, match="innet_hostio: the compiled helper .* is not built"):
        AtpWorker(1, 0, 2, None, ("127.0.0.1", 9), hostio="c")
    w = AtpWorker(1, 0, 2, None, ("127.0.0.1", 9), hostio="auto")      # falls back to Python
    try:
        assert w._io.compiled is False
    finally:
        w.close()
