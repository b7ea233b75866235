"""Rank-level ``AllReduce.allreduce(value)``: a chunked, pipelined tree, or a ring for large arrays.

* **tree** (any value, any reduction): values flow up the operation's k-ary tree over its ranks, each
  inner node combining its children's chunk ``j`` with its own before passing it on, and the result
  flows back down. Arrays with a named reduction are cut into ``chunk_bytes`` pieces, so levels work
  on different chunks at once (pipelining) and no message is larger than a chunk.
* **ring** (numpy arrays, named reduction): reduce-scatter then allgather around the ranks in order,
  ``2 (n - 1)`` steps each moving ``1/n`` of the array per rank, chunked: every link carries about
  ``2 (n-1)/n`` of the array, so the time approaches the array size over the link bandwidth instead of
  funnelling everything through a root.
* **shm** (numpy arrays, named reduction, every rank on one host): through a shared-memory segment
  (``collectives.shm_allreduce``), one copy in and one out per rank and no message per chunk; "auto"
  uses it whenever every rank could map the first rank's segment, from the first such call on.
* **innet**: float sums aggregated by an ATP software switch and parameter server that the first
  rank starts for the operation (``collectives.innet_allreduce``).

Records (edges ``AR_UP``, ``AR_DOWN``, ``RING``) are ``(kind, call, step, chunk, payload[, groups])``;
``call`` counts the ``allreduce`` calls of this operation, so consecutive calls never mix. With a named
reduction, the first record a rank sends in a call (tree: chunk 0 up; ring: step 0 chunk 0) also
carries ``groups``, ``{descriptor: [ranks]}`` of the values it covers (descriptor: dtype string with
byte order, and shape, of an array; "-" for anything else), so a rank that receives it compares the
values of its subtree or of its left neighbour with its own at no extra message. On a difference it
raises :class:`~twisternet.errors.MismatchError` naming the ranks, and the operation's ``ABORT`` edge
carries the error to every other rank (see ``Operation._fail``); so does any error of the reduction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from twisternet.context import SendHandle
from twisternet.errors import ClosedError, ConfigError, MismatchError, OperationTimeout, ProtocolError, TwisternetError

from .edges import AR_DOWN, AR_UP, RING, channel_edge
from .reduction import own, snapshot
from .routing import KaryTree

if TYPE_CHECKING:
    from .reduce import AllReduce

VIAS = ("auto", "tree", "ring", "shm", "innet")
#: Which algorithm sends each record kind ("x": none, see Operation's ABORT edge).
_PATH = {"u": "tree", "w": "tree", "r": "ring", "s": "shm"}


def describe_value(value: Any) -> str:
    """What every rank's value of one call must agree on: an array's dtype (with byte order) and shape."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype.str} {value.shape}"
    return "-"


def _human(desc: str) -> str:
    if desc == "-":
        return "a value that is not a numpy array"
    dt, _, shape = desc.partition(" ")
    try:
        name = np.dtype(dt).name
    except TypeError:
        name = dt
    order = {"<": ", little-endian", ">": ", big-endian"}.get(dt[:1], "")
    return f"{name} ({dt}{order}) of shape {shape}"


def mismatch_error(call: int, groups: dict[str, list[int]]) -> MismatchError:
    """The error every rank raises when the values of one call differ: who passed what."""
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    odd = sorted(r for _, rs in ordered[1:] for r in rs)
    listing = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {sorted(rs)}: {_human(d)}" for d, rs in ordered)
    err = MismatchError(f"allreduce() call {call}: ranks {odd} passed values that differ from the others' "
                        f"({listing}); every rank must pass arrays of the same shape and dtype, byte order "
                        "included", odd)
    err.call = call     # type: ignore[attr-defined]  # ranks still in an earlier call raise it in this one
    return err


