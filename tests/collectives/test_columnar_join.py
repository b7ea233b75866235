"""Join of two tables by key on several ranks, against a single-process pyarrow join of the whole
tables (rows compared as multisets: the order within one key is not specified)."""

from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

import collectives as C
from twisternet.errors import ConfigError
from twisternet.testing import run_local


def side(name: str, rank: int, n: int) -> pa.Table:
    rng = np.random.default_rng([ord(name[0]), rank])
    return pa.table({"k": pa.array(rng.integers(0, 30, n), mask=rng.random(n) < 0.05),
                     "s": [f"g{x}" for x in rng.integers(0, 3, n)],
                     f"{name}_val": rng.integers(0, 1000, n), "common": rng.integers(0, 5, n)})


def rows(t: pa.Table) -> list:
    cols = sorted(t.column_names)
    return sorted(zip(*[t.column(c).to_pylist() for c in cols]), key=repr)


@pytest.mark.parametrize("how", ["inner", "left", "right", "outer"])
@pytest.mark.parametrize("key", ["k", ["k", "s"]])
def test_join_matches_pyarrow(how, key):
    def body(ctx):
        with C.Join(ctx, edge=20, key=key, how=how) as j:
            for t in j.local_sources:
                j.send_left(t, side("left", t, 120))
                j.send_right(t, side("right", t, 80))
                j.finish(t)
            return [j.result_table(d) for d in j.local_destinations]
    res = run_local(3, body, timeout=120)
    got = pa.concat_tables([t for r in res for t in r])
    left = pa.concat_tables([side("left", r, 120) for r in range(3)])
    right = pa.concat_tables([side("right", r, 80) for r in range(3)])
    want = left.join(right, keys=key, join_type={"inner": "inner", "left": "left outer", "right": "right outer",
                                                 "outer": "full outer"}[how],
                     left_suffix="_left", right_suffix="_right", coalesce_keys=True)
    assert got.num_rows == want.num_rows > 0
    assert sorted(got.column_names) == sorted(want.column_names)
    assert rows(got) == rows(want.select(got.column_names))


def test_join_needs_matching_key_counts_and_a_known_how():
    def body(ctx):
        with pytest.raises(ConfigError, match="how"):
            C.Join(ctx, edge=22, key="k", how="cross")
        with pytest.raises(ConfigError, match="as many key columns"):
            C.Join(ctx, edge=22, key=["k", "s"], right_key="k")
        return True
    assert run_local(2, body, timeout=60) == [True, True]
