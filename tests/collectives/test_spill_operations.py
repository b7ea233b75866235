"""Disk spill of operations: KeyedGather spills past the memory limit, spill files go when the operation
closes unread, and memory stays near the bound while gathering far more (slow)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import collectives as C
from tests.collectives.scenarios import run_spill
from twisternet.testing import run_local



@pytest.mark.timeout(120)
def test_spill_keyed_gather(tmp_path) -> None:
    world, memory_limit = 3, 16 << 10
    params = {"seed": 7, "n": 3000, "keys": 200, "pad": 40}
    res = run_local(world, run_spill, params, timeout=100, memory_limit=memory_limit, spill_dir=str(tmp_path))
    out = res[0]
    # reference: every (source, i, key) regenerated independently, grouped by key, sources in order
    expect: dict[int, list] = {}
    for s in range(world):
        rng = np.random.default_rng(params["seed"] + s)
        keys = rng.integers(0, params["keys"], size=params["n"]).tolist()
        for i, k in enumerate(keys):
            expect.setdefault(k, []).append(f"{s}:{i}:" + "p" * params["pad"])
    total_bytes = sum(len(v) for vs in expect.values() for v in vs)
    assert total_bytes >= 20 * memory_limit
    assert out["result"] == [[k, expect[k]] for k in sorted(expect)]
    assert out["files_before"] > 0, "nothing was spilled"
    assert out["files_after"] == 0 and out["files_closed"] == 0
    assert not any(files for _, _, files in os.walk(tmp_path))


@pytest.mark.timeout(120)
def test_spill_removed_on_close_without_reading(tmp_path) -> None:
    def body(ctx):
        op = C.Gather(ctx, None, 0, 2)
        for i in range(4000):
            op.send(ctx.rank, "v" * 50 + str(i))
        op.finish(ctx.rank)
        if ctx.rank == 0:
            ctx.wait_until(op.done, timeout=30)
            spilled = sum(len(f) for _, _, f in os.walk(tmp_path))
        else:
            spilled = None
        op.close()
        return spilled
    res = run_local(2, body, timeout=60, memory_limit=32 << 10, spill_dir=str(tmp_path))
    assert res[0] > 0
    assert not any(files for _, _, files in os.walk(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_spill_bounds_rss(tmp_path) -> None:
    """Memory stays near the bound while gathering >> bound bytes (measured in a fresh process)."""
    import json
    import subprocess
    import sys
    n, pad = 400_000, 120
    probe = os.path.join(os.path.dirname(__file__), "rss_probe.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, probe, str(n), str(pad), "4MiB", str(tmp_path)], capture_output=True,
                         text=True, timeout=280, env={**os.environ, "PYTHONPATH": root}, check=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["count"] == n and res["ordered"]
    assert res["payload"] >= 40 << 20                       # >= 10x the 4 MiB bound in payload alone
    assert res["growth_kib"] < 40 << 10, res                # peak RSS grew by far less than the data
    assert not any(files for _, _, files in os.walk(tmp_path))
