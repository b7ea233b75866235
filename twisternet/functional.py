"""The functional layer: ``tn.all_reduce``, ``tn.broadcast``, ``tn.reduce``, ``tn.all_gather``,
``tn.gather``, ``tn.barrier`` — one call per collective, MPI/torch.distributed style, with no edge to pick.

Every call is a collective over all ranks of the Context (the one the last ``tn.init()`` returned, or
``ctx=``): every rank makes the same calls in the same order. Each call draws its operation's edge
from the Context's automatic stream (:func:`collectives.edges.next_auto_edge`, in the reserved range
``[AUTO_EDGE_BASE, MAX_USER_EDGE)``, so it never meets an edge picked by hand). ``all_reduce`` keeps
one AllReduce operation per reduction and ``via`` and reuses it (its shared-memory segment is set up
once); the others create an operation per call and close it when the call is over.

``async_op=True`` returns a :class:`collectives.handles.Handle` instead of the result: ``wait()``,
``is_completed()``, ``get_future()``. ``src``/``dst`` are ranks. Values are anything the codec carries;
numpy arrays and array-likes (CPU torch tensors, buffer-protocol, ``__array_interface__``,
``__dlpack__`` objects) travel as numpy views without a copy, and ``out=`` writes the result into
the caller's array or tensor. An invalid input on one rank (a CUDA tensor, an ``out`` of the wrong
shape) raises there and fails the call on every other rank too (RemoteError naming that rank).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

import numpy as np

from .codec import as_array
from .errors import ConfigError, TwisternetError

if TYPE_CHECKING:
    from .context import Context

_current: weakref.ref[Context] | None = None
_current_lock = threading.Lock()

#: Reductions ``all_reduce`` and ``reduce`` accept by name.
OPS = ("sum", "avg", "mean", "min", "max", "prod")


def set_current(ctx: Context) -> None:
    """Make ``ctx`` the Context the functional calls use by default (``tn.init`` does this)."""
    global _current
    with _current_lock:
        _current = weakref.ref(ctx)


def current_context(ctx: Context | None = None) -> Context:
    """``ctx``, or the Context of the last ``tn.init()`` if it is still open."""
    if ctx is not None:
        return ctx
    with _current_lock:
        got = _current() if _current is not None else None
    if got is None or got.closed:
        raise TwisternetError("no open twisternet Context: call tn.init() first (or pass ctx=)")
    return got


# ---------------------------------------------------------------------------------- per-Context state
class _State:
    """What the functional layer keeps per Context and automatic edge stream."""

    def __init__(self, ctx: Context, stream: int, ranks: list[int] | None) -> None:
        self.ctx = ctx
        self.stream = stream
        self.lock = threading.Lock()
        self.allreduce_ops: dict[tuple[Any, ...], Any] = {}
        plan = ctx.plan
        first: dict[int, int] = {}
        for t in plan.tasks:
            r = plan.rank_of(t)
            first.setdefault(r, t)
        if ranks is None:
            ranks = sorted(first)
        missing = [r for r in ranks if r not in first]
        if missing:
            raise ConfigError("ranks", f"ranks {missing} run no task of the Context's task plan")
        self.ranks = list(ranks)
        #: rank -> the task that stands for it (its first task of the plan)
        self.task_of = {r: first[r] for r in self.ranks}

    def edge(self) -> int:
        from collectives.edges import next_auto_edge
        return next_auto_edge(self.ctx, self.stream)

    def tasks(self) -> list[int]:
        return [self.task_of[r] for r in self.ranks]

    def task(self, rank: Any, what: str) -> int:
        if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or int(rank) not in self.task_of:
            raise ConfigError(what, f"must be one of the ranks {self.ranks}, got {rank!r}")
        return self.task_of[int(rank)]

    def close(self) -> None:
        with self.lock:
            ops, self.allreduce_ops = list(self.allreduce_ops.values()), {}
        for op in ops:
            try:
                op.abort()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


_states: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def _state(ctx: Context) -> _State:
    with _states_lock:
        st = _states.get(ctx)
        if st is None:
            st = _states[ctx] = _State(ctx, 0, None)
        return st


def release(ctx: Context | None = None) -> None:
    """Close the operations the functional layer keeps for ``ctx`` (the next call sets them up again);
    call it collectively, e.g. before closing the Context."""
    ctx = current_context(ctx)
    with _states_lock:
        st = _states.pop(ctx, None)
    if st is not None:
        st.close()


# ---------------------------------------------------------------------------------- helpers
def _as_value(x: Any) -> Any:
    """The array view of an array-like ``x`` (zero copy), else ``x``."""
    arr = as_array(x)
    return x if arr is None else arr


def _input(x: Any, what: str) -> tuple[Any, BaseException | None]:
    """``(_as_value(x), None)``, or ``(None, error)`` for an invalid input: the call then fails on every
    rank (the dataflow carries the error), not on this one alone."""
    try:
        return _as_value(x), None
    except Exception as e:  # noqa: BLE001 - a bad input fails the call on every rank
        return None, _bad(what, e)


def _wrap_like(x: Any, result: Any) -> Any:
    """``result`` (a numpy array) as a torch tensor when ``x`` was one (sharing memory), else as is."""
    if isinstance(result, np.ndarray) and not isinstance(x, np.ndarray):
        from .codec import _is_torch_tensor
        if _is_torch_tensor(x):
            import torch
            return torch.from_numpy(result) if result.flags.writeable else torch.from_numpy(result.copy())
    return result


def _out_view(out: Any, shape: tuple[int, ...], dtype: Any, what: str) -> np.ndarray:
    """The writeable numpy view of ``out`` after checking it can hold a result of ``shape``/``dtype``."""
    arr = as_array(out)
    if arr is None:
        raise TypeError(f"{what}: out must be a numpy array or an array-like (CPU torch tensor, ...), "
                        f"got {type(out).__qualname__}")
    if arr.shape != tuple(shape) or (dtype is not None and arr.dtype != dtype):
        raise ValueError(f"{what}: out is {arr.dtype}{list(arr.shape)}, the result is {dtype}{list(shape)}")
    if not arr.flags.writeable:
        raise ValueError(f"{what}: out is read-only")
    return arr


def _bad(what: str, e: BaseException) -> BaseException:
    """``e`` (an invalid input) with the call named in its message, same type when it can be rebuilt."""
    if str(e).startswith(what):
        return e
    try:
        err = type(e)(f"{what}: {e}")
    except Exception:  # noqa: BLE001 - an exception type with another signature: keep it as it is
        return e
    err.__cause__ = e
    return err


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are views of exactly the same memory (same start, shape, strides, dtype)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.shape == b.shape
            and a.strides == b.strides and a.dtype == b.dtype)


def _handle(ctx: Context, what: str, timeout: float | None, cleanup: Callable[[], None] | None = None) -> Any:
    from collectives.handles import Handle
    return Handle(ctx, what, timeout=timeout, cleanup=cleanup)


def _finish(handle: Any, async_op: bool) -> Any:
    return handle if async_op else handle.wait()


# ---------------------------------------------------------------------------------- all_reduce
def all_reduce(x: Any, op: str = "sum", *, out: Any = None, async_op: bool = False, via: str = "auto",
               timeout: float | None = None, ctx: Context | None = None, _state_of: _State | None = None) -> Any:
    """The reduction (``op``: "sum", "avg"/"mean", "min", "max", "prod", or a callable) of every rank's
    ``x``, on every rank; bit-identical on every rank. ``out``: write the result there (it may be ``x``
    itself, in place) and return it. ``via``: the algorithm ("auto", "shm", "ring", "doubling", "tree", "innet"; see
    ``collectives.AllReduce``). Calls run in submission order on the Context's collective stream."""
    ctx = current_context(ctx)
    st = _state_of or _state(ctx)
    from collectives.allreduce import VIAS
    if via not in VIAS:
        raise ConfigError("via", f"must be one of {', '.join(VIAS)}, got {via!r}")
    if isinstance(op, str) and op not in OPS:
        raise ConfigError("op", f"must be one of {', '.join(OPS)} or a callable, got {op!r}")
    name = op if isinstance(op, str) else getattr(op, "__qualname__", repr(op))
    what = f"all_reduce({name!r}) on rank {ctx.rank}"
    handle = _handle(ctx, what, timeout)
    arop, finalize = _allreduce_op(st, op, via, timeout)
    bad: BaseException | None = None
    value: Any = None
    target: np.ndarray | None = None
    try:
        value = _as_value(x)
        if out is not None:
            if not isinstance(value, np.ndarray):
                raise TypeError(f"{what}: out= needs an array value, got {type(x).__qualname__}")
            target = _out_view(out, value.shape, value.dtype, what)
            if target is not value and _same_memory(target, value):
                value = target      # in place: out is (a view of) x itself, e.g. a tensor's
    except Exception as e:  # noqa: BLE001 - a bad input fails the call on every rank
        bad = _bad(what, e)
    from collectives.handles import engine
    eng = engine(ctx, st.stream)
    n = len(st.ranks)

    def call() -> Any:
        if bad is not None:
            arop._fail_everywhere(bad, f"in {what}: invalid input")
            _forget(st, arop)
            raise bad
        try:
            if target is not None and target.flags.c_contiguous:
                res = arop.allreduce(value, out=target, timeout=timeout)
            else:
                res = arop.allreduce(value, timeout=timeout)
            if finalize and n > 1:
                from collectives.reduction import Reduction
                res = Reduction("avg").finalize(res, n)
            if target is not None and res is not target:
                target[...] = res
                res = target
        except BaseException as e:
            # the operation (or its shared-memory state) may be unusable now: every rank drops it, and
            # the next call starts another on a fresh edge
            if arop._failure() is None and isinstance(e, Exception):
                arop._fail_everywhere(e, f"in {what}")
            _forget(st, arop)
            raise
        if out is not None:
            return out
        return _wrap_like(x, res)
    if async_op:
        return eng.submit(handle, call)
    return eng.run(handle, call)