def merge_groups(mine: dict[str, list[int]], theirs: Any) -> dict[str, list[int]]:
    """``mine`` with the ``{descriptor: [ranks]}`` of a received record added (in place)."""
    if isinstance(theirs, dict):
        for d, rs in theirs.items():
            mine.setdefault(str(d), []).extend(int(r) for r in rs)
    return mine


class RankAllReduce:
    """Carries out ``allreduce`` calls for one AllReduce operation.

    One call at a time per process; every participating rank makes the same sequence of calls, with
    arrays of the same shape and dtype (with a named reduction a difference raises MismatchError on
    every rank, see the module docstring).
    """

    def __init__(self, op: "AllReduce") -> None:
        self.op = op
        self.ranks = sorted(set(op.source_ranks) | set(op.destination_ranks))
        self.same_ranks = set(op.source_ranks) == set(op.destination_ranks)
        self.tree = KaryTree(self.ranks[0], self.ranks, op.fanout)
        self.stash: dict[tuple, Any] = {}
        self.groups: dict[tuple, Any] = {}    # (kind, call, src) -> the groups its first record carried
        self.calls = 0
        self.ring: _RingCall | None = None   # the ring call in progress (its records skip the stash)
        self.innet: Any = None               # the in-network path, set up on the first via="innet" call
        self.shm: Any = None                 # the shared-memory path, once set up (see _shm_path)
        self.shm_tried = False
        self.deferred: tuple[int, BaseException] | None = None   # another rank's failure in a later call
        self.current: tuple[int, str] | None = None   # (call, algorithm) of the call in progress
        self.mine_desc = "-"                          # describe_value of this rank's value in that call
        for offset in (AR_UP, AR_DOWN, RING):
            op._register(offset, self._on_record, activates=False)
        op._defer_failure = self._defer_failure

    def _defer_failure(self, call: int, err: BaseException) -> bool:
        """A failure of call ``call`` on another rank: kept until this rank makes that call (under the op lock)."""
        if call < self.calls:
            return False
        if self.deferred is None or call < self.deferred[0]:
            self.deferred = (call, err)
        return True

    def _on_record(self, src: int, msg: Any) -> bool:
        try:
            if len(msg) == 6:
                kind, call, step, chunk, payload, groups = msg
                self.groups[(kind, call, src)] = groups
            else:
                kind, call, step, chunk, payload = msg
        except (TypeError, ValueError):
            raise self.op._protocol(src, msg) from None
        cur = self.current
        if cur is not None and call == cur[0] and _PATH.get(kind, cur[1]) != cur[1]:
            raise self._path_error(call, cur[1], kind, src)
        rc = self.ring
        if kind == "r" and rc is not None and call == rc.call:
            self._apply(rc, step, chunk, payload, src)
        else:
            self.stash[(kind, call, step, chunk, src)] = own(payload)
        self.op._changed = True
        return True

    # ------------------------------------------------------------------ plumbing
    def _send(self, dst: int, offset: int, msg: tuple, timeout: float) -> None:
        self.op.ctx.send(dst, channel_edge(self.op.edge, offset), msg, timeout=timeout)

    def _take(self, key: tuple, timeout: float) -> Any:
        op = self.op
        op._raise_if_failed()

        def ready() -> bool:
            return key in self.stash or op._error is not None or op._closed

        def on_timeout() -> BaseException:
            return OperationTimeout(f"allreduce() call {key[1]}: no data from rank {key[-1]} "
                                    f"(step {key[2]}, chunk {key[3]})", edge=op.edge, operation=op.operation,
                                    timeout=timeout)
        op.ctx.wait_until(ready, timeout=timeout, on_timeout=on_timeout)
        op._raise_if_failed()
        with op._lock:
            return self.stash.pop(key)

    def _path_error(self, call: int, mine: str, kind: str, src: int) -> MismatchError:
        """Rank ``src`` sent a record of another algorithm than this rank's in call ``call``: their values
        differ (in type, size or dtype) or their operations were created with different ``via``."""
        groups: dict[str, list[int]] = {}
        with self.op._lock:
            theirs = self.groups.get((kind, call, src))
        merge_groups(groups, theirs if theirs is not None else {f"? ({_PATH[kind]})": [src]})
        groups.setdefault(self.mine_desc, []).append(self.op.rank)
        if len(groups) > 1:
            return mismatch_error(call, groups)
        err = MismatchError(f"allreduce() call {call}: rank {src} used the {_PATH[kind]} algorithm and rank "
                            f"{self.op.rank} the {mine}; create the operation with the same via=, chunk and "
                            "threshold arguments on every rank", [src, self.op.rank])
        err.call = call    # type: ignore[attr-defined]
        return err

    def _start(self, call: int, path: str, value: Any) -> None:
        """Call ``call`` goes by ``path`` here: records of another algorithm for it mean a mismatch."""
        self.mine_desc = describe_value(value)
        with self.op._lock:
            self.current = (call, path)
            odd = next((k for k in self.stash if k[1] == call and _PATH.get(k[0], path) != path), None)
        if odd is not None:
            raise self._failed(self._path_error(call, path, odd[0], odd[4]), f"in allreduce() call {call}", call)

    def _failed(self, e: BaseException, where: str, call: int | None = None) -> BaseException:
        """Fail the operation with ``e`` (raised here by the caller) and tell every other rank."""
        if call is not None:
            e.call = call    # type: ignore[attr-defined]  # ranks still in an earlier call wait for it
        with self.op._lock:
            self.op._fail(e, where)
        self.op._after()
        return e

    def _check_child(self, call: int, groups: dict[str, list[int]], kind: str, src: int) -> None:
        """Add the groups of ``src``'s first record of ``call`` to ``groups``; raise if values differ."""
        with self.op._lock:
            theirs = self.groups.pop((kind, call, src), None)
        if theirs is None:
            theirs = {"?": [src]}
        merge_groups(groups, theirs)
        if len(groups) > 1:
            raise self._failed(mismatch_error(call, groups), f"in allreduce() call {call}", call)

    def _combine(self, acc: Any, got: Any, call: int) -> Any:
        try:
            return self.op.reduction.combine(acc, got)
        except TwisternetError:
            raise
        except Exception as e:  # noqa: BLE001 - the reduction raised: every rank must hear of it
            raise self._failed(e, f"in the reduction of allreduce() call {call}", call) from None

    def _chunks(self, a: int, b: int, itemsize: int) -> list[tuple[int, int]]:
        step = max(1, self.op.chunk_bytes // max(1, itemsize))
        return [(x, min(b, x + step)) for x in range(a, b, step)] or [(a, a)]

    def _combine_into(self, flat: np.ndarray, a: int, b: int, got: Any, call: int) -> None:
        part = flat[a:b]
        r = self._combine(part, got, call)
        if r is not part:
            flat[a:b] = r

    # ------------------------------------------------------------------ entry
    def run(self, value: Any, timeout: float | None, out: np.ndarray | None = None) -> Any:
        op = self.op
        t = op.timeout if timeout is None else timeout
        if out is not None:
            if not isinstance(value, np.ndarray) or not isinstance(out, np.ndarray):
                raise TypeError("allreduce(out=...) needs a numpy array value and a numpy array out")
            if out.shape != value.shape or out.dtype != value.dtype:
                raise ValueError(f"allreduce(out=...): out is {out.dtype}{list(out.shape)}, the value is "
                                 f"{value.dtype}{list(value.shape)}; they must match")
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError("allreduce(out=...): out must be a writeable C-contiguous array")
            if out is not value and np.shares_memory(out, value):
                raise ValueError("allreduce(out=...): out overlaps the value without being the same array")
        result = self._run(value, t, out)
        if out is not None and result is not out:
            out[...] = result
            return out
        return result

    def _run(self, value: Any, t: float, out: np.ndarray | None) -> Any:
        op = self.op
        if not self.same_ranks:
            raise ConfigError("destinations", "allreduce() needs sources and destinations on the same ranks "
                                              f"(sources on {op.source_ranks}, destinations on {op.destination_ranks})")
        if op.rank not in self.ranks:
            raise ValueError(f"rank {op.rank} runs no task of {op.describe()} (edge {op.edge}); "
                             f"allreduce() is called by ranks {self.ranks}")
        op._raise_if_failed()
        if op.via == "innet":
            return self._innet(value, t)
        call = self.calls
        self.calls += 1
        with op._lock:
            if self.deferred is not None and self.deferred[0] <= call:
                op._fail(self.deferred[1], f"on another rank in allreduce() call {self.deferred[0]}")
        op._raise_if_failed()
        n = len(self.ranks)
        is_array = isinstance(value, np.ndarray)
        ring_ok = is_array and op.reduction.named and n > 1 and value.size >= n
        if op.via == "ring" and n > 1 and not ring_ok:
            raise ConfigError("via", "via='ring' needs a numpy array (at least one element per rank) and a "
                                     "named reduction (sum, prod, max, min)")
        shm_ok = is_array and op.reduction.named and n > 1 and value.size >= 1 and not value.dtype.hasobject
        if self.shm is not None and not shm_ok and n > 1:
            # the other ranks may be in a shared-memory round: join it with "no array", so that a
            # mismatch raises on every rank at once (if all passed such values, go on below)
            self.shm.announce_other(t)
        if op.via == "shm" and n > 1 and not shm_ok:
            raise ConfigError("via", "via='shm' needs a non-empty numpy array of numbers and a named reduction "
                                     "(sum, prod, max, min)")
        if n == 1:
            return snapshot(value)
        if shm_ok and (op.via == "shm" or (op.via == "auto" and self._auto_shm())):
            # set-up first: where a rank cannot map the segment, every rank falls back in this same call,
            # and a rank that learns it first may send ring/tree records for it before this one has
            shm = self._shm_path(call, t)
            if shm is not None:
                self._start(call, "shm", value)
                return shm.run(value, t, out)
        if ring_ok and (op.via == "ring" or (op.via == "auto" and value.nbytes >= op.ring_threshold)):
            self._start(call, "ring", value)
            return self._ring(value, call, t, out)
        self._start(call, "tree", value)
        return self._tree(value, call, t)

    # ------------------------------------------------------------------ in-network (hook)
    def _innet(self, value: Any, timeout: float) -> Any:
        """``via="innet"``: float sums through an ATP software switch (see collectives.innet_allreduce)."""
        if self.innet is None:
            from .innet_allreduce import InnetAllReduce
            self.innet = InnetAllReduce(self)
        return self.innet.run(value, timeout)

    # ------------------------------------------------------------------ shared memory
    def _auto_shm(self) -> bool:
        """"auto" tries shared memory once per operation, where it can work at all (not between the
        threads of the local test channel, which share memory anyway)."""
        if self.shm is not None:
            return True
        from .shm_allreduce import supported
        return not self.shm_tried and self.op.ctx.channel.spans_processes and supported()

    def _shm_path(self, call: int, t: float) -> Any:
        """The shared-memory state, setting it up (collectively, in this call) the first time."""
        if not self.shm_tried:
            from .shm_allreduce import ShmAllReduce, supported
            self.shm_tried = True
            if supported():
                self.shm = ShmAllReduce.setup(self, call, self.op.shm_chunk_bytes, t)
        if self.shm is None and self.op.via == "shm":
            raise ConfigError("via", "via='shm': the ranks of this operation cannot share memory (not all on "
                                     "one host, no /dev/shm, or not an x86-64 machine); use 'auto'")
        return self.shm

    def next_call(self) -> int:
        """A fresh call number (every rank draws them in the same order)."""
        call = self.calls
        self.calls += 1
        return call

    def close(self) -> None:
        """Release what a call set up (the in-network job's sockets, switch and PS)."""
        if self.innet is not None:
            self.innet.close()
            self.innet = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    # ------------------------------------------------------------------ tree
    def _tree(self, value: Any, call: int, t: float) -> Any:
        me = self.op.rank
        parent = self.tree.parent(me)
        children = self.tree.children(me)
        # with a named reduction every rank's value must look alike: the first record up says whose is what
        groups: dict[str, list[int]] | None = {describe_value(value): [me]} if self.op.reduction.named else None
        if isinstance(value, np.ndarray) and self.op.reduction.named:
            flat = np.array(value, copy=True).reshape(-1)
            bounds = self._chunks(0, flat.size, flat.itemsize)
            for c, (a, b) in enumerate(bounds):
                for ch in children:
                    got = self._take(("u", call, 0, c, ch), t)
                    if c == 0:
                        self._check_child(call, groups, "u", ch)
                    self._combine_into(flat, a, b, got, call)
                msg_kind, dsts = ("u", [parent]) if parent is not None else ("w", children)
                for d in dsts:
                    rec = (msg_kind, call, 0, c, flat[a:b])
                    if c == 0 and parent is not None:
                        rec += (groups,)
                    self._send(d, AR_UP if parent is not None else AR_DOWN, rec, t)
            if parent is not None:
                for c, (a, b) in enumerate(bounds):
                    flat[a:b] = self._take(("w", call, 0, c, parent), t)
                    for ch in children:
                        self._send(ch, AR_DOWN, ("w", call, 0, c, flat[a:b]), t)
            return flat.reshape(value.shape)
        acc = snapshot(value)
        for ch in children:
            got = self._take(("u", call, 0, 0, ch), t)
            if groups is not None:
                self._check_child(call, groups, "u", ch)
            acc = self._combine(acc, got, call)
        if parent is not None:
            self._send(parent, AR_UP, ("u", call, 0, 0, acc) + ((groups,) if groups is not None else ()), t)
            acc = self._take(("w", call, 0, 0, parent), t)
        for ch in children:
            self._send(ch, AR_DOWN, ("w", call, 0, 0, acc), t)
        return acc

    # ------------------------------------------------------------------ ring
    def _ring(self, value: np.ndarray, call: int, t: float, out: np.ndarray | None = None) -> np.ndarray:
        """Reduce-scatter then allgather, pipelined chunk by chunk.

        Every chunk is forwarded as soon as it is complete, and the records of the call in progress are
        applied by the handler straight into the result (no copy out of the receive buffer): in the
        reduce-scatter each rank receives every segment but its own exactly once, so the result there is
        ``input + received`` written once; in the allgather the received chunk is the result. The input
        is only read, and no copy of it is made.
        """
        op = self.op
        ranks = self.ranks
        n = len(ranks)
        i = ranks.index(op.rank)
        right = ranks[(i + 1) % n]
        src = np.ascontiguousarray(value).reshape(-1)
        result = np.empty_like(src) if out is None else out.reshape(-1)
        if out is not None and out is value:
            src = result   # in place: each element is read (sent or combined) before it is overwritten
        edges = [src.size * k // n for k in range(n + 1)]
        segs = [self._chunks(edges[s], edges[s + 1], src.itemsize) for s in range(n)]
        rc = _RingCall(call, n, i, src, result, segs, op.reduction.ufunc, describe_value(value))
        try:
            with op._lock:
                self.ring = rc
                for key in sorted(k for k in self.stash if k[0] == "r" and k[1] == call):
                    self._apply(rc, key[2], key[3], self.stash.pop(key), key[4])
        except TwisternetError as e:
            self.ring = None
            raise self._failed(e, f"in allreduce() call {call}", call) from None
        handles: list[SendHandle] = []
        ring_edge = channel_edge(op.edge, RING)

        def send(step: int, c: int, chunk: np.ndarray) -> None:
            rec = ("r", call, step, c, chunk)
            if step == 0 and c == 0:
                rec += ({rc.desc: [op.rank]},)    # the right neighbour compares it with its own
            handles.append(op.ctx.isend(right, ring_edge, rec, timeout=t))

        try:
            for c, (a, b) in enumerate(segs[i]):             # reduce-scatter step 0: own input
                send(0, c, src[a:b])
            for step in range(2 * (n - 1)):
                s = (i - step - 1) % n if step < n - 1 else (i - (step - (n - 1))) % n
                for c, (a, b) in enumerate(segs[s]):
                    self._wait_applied(rc, step, c, ranks[(i - 1) % n], t)
                    if step + 1 < 2 * (n - 1):
                        send(step + 1, c, result[a:b])
            for h in handles:
                h.wait()
        finally:
            with op._lock:
                self.ring = None
        return result.reshape(value.shape) if out is None else out

    def _apply(self, rc: "_RingCall", step: int, c: int, payload: Any, src: int) -> None:
        """Put ring record (step, chunk c) of the call in progress into its place (under the op lock)."""
        n, i = rc.n, rc.i
        s = (i - step - 1) % n if step < n - 1 else (i - (step - (n - 1))) % n
        if not (0 <= step < 2 * (n - 1)) or not (0 <= c < len(rc.segs[s])):
            raise ProtocolError(f"allreduce() ring: rank {src} sent step {step} chunk {c}, which does not exist")
        if step == 0 and c == 0:
            with self.op._lock:
                theirs = self.groups.pop(("r", rc.call, src), None)
            if theirs is not None:
                groups = merge_groups({rc.desc: [self.op.rank]}, theirs)
                if len(groups) > 1:
                    raise mismatch_error(rc.call, groups)
        a, b = rc.segs[s][c]
        if not isinstance(payload, np.ndarray) or payload.dtype != rc.out.dtype or payload.size != b - a:
            raise ProtocolError(f"allreduce() ring: rank {src} sent "
                                f"{getattr(payload, 'dtype', type(payload).__name__)} x "
                                f"{getattr(payload, 'size', '?')} for a chunk of {b - a} x {rc.out.dtype} "
                                "(every rank must pass arrays of the same shape and dtype)")
        if (step, c) in rc.applied:
            raise ProtocolError(f"allreduce() ring: rank {src} sent step {step} chunk {c} twice")
        if step < n - 1:
            rc.ufunc(rc.src[a:b], payload.reshape(-1), out=rc.out[a:b])
        else:
            rc.out[a:b] = payload.reshape(-1)
        rc.applied.add((step, c))

    def _wait_applied(self, rc: "_RingCall", step: int, c: int, left: int, timeout: float) -> None:
        op = self.op

        def ready() -> bool:
            return (step, c) in rc.applied or op._error is not None or op._closed

        def on_timeout() -> BaseException:
            return OperationTimeout(f"allreduce() call {rc.call}: no data from rank {left} "
                                    f"(ring step {step}, chunk {c})", edge=op.edge, operation=op.operation,
                                    timeout=timeout)
        op.ctx.wait_until(ready, timeout=timeout, on_timeout=on_timeout)
        op._raise_if_failed()
        if (step, c) not in rc.applied:
            raise ClosedError(f"{op.describe()} was closed during allreduce()")


class _RingCall:
    """The ring allreduce call in progress on this rank: where its records go and which have arrived."""

    __slots__ = ("call", "n", "i", "src", "out", "segs", "ufunc", "applied", "desc")

    def __init__(self, call: int, n: int, i: int, src: np.ndarray, out: np.ndarray,
                 segs: list[list[tuple[int, int]]], ufunc: Any, desc: str) -> None:
        self.call, self.n, self.i = call, n, i
        self.src, self.out, self.segs, self.ufunc = src, out, segs, ufunc
        self.desc = desc
        self.applied: set[tuple[int, int]] = set()
