"""Collective scenarios written once and run under any channel.

Each scenario is ``scenario(ctx, params) -> result`` with JSON-able ``params`` and result. The tests run
them on in-process threads (``twisternet.testing.run_local``); the same functions run one per process
under ``twisternet run`` or ``mpiexec``::

    python -m tests.collectives.scenarios NAME '{"op": "gather", ...}'

prints one JSON line ``{"rank": r, "result": ...}`` per process (the launcher sets the channel).
Data come from :func:`make_values`, a pure function of (kind, source task, count, seed), so a test can
compute the sequential reference independently of the library.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any
from collections.abc import Callable

import numpy as np

KINDS = ("numpy", "records", "strings")
OPS = ("reduce", "allreduce", "gather", "allgather", "broadcast", "partition", "keyed_partition",
       "keyed_reduce", "keyed_gather")
KEY_TYPES = {"numpy": "int", "records": "object", "strings": "str"}


# ---------------------------------------------------------------------------------------------- data
def make_value(kind: str, src: int, i: int, seed: int) -> Any:
    """The ``i``-th value of source ``src``."""
    if kind == "numpy":
        return (np.arange(4, dtype=np.int64) + 1) * (src + 1) + i * 1000 + seed
    if kind == "records":
        return {"n": 1, "sum": src * 100 + i + seed, "src": src, "i": i, "tags": ["t", src, (i, 0.5)]}
    if kind == "strings":
        return f"s{src}-{i:04d}-" + "xyz"[(i + seed) % 3] * (i % 4)
    raise ValueError(kind)


def make_values(kind: str, src: int, n: int, seed: int) -> list[Any]:
    return [make_value(kind, src, i, seed) for i in range(n)]


def make_key(kind: str, src: int, i: int) -> Any:
    if kind == "numpy":
        return (src * 7 + i) % 5
    if kind == "records":
        return ("k", (src + i) % 4)
    return f"w{(src * 3 + i) % 6}"


def merge_records(a: dict, b: dict) -> dict:
    """The reduction used for records: counts and sums (associative and commutative)."""
    return {"n": a["n"] + b["n"], "sum": a["sum"] + b["sum"]}


def reduction_for(kind: str) -> Any:
    return {"numpy": "sum", "records": merge_records, "strings": "max"}[kind]


def partition_target(src: int, i: int, destinations: list[int]) -> int:
    """The explicit destination of the ``i``-th record of ``src`` in partition scenarios."""
    return destinations[(src * 5 + i) % len(destinations)]


def canon(obj: Any) -> Any:
    """A JSON-able canonical form: arrays and tuples become lists, dict keys strings."""
    if isinstance(obj, np.ndarray):
        return canon(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (list, tuple)):
        return [canon(o) for o in obj]
    if isinstance(obj, dict):
        return {str(k): canon(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    return obj


# ---------------------------------------------------------------------------------------------- matrix
def build_op(ctx: Any, p: dict) -> Any:
    import collectives as C
    common = dict(mode=p["mode"], fanout=p.get("fanout", 2), limit=p.get("limit"), timeout=p.get("timeout", 60))
    kind, op = p["kind"], p["op"]
    S, D, e = p["sources"], p["destinations"], p.get("edge", 5)
    if op == "reduce":
        return C.Reduce(ctx, S, D, e, op=reduction_for(kind), **common)
    if op == "allreduce":
        return C.AllReduce(ctx, S, D, e, op=reduction_for(kind), **common)
    if op == "gather":
        return C.Gather(ctx, S, D, e, **common)
    if op == "allgather":
        return C.AllGather(ctx, S, D, e, **common)
    if op == "broadcast":
        return C.Broadcast(ctx, S, D, e, **common)
    common.pop("fanout")
    if op == "partition":
        return C.Partition(ctx, S, D, e, **common)
    if op == "keyed_partition":
        return C.KeyedPartition(ctx, S, D, e, key_type=KEY_TYPES[kind], **common)
    common["fanout"] = p.get("fanout", 2)
    if op == "keyed_reduce":
        return C.KeyedReduce(ctx, S, D, e, op=reduction_for(kind), key_type=KEY_TYPES[kind], **common)
    if op == "keyed_gather":
        return C.KeyedGather(ctx, S, D, e, key_type=KEY_TYPES[kind], **common)
    raise ValueError(op)


def run_op(ctx: Any, p: dict) -> dict:
    """Every local source sends its values (interleaved across local sources) and finishes; every local
    destination collects its results. Returns ``{destination: canonical items}``.

    Streaming: this one thread is source and destination at once, so it sends with ``offer`` and drains
    the available results whenever an offer is refused (the pattern the package doc prescribes).
    """
    op = build_op(ctx, p)
    kind, seed, op_name = p["kind"], p["seed"], p["op"]
    lengths = {int(k): v for k, v in p["lengths"].items()}
    cursors = {s: 0 for s in op.local_sources}
    streaming = p["mode"] == "streaming"
    got: dict[int, list] = {d: [] for d in op.local_destinations}
    deadline = time.monotonic() + p.get("timeout", 60)

    def drain() -> bool:
        moved = False
        for d in op.local_destinations:
            items = op.drain(d)
            got[d].extend(items)
            moved = moved or bool(items)
        return moved

    def wait_a_little() -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"scenario {op_name} stuck on rank {ctx.rank}")
        if not drain():
            ctx.progress(0.001) if ctx.config.progress == "manual" else time.sleep(0.0005)

    with op:
        while cursors:
            for s in list(cursors):
                i = cursors[s]
                if i >= lengths[s]:
                    if streaming:
                        drain()
                    op.finish(s)
                    del cursors[s]
                    continue
                v = make_value(kind, s, i, seed)
                if op_name == "partition":
                    args: tuple = (s, v, partition_target(s, i, op.destinations))
                elif op_name.startswith("keyed"):
                    args = (s, make_key(kind, s, i), v)
                else:
                    args = (s, v)
                if streaming:
                    while not op.offer(*args):
                        wait_a_little()
                else:
                    op.send(*args)
                cursors[s] = i + 1
        if streaming:
            while not all(op.done(d) for d in op.local_destinations):
                wait_a_little()
            drain()
        else:
            for d in op.local_destinations:
                got[d] = list(op.results(d))
    return {str(d): canon(items) for d, items in got.items()}


# ---------------------------------------------------------------------------------------------- others
def run_allreduce_calls(ctx: Any, p: dict) -> list:
    """Rank-level ``allreduce`` calls with arrays of the given sizes; returns canonical sums/results."""
    import collectives as C
    op = C.AllReduce(ctx, edge=p.get("edge", 3), op=p.get("reduce", "sum"), via=p.get("via", "auto"),
                     chunk_bytes=p.get("chunk_bytes", 1 << 20), ring_threshold=p.get("ring_threshold", 1 << 20),
                     fanout=p.get("fanout", 2))
    out = []
    with op:
        for size in p["sizes"]:
            x = (np.arange(size, dtype=np.float64) % 97) * (ctx.rank + 1)
            r = op.allreduce(x)
            out.append([float(r.sum()), float(r[:3].sum()) if size else 0.0, list(r.shape), str(r.dtype)])
    return out


def run_backpressure(ctx: Any, p: dict) -> dict:
    """Fast sources into a deliberately slow destination through a tree (streaming Gather or Reduce)."""
    import collectives as C
    n, limit, delay = p["n"], p["limit"], p["delay"]
    cls = C.Gather if p["op"] == "gather" else C.Reduce
    op = cls(ctx, p.get("sources"), 0, 7, mode="streaming", limit=limit, fanout=p.get("fanout", 2),
             timeout=p.get("timeout", 60))
    max_held = 0
    got: list = []
    with op:
        if ctx.rank == 0:
            sources_here = list(op.local_sources)
            for s in sources_here:
                for i in range(n):
                    op.send(s, [s, i] if p["op"] == "gather" else i)
                op.finish(s)
            for item in op.results(0):
                max_held = max(max_held, op.pending())
                if len(got) < p.get("slow_items", 200):
                    time.sleep(delay)
                got.append(canon(item))
        else:
            for s in op.local_sources:
                for i in range(n):
                    op.send(s, [s, i] if p["op"] == "gather" else i)
                    max_held = max(max_held, op.pending())
                op.finish(s)
    return {"got": got, "max_held": max_held}


def run_spill(ctx: Any, p: dict) -> dict:
    """KeyedGather of much more data than ``memory_limit`` into one destination; reports spill files."""
    import collectives as C
    spill_dir = ctx.config.spill_dir

    def files() -> int:
        return sum(len(fs) for _, _, fs in os.walk(spill_dir)) if spill_dir and os.path.isdir(spill_dir) else 0
    op = C.KeyedGather(ctx, None, [0], 9, key_type="int", group=p.get("group", True), timeout=120)
    rng = np.random.default_rng(p["seed"] + ctx.rank)
    with op:
        for s in op.local_sources:
            keys = rng.integers(0, p["keys"], size=p["n"])
            for i, k in enumerate(keys.tolist()):
                op.send(s, k, f"{s}:{i}:" + "p" * p["pad"])
            op.finish(s)
        out: dict = {}
        if op.local_destinations:
            while not op.done():
                time.sleep(0.01)
            out["files_before"] = files()
            out["result"] = canon(list(op.results()))
            out["files_after"] = files()
    out["files_closed"] = files()
    return out


def shm_value(rank: int, size: int, dtype: str, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input to the shared-memory allreduce tests (small integers: every sum is exact)."""
    return ((np.arange(size, dtype=np.int64) * 7 + rank * 13 + salt) % 101 - 50).astype(dtype)