#: The shared-memory segment of one cached all_reduce holds ``2 n + 2`` slots; their total stays under this.
SHM_SEGMENT_BUDGET = 128 << 20
#: The largest shared-memory slot the functional layer asks for.
SHM_SLOT_MAX = 16 << 20


def shm_slot_bytes(nranks: int) -> int:
    """The shared-memory slot size of the functional layer's all_reduce for ``nranks`` ranks: large, so a
    64 MB call takes 4-8 rounds (two waits each) instead of 64 of 1 MB. Every wait is a point where a rank
    may have to be scheduled again; on a busy machine those, not the copies, dominated (a 64 MB call at 2
    ranks: ~200 ms with 1 MB slots, ~120 ms with 16 MB, for ~22 ms of copying and adding per rank)."""
    slots = 2 * max(1, nranks) + 2
    size = min(SHM_SLOT_MAX, max(1 << 20, SHM_SEGMENT_BUDGET // slots))
    return size // 4096 * 4096


def _allreduce_op(st: _State, op: Any, via: str, timeout: float | None) -> tuple[Any, bool]:
    """The cached AllReduce of ``st`` for (op, via), created on the first call (every rank alike)."""
    from collectives import AllReduce
    average = isinstance(op, str) and op in ("avg", "mean")
    # the switch adds sums only: an average in the network is a sum divided here
    name = "sum" if average and via == "innet" else op
    key = (name if isinstance(name, str) else id(name), via)
    with st.lock:
        arop = st.allreduce_ops.get(key)
        # a failed operation is replaced only once this rank's own call on it has failed (_forget): another
        # rank's failure can reach this one before it submits that very call, and replacing the operation
        # then would put this rank's call on the next edge, a call ahead of the others
        if arop is None or arop._is_closed():
            arop = AllReduce(st.ctx, sources=st.tasks(), edge=st.edge(), op=name, via=via, timeout=timeout,
                             shm_chunk_bytes=shm_slot_bytes(len(st.ranks)))
            st.allreduce_ops[key] = arop
    return arop, average and name == "sum"


def _forget(st: _State, arop: Any) -> None:
    """A failed cached AllReduce: drop it (the next call creates another on a fresh edge) and close it."""
    with st.lock:
        for k, v in list(st.allreduce_ops.items()):
            if v is arop:
                del st.allreduce_ops[k]
    try:
        arop.abort()
    except Exception:  # noqa: BLE001
        pass


# ---------------------------------------------------------------------------------- dataflow calls
def _dataflow(ctx: Context, st: _State, what: str, make: Callable[[int], Any], contribute: Callable[[Any], object],
              result: Callable[[Any], Any], async_op: bool, timeout: float | None,
              bad: BaseException | None = None) -> Any:
    """One batch operation on a fresh automatic edge: this rank contributes, the handle completes from
    the operation's completion path (see ``Operation.when_settled``), the operation closes after."""
    from collectives.handles import engine
    op = make(st.edge())

    def cleanup() -> None:     # a failed operation has nothing left to pass on: stop at once
        if op._failure() is not None:
            op.abort()
        else:
            op.close()
    handle = _handle(ctx, what, timeout, cleanup=cleanup)
    if bad is not None:
        op._fail_everywhere(bad, f"in {what}: invalid input")
        handle.fail(bad)
        handle.release()
        return _finish(handle, async_op)

    def settled(err: BaseException | None) -> None:
        if err is not None:
            handle.fail(err)
            return
        try:
            got = result(op)
        except BaseException as e:  # noqa: BLE001
            handle.fail(e)
        else:
            handle.complete(got)
    try:
        contribute(op)
    except BaseException as e:  # noqa: BLE001 - whatever it is fails the handle, which raises it
        if op._failure() is None and isinstance(e, Exception):   # e.g. a value the codec refuses
            e = _bad(what, e)
            op._fail_everywhere(e, f"in {what}")
        handle.fail(e)
        handle.release()
        return _finish(handle, async_op)
    op.when_settled(settled)
    engine(ctx).watch(handle)
    return _finish(handle, async_op)


def broadcast(x: Any = None, src: int = 0, *, out: Any = None, async_op: bool = False,
              timeout: float | None = None, ctx: Context | None = None, _state_of: _State | None = None) -> Any:
    """Rank ``src``'s ``x`` on every rank (the others' ``x`` is ignored). ``out``: write it there (an
    array-like of its shape and dtype) and return ``out``."""
    ctx = current_context(ctx)
    st = _state_of or _state(ctx)
    from collectives import Broadcast
    root = st.task(src, "src")
    mine = ctx.rank == src
    what = f"broadcast(src={src}) on rank {ctx.rank}"
    value, bad = _input(x, what) if mine else (None, None)

    def result(op: Any) -> Any:
        vals = list(op.results())
        got = vals[0] if vals else None
        if out is not None:
            arr = as_array(got)
            if arr is None:
                raise TypeError(f"{what}: out= needs an array result, rank {src} sent {type(got).__qualname__}")
            _out_view(out, arr.shape, arr.dtype, what)[...] = arr
            return out
        if mine:
            return x
        return got
    return _dataflow(ctx, st, what,
                     lambda e: Broadcast(ctx, sources=[root], destinations=st.tasks(), edge=e, timeout=timeout),
                     lambda op: (op.send(root, value, copy=False), op.finish(root)) if mine else None,
                     result, async_op, timeout, bad)


def reduce(x: Any, dst: int = 0, op: str = "sum", *, out: Any = None, async_op: bool = False,
           timeout: float | None = None, ctx: Context | None = None, _state_of: _State | None = None) -> Any:
    """The reduction of every rank's ``x`` on rank ``dst`` (None elsewhere); ``op`` as for
    :func:`all_reduce`. ``out`` (on ``dst``): write the result there and return it."""
    ctx = current_context(ctx)
    st = _state_of or _state(ctx)
    from collectives import Reduce
    from collectives.reduction import Reduction
    if isinstance(op, str) and op not in OPS:
        raise ConfigError("op", f"must be one of {', '.join(OPS)} or a callable, got {op!r}")
    root = st.task(dst, "dst")
    me = st.task_of.get(ctx.rank)
    average = isinstance(op, str) and op in ("avg", "mean")
    red = "sum" if average else op
    what = f"reduce({op if isinstance(op, str) else 'fn'!r}, dst={dst}) on rank {ctx.rank}"
    value, bad = _input(x, what)

    def result(rop: Any) -> Any:
        if ctx.rank != dst:
            return None
        got = rop.result()
        if average:
            got = Reduction(op).finalize(got, len(st.ranks))
        if out is not None:
            arr = as_array(got)
            if arr is None:
                raise TypeError(f"{what}: out= needs an array result, got {type(got).__qualname__}")
            _out_view(out, arr.shape, arr.dtype, what)[...] = arr
            return out
        return _wrap_like(x, got)
    return _dataflow(ctx, st, what,
                     lambda e: Reduce(ctx, sources=st.tasks(), dst=root, edge=e, op=red, timeout=timeout),
                     lambda rop: (rop.send(me, value), rop.finish(me)), result, async_op, timeout, bad)


def all_gather(obj: Any, *, async_op: bool = False, timeout: float | None = None, ctx: Context | None = None,
               _state_of: _State | None = None) -> Any:
    """Every rank's ``obj``, as a list in rank order, on every rank."""
    ctx = current_context(ctx)
    st = _state_of or _state(ctx)
    from collectives import AllGather
    me = st.task_of.get(ctx.rank)
    what = f"all_gather() on rank {ctx.rank}"
    value, bad = _input(obj, what)
    return _dataflow(ctx, st, what,
                     lambda e: AllGather(ctx, sources=st.tasks(), edge=e, timeout=timeout),
                     lambda op: (op.send(me, value), op.finish(me)),
                     lambda op: list(op.values()), async_op, timeout, bad)


def gather(obj: Any, dst: int = 0, *, async_op: bool = False, timeout: float | None = None, ctx: Context | None = None,
           _state_of: _State | None = None) -> Any:
    """Every rank's ``obj``, as a list in rank order, on rank ``dst`` (None elsewhere)."""
    ctx = current_context(ctx)
    st = _state_of or _state(ctx)
    from collectives import Gather
    root = st.task(dst, "dst")
    me = st.task_of.get(ctx.rank)
    what = f"gather(dst={dst}) on rank {ctx.rank}"
    value, bad = _input(obj, what)
    return _dataflow(ctx, st, what,
                     lambda e: Gather(ctx, sources=st.tasks(), dst=root, edge=e, timeout=timeout),
                     lambda op: (op.send(me, value), op.finish(me)),
                     lambda op: list(op.values()) if ctx.rank == dst else None, async_op, timeout, bad)


def barrier(*, async_op: bool = False, timeout: float | None = None, ctx: Context | None = None,
            _state_of: _State | None = None) -> Any:
    """Return once every rank called it (a handle that completes then, with ``async_op``)."""
    ctx = current_context(ctx)
    st = _state_of or _state(ctx)
    # an allreduce of one byte by recursive doubling on the cached operation: no operation to set up per
    # call, and ceil(log2 n) rounds of messages in parallel instead of a round trip through a tree's root
    if not async_op:
        all_reduce(np.zeros(1, np.uint8), "max", via="doubling", timeout=timeout, ctx=ctx, _state_of=st)
        return None
    h = all_reduce(np.zeros(1, np.uint8), "max", async_op=True, via="doubling", timeout=timeout, ctx=ctx,
                   _state_of=st)
    from collectives.handles import Handle
    done = Handle(ctx, f"barrier() on rank {ctx.rank}", timeout=timeout)

    def settled(f: Any) -> None:
        err = f.exception()
        if err is not None:
            done.fail(err)
        else:
            done.complete(None)
    h.get_future().add_done_callback(settled)
    return _finish(done, async_op)
