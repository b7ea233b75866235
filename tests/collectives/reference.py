"""Sequential references for the collective scenarios, computed without the library."""

from __future__ import annotations

import functools
import json
import operator
import random
from typing import Any

from tests.collectives.scenarios import (canon, make_key, make_value, merge_records, partition_target)


def reduce_fn(kind: str):
    if kind == "numpy":
        return operator.add
    if kind == "records":
        return merge_records
    return max


def random_case(world: int, op: str, mode: str, kind: str, seed: int, n: int = 6) -> dict:
    """Params of one matrix case: a task plan, sources, destinations and per-source lengths.

    Even seeds: one task per rank, sources = destinations = all (the SPMD case). Odd seeds: several tasks
    per rank, disjoint random sources and destinations, random lengths (some sources send nothing).
    """
    rng = random.Random(f"{world}-{op}-{mode}-{kind}-{seed}")
    if seed % 2 == 0:
        tasks = list(range(world))
        plan = {t: t for t in tasks}
        sources, dests = tasks, tasks
        lengths = {s: n for s in sources}
    else:
        ntasks = 2 * world + 2
        plan = {t: rng.randrange(world) for t in range(ntasks)}
        tasks = list(range(ntasks))
        rng.shuffle(tasks)
        k = rng.randint(1, ntasks - 1)
        sources, dests = sorted(tasks[:k]), sorted(tasks[k:])
        lengths = {s: rng.randint(0, n) for s in sources}
    if op in ("reduce", "gather"):
        dests = dests[:1] if seed % 2 == 0 else [rng.choice(dests)]
    if op == "broadcast":
        sources = [sources[0]]
        lengths = {sources[0]: n}
    return {"op": op, "mode": mode, "kind": kind, "seed": seed, "plan": {str(t): r for t, r in plan.items()},
            "sources": sources, "destinations": dests, "lengths": {str(s): v for s, v in lengths.items()},
            "timeout": 30}


def _values(p: dict) -> dict[int, list]:
    return {s: [make_value(p["kind"], s, i, p["seed"]) for i in range(p["lengths"][str(s)])] for s in p["sources"]}


def _key_of(obj: Any) -> str:
    return json.dumps(canon(obj), sort_keys=True)


def check(p: dict, merged: dict[int, list]) -> None:  # noqa: C901 - one branch per operation and mode, read as a table
    """Assert the results of every destination (``merged[dest] = items``) match the reference."""
    op, mode, kind = p["op"], p["mode"], p["kind"]
    vals = _values(p)
    S, D = p["sources"], p["destinations"]
    assert sorted(merged) == sorted(D), (sorted(merged), D)
    if op in ("reduce", "allreduce"):
        f = reduce_fn(kind)
        if mode == "batch":
            everything = [v for s in S for v in vals[s]]
            exp = [canon(functools.reduce(f, everything))] if everything else []
        else:
            rounds = max((len(v) for v in vals.values()), default=0)
            exp = [canon(functools.reduce(f, [vals[s][i] for s in S if len(vals[s]) > i])) for i in range(rounds)]
        for d in D:
            got = merged[d]
            if mode == "batch" and kind == "records" and got and exp:
                assert (got[0]["n"], got[0]["sum"]) == (exp[0]["n"], exp[0]["sum"]), (got, exp)
            elif kind == "records":
                assert [(g["n"], g["sum"]) for g in got] == [(e["n"], e["sum"]) for e in exp], (got, exp)
            else:
                assert got == exp, (d, got, exp)
        return
    if op in ("gather", "allgather"):
        exp = [canon((s, v)) for s in S for v in vals[s]]
        for d in D:
            got = merged[d]
            if mode == "batch":
                assert got == exp, (d, got[:5], exp[:5])
            else:
                assert _per_source(got) == _per_source(exp)
        if op == "allgather":
            first = merged[D[0]]
            assert all(merged[d] == first for d in D), "AllGather destinations disagree on order"
        return
    if op == "broadcast":
        exp = [canon(v) for v in vals[S[0]]]
        for d in D:
            assert merged[d] == exp
        return
    if op == "partition":
        for d in D:
            exp = [canon((s, v)) for s in S for i, v in enumerate(vals[s]) if partition_target(s, i, D) == d]
            got = merged[d]
            assert (got if mode == "batch" else _per_source(got)) == (exp if mode == "batch" else _per_source(exp))
        return
    # keyed operations: which destination owns a key is the selector's business; check each key is at
    # exactly one destination and that everything under it is right.
    keyed = [(s, make_key(kind, s, i), v) for s in S for i, v in enumerate(vals[s])]
    owner: dict[str, int] = {}
    for d in D:
        for item in merged[d]:
            k = _key_of(item[0])
            assert owner.setdefault(k, d) == d, f"key {k} at destinations {owner[k]} and {d}"
    assert set(owner) == {_key_of(k) for _, k, _ in keyed}
    for d in D:
        mine = [(s, k, v) for s, k, v in keyed if owner[_key_of(k)] == d]
        got = merged[d]
        if op == "keyed_partition":
            exp = [canon((k, v)) for s, k, v in mine]
            if mode == "batch":
                assert got == exp
            else:
                assert sorted(map(_key_of, got)) == sorted(map(_key_of, exp))
        elif op == "keyed_gather":
            if mode == "batch":
                keys = sorted({k for _, k, _ in mine})
                exp = [canon((k, [v for _, k2, v in mine if k2 == k])) for k in keys]
                assert got == exp
            else:
                exp = [canon((k, v)) for _, k, v in mine]
                assert sorted(map(_key_of, got)) == sorted(map(_key_of, exp))
        elif op == "keyed_reduce":
            f = reduce_fn(kind)
            keys = sorted({k for _, k, _ in mine})
            full = {_key_of(k): canon(functools.reduce(f, [v for _, k2, v in mine if k2 == k])) for k in keys}
            def norm(r: Any) -> Any:
                return (r["n"], r["sum"]) if isinstance(r, dict) else r
            if mode == "batch":
                assert [_key_of(k) for k, _ in got] == [_key_of(k) for k in keys]
                for k, v in got:
                    assert norm(v) == norm(full[_key_of(k)]), (k, v, full[_key_of(k)])
            else:
                counts: dict[str, int] = {}
                last: dict[str, Any] = {}
                for k, v in got:
                    counts[_key_of(k)] = counts.get(_key_of(k), 0) + 1
                    last[_key_of(k)] = v
                for k in keys:
                    kk = _key_of(k)
                    assert counts[kk] == sum(1 for _, k2, _ in mine if k2 == k)
                    assert norm(last[kk]) == norm(full[kk])
        else:
            raise AssertionError(op)


def _per_source(items: list) -> dict:
    out: dict = {}
    for s, v in items:
        out.setdefault(s, []).append(_key_of(v))
    return out