def run_shm_allreduce(ctx: Any, p: dict) -> dict:
    """Rank-level allreduce calls of the given sizes/dtypes/reductions; per call a digest of the result."""
    import hashlib

    import collectives as C
    out: dict[str, Any] = {"calls": []}
    op = C.AllReduce(ctx, edge=p.get("edge", 5), op=p.get("reduce", "sum"), via=p.get("via", "auto"),
                     shm_chunk_bytes=p.get("shm_chunk_bytes", 1 << 20))
    with op:
        for k, (size, dtype) in enumerate(p["calls"]):
            x = shm_value(ctx.rank, size, dtype, k)
            keep = x.copy()
            r = op.allreduce(x) if k % 2 == 0 else op.allreduce(x, out=x)   # odd calls in place
            assert k % 2 == 1 or np.array_equal(x, keep), "the input was changed"
            out["calls"].append([hashlib.sha1(np.ascontiguousarray(r).tobytes()).hexdigest(), list(r.shape),
                                 str(r.dtype), r.reshape(-1)[:3].tolist()])
        out["shm"] = op._rank_allreduce.shm is not None
    return out


def mismatch_value(case: str, rank: int, odd: int) -> Any:
    """Rank ``rank``'s input to an allreduce where rank ``odd`` passes something different."""
    x = np.arange(24, dtype="<f4")
    if rank != odd:
        return x
    if case == "byteorder":
        return x.astype(">f4")
    if case == "length":
        return np.arange(25, dtype="<f4")
    if case == "shape":
        return x.reshape(4, 6)
    if case == "dtype":
        return x.astype("<i4")
    if case == "scalar":
        return 1.0
    raise ValueError(case)


