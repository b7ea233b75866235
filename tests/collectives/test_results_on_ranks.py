"""results() on every rank, as SPMD code (and the README) calls it: a rank that runs no destination task
gets nothing; calls that cannot be answered say what to do instead."""

from __future__ import annotations

import operator

import pytest

import collectives as C
from twisternet.testing import run_local

pytestmark = pytest.mark.timeout(120)


def test_ranks_without_a_destination_iterate_nothing() -> None:
    def body(ctx):
        counts = C.KeyedReduce(ctx, sources=ctx.tasks, destinations=[0, 1], edge=1, reduce=operator.add,
                               key_type="str", mode="batch")
        for w in ["a", "b", "a", "c"]:
            counts.send(ctx.rank, w, 1)
        counts.finish(ctx.rank)
        got = dict(counts.results())
        gather = C.Gather(ctx, edge=2)
        gather.send(ctx.rank, ctx.rank)
        gather.finish(ctx.rank)
        vals = sorted(gather.values())
        msg = ""
        reduce = C.Reduce(ctx, edge=3)
        if ctx.rank != 0:
            with pytest.raises(ValueError) as ei:
                reduce.result()      # one value at one rank: elsewhere an error that says where to ask
            msg = str(ei.value)
        reduce.abort()
        return got, vals, msg

    res = run_local(4, body, timeout=90)
    merged = {}
    for got, _, _ in res:
        merged.update(got)
    assert merged == {"a": 8, "b": 4, "c": 4}
    assert res[2][0] == {} and res[3][0] == {}
    assert res[0][1] == [0, 1, 2, 3] and res[1][1] == []
    for rank in (1, 2, 3):
        msg = res[rank][2]
        assert "runs none of the destination tasks [0]" in msg and "ctx.rank in op.destination_ranks" in msg


def test_several_local_destinations_ask_for_task() -> None:
    def body(ctx):
        op = C.AllGather(ctx, destinations=[0, 1], edge=1, mode="streaming")
        with pytest.raises(ValueError) as ei:
            op.results()
        op.abort()
        return str(ei.value)
    msg = run_local(1, body, plan={0: 0, 1: 0})[0]
    assert "several destination tasks [0, 1]" in msg and "pass task=" in msg
