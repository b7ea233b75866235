"""Batch Gather with a finish quorum (a partial barrier over the sources' finishes)."""

import threading
import time

import pytest

from collectives import Gather
from twisternet.errors import ConfigError
from twisternet.testing import run_local

pytestmark = pytest.mark.timeout(60)


def gather_job(quorum, slow, delay=None, n=50):
    """A Gather job whose ``slow`` ranks finish late: ``delay`` seconds late, or (``delay=None``) only
    once rank 0 has its results (at most 30 s) -- so "the quorum left them out" is an order of events,
    not a time: a quorum that waited for them would make rank 0 wait the 30 s and include them."""
    released = threading.Event()

    def job(ctx):
        g = Gather(ctx, sources=ctx.tasks, destinations=[0], edge=3, quorum=quorum)
        for i in range(n):
            g.send(ctx.rank, (ctx.rank, i))
        if ctx.rank in slow:
            if delay is None:
                released.wait(30)
            else:
                time.sleep(delay)
        g.finish(ctx.rank)
        out = None
        if ctx.rank == 0:
            t = time.monotonic()
            res = list(g.results())
            out = (res, g.left_out, time.monotonic() - t)
            released.set()
        g.close()
        return out
    return job


def expected(sources, n=50):
    return [(s, (s, i)) for s in sources for i in range(n)]


def test_percent_and_min_wait_leave_the_straggler_out():
    res, left_out, _ = run_local(4, gather_job({"percent": 75, "min_wait": 0.2}, {3}))[0]
    assert left_out == [3]                      # did not wait for the straggler
    assert res == expected([0, 1, 2])          # complete records of those that made it, in order


def test_everyone_on_time_means_nobody_left_out():
    res, left_out, _ = run_local(4, gather_job({"percent": 50, "min_wait": 5.0}, set()))[0]
    assert left_out == [] and res == expected([0, 1, 2, 3])   # max reached: fires at once


def test_timeout_from_first_finish_overrides_the_rest():
    res, left_out, _ = run_local(4, gather_job({"timeout": 0.3, "percent": 100}, {2, 3}))[0]
    assert left_out == [2, 3] and res == expected([0, 1])


def test_knee_release():
    res, left_out, _ = run_local(4, gather_job({"knee": True, "percent": 75}, {3}))[0]
    assert left_out == [3] and res == expected([0, 1, 2])


def test_without_quorum_it_waits_for_all():
    res, left_out, _ = run_local(3, gather_job(None, {2}, delay=0.5))[0]
    assert left_out == [] and res == expected([0, 1, 2])   # rank 2's records: it waited for the late one


@pytest.mark.parametrize("kwargs", [{"mode": "streaming", "quorum": {"percent": 50}},
                                    {"quorum": {"percentage": 50}}])
def test_bad_quorum_is_a_config_error(kwargs):
    def job(ctx):
        with pytest.raises(ConfigError, match="quorum"):
            Gather(ctx, sources=ctx.tasks, destinations=[0], edge=3, **kwargs)
        return True
    assert run_local(2, job) == [True, True]