def _outcome(fn: Callable[[], Any]) -> dict:
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "value": np.asarray(r).tolist()}


def run_mismatch(ctx: Any, p: dict) -> dict:
    """One good allreduce call, then one where rank ``odd`` passes a different array (``case``), then
    another call: what each rank got (the error type and message)."""
    import collectives as C
    op = C.AllReduce(ctx, edge=p.get("edge", 4), op="sum", via=p.get("via", "auto"),
                     ring_threshold=p.get("ring_threshold", 1 << 20), chunk_bytes=p.get("chunk_bytes", 4 << 20))
    t = p.get("timeout", 30.0)
    first = _outcome(lambda: op.allreduce(np.ones(24, "<f4"), timeout=t))
    second = _outcome(lambda: op.allreduce(mismatch_value(p["case"], ctx.rank, p.get("odd", 1)), timeout=t))
    op.abort()
    return {"first": first, "second": second}


def failing_reduction(rank_to_fail: int, rank: int) -> Callable[[Any, Any], Any]:
    """A reduction that raises on rank ``rank_to_fail`` only."""
    def add(a: Any, b: Any) -> Any:
        if rank == rank_to_fail:
            raise ZeroDivisionError(f"reduction failed on rank {rank}")
        return a + b
    return add


def run_failing_reduction(ctx: Any, p: dict) -> dict:
    """A callable reduction that raises on one rank: rank-level allreduce() (``form`` "allreduce") or a
    batch Reduce to task 0 (``form`` "reduce"); how long each rank took to fail and with what."""
    import collectives as C
    fail = p.get("fail_rank", 0)
    t = p.get("timeout", 60.0)
    start = time.monotonic()
    fn = failing_reduction(fail, ctx.rank)
    if p["form"] == "allreduce":
        op = C.AllReduce(ctx, edge=6, reduce=fn, timeout=t)
        got = _outcome(lambda: op.allreduce(ctx.rank + 1))
    else:
        op = C.Reduce(ctx, edge=6, reduce=fn, timeout=t)

        def body() -> Any:
            for i in range(3):
                op.send(ctx.rank, ctx.rank + i)
            op.finish(ctx.rank)
            return op.result() if ctx.rank == 0 else 0
        got = _outcome(body)
    op.abort()
    got["after"] = time.monotonic() - start
    return got


