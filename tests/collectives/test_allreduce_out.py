"""``AllReduce.allreduce(value, out=...)``: results written into a given array or in place."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from twisternet.testing import run_local

pytestmark = pytest.mark.timeout(120)


def _value(rank: int, size: int, dtype: str) -> np.ndarray:
    return ((np.arange(size) * 7 + rank * 13) % 101).astype(dtype)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("via", ["ring", "tree"])
@pytest.mark.parametrize("dtype", ["float64", "int32"])
def test_out_and_in_place_equal_the_reference(world: int, via: str, dtype: str) -> None:
    sizes = [5, 4099, 60_000]

    def body(ctx):
        op = C.AllReduce(ctx, edge=1, op="sum", via=via, chunk_bytes=4096, ring_threshold=1024)
        res = []
        with op:
            for size in sizes:
                x = _value(ctx.rank, size, dtype)
                keep = x.copy()
                out = np.full_like(x, -5)
                got = op.allreduce(x, out=out)
                assert got is out and np.array_equal(x, keep)   # the input is left alone
                again = x.copy()
                got2 = op.allreduce(again, out=again)          # in place
                assert got2 is again
                res.append((out.copy(), again.copy(), op.allreduce(x)))
        return res

    results = run_local(world, body, timeout=100)
    for k, size in enumerate(sizes):
        ref = sum(_value(r, size, dtype).astype(np.int64) for r in range(world)).astype(dtype)
        for per_rank in results:
            for arr in per_rank[k]:
                assert arr.dtype == np.dtype(dtype) and np.array_equal(arr, ref)


def test_out_is_checked() -> None:
    def body(ctx):
        op = C.AllReduce(ctx, edge=1, op="sum")
        x = np.ones((4, 6), np.float32)
        y = np.ones(24, np.float32)
        cases = [(x, np.ones((4, 5), np.float32)),        # shape
                 (x, np.ones((4, 6), np.float64)),        # dtype
                 (x, np.ones((6, 4), np.float32).T),      # not C-contiguous
                 (y[:20], y[4:]),                         # overlaps the value
                 (x, [0.0] * 24),                         # not an array
                 (3.0, np.zeros(1))]                      # value not an array
        errors = []
        for value, out in cases:
            try:
                op.allreduce(value, out=out)
                errors.append("accepted")
            except (TypeError, ValueError) as e:
                errors.append(type(e).__name__ + (":overlap" if "overlaps" in str(e) else ""))
        return errors

    want = ["ValueError", "ValueError", "ValueError", "ValueError:overlap", "TypeError", "TypeError"]
    assert run_local(2, body, timeout=60) == [want, want]


def test_ring_mismatched_dtype_is_a_clear_error_not_a_hang() -> None:
    def body(ctx):
        op = C.AllReduce(ctx, edge=1, op="sum", via="ring", timeout=20)
        x = np.ones(10_000, np.float32 if ctx.rank == 0 else np.float64)
        try:
            op.allreduce(x)
        except Exception as e:  # noqa: BLE001
            return type(e).__name__, str(e)
        return "no error", ""

    res = run_local(2, body, timeout=60)
    assert all(name == "MismatchError" for name, _ in res), res     # on every rank, no timeout
    assert all("same shape and dtype" in msg and "<f8" in msg and "<f4" in msg for _, msg in res), res