def run_kinds(ctx: Any, p: dict) -> dict:
    """Rank r runs operation ``p["kinds"][r]`` on edge 7 (send, finish, results, close), then waits on the
    context: what it raised."""
    import collectives as C
    kinds = {"gather": C.Gather, "reduce": C.Reduce, "allgather": C.AllGather, "allreduce": C.AllReduce}
    op = kinds[p["kinds"][ctx.rank]](ctx, edge=7, timeout=20)

    def body() -> None:
        op.send(ctx.rank, ctx.rank + 1)
        op.finish(ctx.rank)
        if ctx.rank in op.local_destinations:
            list(op.results())
        op.close()
        # a rank with nothing left to wait for on the edge hears of it at its next blocking call (it
        # returns by MismatchError as soon as the peer's notice arrives; the timeout only bounds a failure,
        # and is long because a loaded CI machine can take seconds to start and run the peer)
        ctx.wait_until(lambda: False, timeout=60)
    got = _outcome(body)
    op.abort()
    return got


SCENARIOS: dict[str, Callable[[Any, dict], Any]] = {
    "run_kinds": run_kinds,
    "run_mismatch": run_mismatch,
    "run_failing_reduction": run_failing_reduction,
    "run_shm_allreduce": run_shm_allreduce,
    "run_op": run_op,
    "run_allreduce_calls": run_allreduce_calls,
    "run_backpressure": run_backpressure,
    "run_spill": run_spill,
}


def main(argv: list[str]) -> int:
    """``python -m tests.collectives.scenarios NAME JSON``: run one scenario in this process."""
    import twisternet as tn
    name, params = argv[0], json.loads(argv[1] if len(argv) > 1 else "{}")
    plan = params.get("plan")
    plan = {int(k): v for k, v in plan.items()} if plan else None
    with tn.init(plan=plan) as ctx:
        result = SCENARIOS[name](ctx, params)
        print(json.dumps({"rank": ctx.rank, "result": result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
