"""``torch.distributed`` backend "twisternet": a pure-Python ProcessGroup over a twisternet Context.

``import twisternet.torch`` registers it (``Backend.register_backend("twisternet", ..., devices=["cpu"])``),
after which ``torch.distributed.init_process_group(backend="twisternet")`` works wherever ``tn.init()``
does (torchrun, ``twisternet run``, mpiexec; see :func:`twisternet.torch.init_process_group` for the last
two, which do not set torch's env:// variables). Collectives go through the functional layer
(:mod:`twisternet.functional`): its algorithm selection (shared memory on one host, ring, tree, or
in-network with ``via="innet"``), automatic edges (one stream per process group) and non-blocking
handles, which back the ``Work`` objects returned here. Tensors must be on the CPU; they are reduced in
place through numpy views of their memory (no copy in or out).

Supported: allreduce (SUM, AVG, MIN, MAX, PRODUCT) and allreduce_coalesced, broadcast, allgather (and
all_gather_into_tensor), reduce_scatter (and reduce_scatter_tensor), reduce, gather, scatter, alltoall
(and all_to_all_single), barrier, send/recv. Anything else raises :class:`TorchBackendError` naming the
operation; so do tensors on another device or of a dtype numpy lacks (bfloat16), on every rank of the
call (the other ranks raise RemoteError naming the rank whose input was bad).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import secrets
import threading
import zlib
from collections import defaultdict, deque
from datetime import timedelta
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from twisternet import functional as F
from twisternet.codec import as_array
from twisternet.errors import ConfigError, OperationTimeout, TwisternetError

log = logging.getLogger(__name__)

BACKEND_NAME = "twisternet"
#: Environment variable choosing the allreduce algorithm of every group ("auto", "shm", "ring", "tree",
#: "innet"); not a TWISTERNET_ variable, which would be read as a configuration key.
VIA_ENV = "TORCH_TWISTERNET_VIA"
_default_via: str | None = None


class TorchBackendError(TwisternetError, RuntimeError):
    """A torch.distributed call the twisternet backend cannot carry out (op, device, dtype)."""


# ---------------------------------------------------------------------------------- the Context
_ctx_lock = threading.Lock()
_owned_ctx: Any = None


def _context(store: Any, group_size: int) -> Any:
    """The process's twisternet Context: the open one of ``tn.init()`` if any, else one made now (the
    job token comes from torch's store when the environment gives none)."""
    global _owned_ctx
    with _ctx_lock:
        try:
            return F.current_context()
        except TwisternetError:
            pass
        import twisternet as tn
        from twisternet.launch_env import detect
        kwargs: dict[str, Any] = {}
        info = detect()
        no_token = not any(os.environ.get(k) for k in ("TWISTERNET_TOKEN", "TWISTERNET_TOKEN_FILE",
                                                        "TWISTERNET_TOKEN_DIR"))
        if info.launcher in ("torchrun", "slurm", "kubernetes") and no_token and store is not None:
            # torch's store is already shared and trusted by the job: hand the token over through it
            key = "twisternet/job-token"
            if info.rank == 0:
                store.set(key, secrets.token_hex(32))
            kwargs["token"] = store.get(key).decode()
        ctx = tn.init(**kwargs)
        _owned_ctx = ctx
        atexit.register(_close_owned)
        return ctx


def _close_owned() -> None:
    global _owned_ctx
    ctx, _owned_ctx = _owned_ctx, None
    if ctx is not None and not ctx.closed:
        try:
            from collectives.handles import stop_engine
            stop_engine(ctx)
            ctx.close()
        except Exception:  # noqa: BLE001 - at exit, best effort
            log.debug("closing the twisternet Context failed", exc_info=True)


# ---------------------------------------------------------------------------------- Work
class TwisternetWork(dist.Work):
    """A torch Work backed by a torch Future that a twisternet handle completes: ``wait()`` returns once
    the call completed and raises its error (torch's future-wrapping Work would swallow it)."""

    def __init__(self, fut: torch.futures.Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: Any = None) -> bool:
        self._fut.wait()        # raises the call's error
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True

    def exception(self) -> Any:
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as e:  # noqa: BLE001
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        return self._fut


def _create_work_from_future(fut: torch.futures.Future) -> TwisternetWork:
    return TwisternetWork(fut)


def _work(handles: Sequence[Any], value: Callable[[], Any]) -> Any:
    """A torch Work whose future completes with ``value()`` once every handle did (or with the first error)."""
    fut: torch.futures.Future = torch.futures.Future()
    left = [len(handles)]
    lock = threading.Lock()

    def one_done(f: concurrent.futures.Future) -> None:
        err = f.exception()
        with lock:
            if left[0] < 0:
                return
            if err is not None:
                left[0] = -1
            else:
                left[0] -= 1
                if left[0]:
                    return
        if err is not None:
            fut.set_exception(err)
            return
        try:
            got = value()
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
        else:
            fut.set_result(got)
    if not handles:
        fut.set_result(value())
    for h in handles:
        h.get_future().add_done_callback(one_done)
    return _create_work_from_future(fut)


def _done_work(value: Any) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return _create_work_from_future(fut)


def _failed_work(err: BaseException) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_exception(err)
    return _create_work_from_future(fut)


_REDUCE_OPS = {"SUM": "sum", "AVG": "avg", "MIN": "min", "MAX": "max", "PRODUCT": "prod"}


def _op_name(op: Any, what: str) -> str:
    for name, ours in _REDUCE_OPS.items():
        if op == getattr(dist.ReduceOp, name):
            return ours
    name = str(getattr(op, "op", op)).rsplit(".", 1)[-1]
    raise TorchBackendError(f"twisternet backend: {what} does not support ReduceOp.{name}; use SUM, AVG, MIN, "
                            "MAX or PRODUCT")


def _check_tensor(t: Any, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TorchBackendError(f"twisternet backend: {what} takes tensors, got {type(t).__qualname__}")
    if t.device.type != "cpu":
        raise TorchBackendError(f"twisternet backend: {what} got a tensor on device {str(t.device)!r}; the "
                                "backend moves CPU tensors only (use gloo or nccl for this device, or .cpu())")


# ---------------------------------------------------------------------------------- the group
class ProcessGroupTwisternet(dist.ProcessGroup):
    """One torch process group: ``global_ranks`` (twisternet ranks) in group-rank order."""

    def __init__(self, ctx: Any, group_rank: int, global_ranks: list[int], stream: int, via: str,
                 timeout: float | None) -> None:
        super().__init__(group_rank, len(global_ranks))
        self.ctx = ctx
        self.global_ranks = list(global_ranks)
        self.via = via
        self.timeout = timeout
        self.state = F._State(ctx, stream, self.global_ranks)
        self._p2p = _PointToPoint(ctx, self.state, self.global_ranks)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def _g(self, group_rank: int, what: str) -> int:
        if not 0 <= group_rank < len(self.global_ranks):
            raise TorchBackendError(f"twisternet backend: {what}: rank {group_rank} is not in this group of "
                                    f"{len(self.global_ranks)}")
        return self.global_ranks[group_rank]

    def __repr__(self) -> str:
        return f"<ProcessGroupTwisternet rank {self.rank()} of {self.size()} via={self.via}>"

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 - returned as a failed Work (wait() raises it)
            log.error("rank %d: %s failed: %r", self.ctx.rank, what, e)
            return _failed_work(e)

    # ------------------------------------------------------------------ allreduce
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._guard("allreduce", lambda: self._allreduce(list(tensors), op))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._guard("allreduce_coalesced", lambda: self._allreduce(list(tensors), op))

    def _allreduce(self, tensors: list[torch.Tensor], op: Any) -> Any:
        name = _op_name(op, "allreduce")
        handles = []
        for t in tensors:   # the functional layer checks the tensor (device, dtype) and fails every rank
            handles.append(F.all_reduce(t, name, out=t, async_op=True, via=self.via, timeout=self.timeout,
                                        ctx=self.ctx, _state_of=self.state))
        return _work(handles, lambda: tensors)

    # ------------------------------------------------------------------ broadcast
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        def go() -> Any:
            src = self._g(opts.rootRank if opts is not None else 0, "broadcast")
            handles = []
            for t in tensors:
                handles.append(F.broadcast(t, src=src, out=t, async_op=True, timeout=self.timeout,
                                           ctx=self.ctx, _state_of=self.state))
            return _work(handles, lambda: list(tensors))
        return self._guard("broadcast", go)

    # ------------------------------------------------------------------ allgather
    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> Any:
        def go() -> Any:
            handles = []
            for t in input_tensors:
                handles.append(F.all_gather(t, async_op=True, timeout=self.timeout, ctx=self.ctx,
                                            _state_of=self.state))

            def fill() -> Any:
                for outs, h in zip(output_tensors, handles):
                    got = h.get_future().result()
                    if len(outs) != len(got):
                        raise TorchBackendError(f"allgather: {len(outs)} output tensors for {len(got)} ranks")
                    for o, g in zip(outs, got):
                        _copy_into(o, g, "allgather")
                return output_tensors
            return _work(handles, fill)
        return self._guard("allgather", go)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        def go() -> Any:
            h = F.all_gather(input, async_op=True, timeout=self.timeout, ctx=self.ctx, _state_of=self.state)

            def fill() -> Any:
                got = h.get_future().result()
                _copy_into(output, np.concatenate([np.asarray(g).reshape(-1) for g in got]),
                           "all_gather_into_tensor", flat=True)
                return [output]
            return _work([h], fill)
        return self._guard("all_gather_into_tensor", go)

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _chain(works, outputs)

    # ------------------------------------------------------------------ reduce_scatter
    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def go() -> Any:
            name = _op_name(op, "reduce_scatter")
            handles, parts = [], []
            for out, ins in zip(output_tensors, input_tensors):
                _check_tensor(out, "reduce_scatter")
                if len(ins) != self.size():
                    raise TorchBackendError(f"reduce_scatter: {len(ins)} input tensors for {self.size()} ranks")
                for t in ins:
                    _check_tensor(t, "reduce_scatter")
                flat = np.concatenate([_view(t).reshape(-1) for t in ins])
                parts.append((out, [t.numel() for t in ins]))
                handles.append(F.all_reduce(flat, name, out=flat, async_op=True, via=self.via,
                                            timeout=self.timeout, ctx=self.ctx, _state_of=self.state))

            def fill() -> Any:
                for (out, sizes), h in zip(parts, handles):
                    got = h.get_future().result()
                    a = sum(sizes[:self.rank()])
                    _copy_into(out, got[a:a + sizes[self.rank()]], "reduce_scatter", flat=True)
                return output_tensors
            return _work(handles, fill)
        return self._guard("reduce_scatter", go)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        def go() -> Any:
            _check_tensor(input, "reduce_scatter_tensor")
            chunks = list(torch.chunk(input.reshape(-1), self.size()))
            if input.numel() != output.numel() * self.size():
                raise TorchBackendError(f"reduce_scatter_tensor: input has {input.numel()} elements, output "
                                        f"{output.numel()} x {self.size()} ranks")
            return self.reduce_scatter([output], [chunks], opts)
        return self._guard("reduce_scatter_tensor", go)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _chain(works, outputs)

    # ------------------------------------------------------------------ reduce, gather, scatter
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        def go() -> Any:
            name = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce")
            dst = self._g(opts.rootRank if opts is not None else 0, "reduce")
            handles = []
            for t in tensors:
                handles.append(F.reduce(t, dst=dst, op=name, out=t if self.ctx.rank == dst else None,
                                        async_op=True, timeout=self.timeout, ctx=self.ctx, _state_of=self.state))
            return _work(handles, lambda: list(tensors))
        return self._guard("reduce", go)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> Any:
        def go() -> Any:
            dst = self._g(opts.rootRank if opts is not None else 0, "gather")
            handles = []
            for t in input_tensors:
                handles.append(F.gather(t, dst=dst, async_op=True, timeout=self.timeout, ctx=self.ctx,
                                        _state_of=self.state))

            def fill() -> Any:
                if self.ctx.rank == dst:
                    for outs, h in zip(output_tensors, handles):
                        for o, g in zip(outs, h.get_future().result()):
                            _copy_into(o, g, "gather")
                return output_tensors
            return _work(handles, fill)
        return self._guard("gather", go)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> Any:
        def go() -> Any:
            src = self._g(opts.rootRank if opts is not None else 0, "scatter")
            mine = self.ctx.rank == src
            handles = []
            for i, out in enumerate(output_tensors):
                _check_tensor(out, "scatter")
                payload = [_view(t) for t in input_tensors[i]] if mine else None
                handles.append(F.broadcast(payload, src=src, async_op=True, timeout=self.timeout, ctx=self.ctx,
                                           _state_of=self.state))

            def fill() -> Any:
                for out, h in zip(output_tensors, handles):
                    _copy_into(out, h.get_future().result()[self.rank()], "scatter")
                return output_tensors
            return _work(handles, fill)
        return self._guard("scatter", go)

    # ------------------------------------------------------------------ all-to-all
    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Any:
        def go() -> Any:
            for t in list(output_tensors) + list(input_tensors):
                _check_tensor(t, "alltoall")
            if len(input_tensors) != self.size() or len(output_tensors) != self.size():
                raise TorchBackendError(f"alltoall: needs {self.size()} input and output tensors")
            h = F.all_gather([_view(t) for t in input_tensors], async_op=True, timeout=self.timeout,
                             ctx=self.ctx, _state_of=self.state)

            def fill() -> Any:
                got = h.get_future().result()
                for j, out in enumerate(output_tensors):
                    _copy_into(out, got[j][self.rank()], "alltoall")
                return output_tensors
            return _work([h], fill)
        return self._guard("alltoall", go)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
                          input_split_sizes: list[int] | None, opts: Any = None) -> Any:
        def go() -> Any:
            _check_tensor(input, "all_to_all_single")
            _check_tensor(output, "all_to_all_single")
            n = self.size()
            ins = _split(input, input_split_sizes, n, "all_to_all_single input")
            h = F.all_gather([_view(t).copy() for t in ins], async_op=True, timeout=self.timeout, ctx=self.ctx,
                             _state_of=self.state)

            def fill() -> Any:
                got = h.get_future().result()
                outs = _split(output, output_split_sizes, n, "all_to_all_single output")
                for j, o in enumerate(outs):
                    _copy_into(o, got[j][self.rank()], "all_to_all_single")
                return [output]
            return _work([h], fill)
        return self._guard("all_to_all_single", go)

    alltoall_base = all_to_all_single

    # ------------------------------------------------------------------ barrier, p2p
    def barrier(self, opts: Any = None) -> Any:
        return self._guard("barrier", lambda: _work(
            [F.barrier(async_op=True, timeout=self.timeout, ctx=self.ctx, _state_of=self.state)], lambda: []))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        def go() -> Any:
            for t in tensors:
                _check_tensor(t, "send")
            return self._p2p.send([_view(t) for t in tensors], self._g(dst, "send"), tag, tensors)
        return self._guard("send", go)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        def go() -> Any:
            for t in tensors:
                _check_tensor(t, "recv")
            return self._p2p.recv(tensors, self._g(src, "recv"), tag, self.timeout)
        return self._guard("recv", go)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        return _failed_work(TorchBackendError("twisternet backend: recv from any source is not supported; "
                                              "name the source rank"))


def _view(t: torch.Tensor) -> np.ndarray:
    arr = as_array(t)
    assert arr is not None
    return arr


def _copy_into(out: torch.Tensor, got: Any, what: str, *, flat: bool = False) -> None:
    src = np.asarray(got)
    dst = _view(out)
    if flat:
        if src.size != dst.size:
            raise TorchBackendError(f"{what}: got {src.size} elements for an output of {dst.size}")
        dst.reshape(-1)[...] = src.reshape(-1) if dst.flags.c_contiguous else src.reshape(dst.shape)
        if not dst.flags.c_contiguous:
            dst[...] = src.reshape(dst.shape)
        return
    if src.shape != dst.shape:
        raise TorchBackendError(f"{what}: got a tensor of shape {list(src.shape)} for an output of shape "
                                f"{list(dst.shape)}; every rank must pass tensors of the same shape")
    dst[...] = src


def _split(t: torch.Tensor, sizes: list[int] | None, n: int, what: str) -> list[torch.Tensor]:
    if not sizes:
        if t.shape[0] % n:
            raise TorchBackendError(f"{what}: dim 0 ({t.shape[0]}) is not divisible by {n} ranks")
        sizes = [t.shape[0] // n] * n
    if len(sizes) != n or sum(sizes) != t.shape[0]:
        raise TorchBackendError(f"{what}: split sizes {sizes} do not cover dim 0 ({t.shape[0]}) over {n} ranks")
    return list(torch.split(t, list(sizes)))


def _chain(works: list[Any], value: Any) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    futs = [w.get_future() for w in works]
    all_done = torch.futures.collect_all(futs)

    def done(f: Any) -> None:
        try:
            for x in f.value():
                x.value()
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
        else:
            fut.set_result(value)
    all_done.add_done_callback(done)
    return _create_work_from_future(fut)


# ---------------------------------------------------------------------------------- send/recv
class _PointToPoint:
    """send/recv of a group on one channel edge of its own: records ``(tag, [arrays])`` queued per
    (source, tag) until a recv takes them."""

    def __init__(self, ctx: Any, state: Any, global_ranks: list[int]) -> None:
        from collectives.edges import channel_edge, claim_edge
        self.ctx = ctx
        # a stream of its own: a recv waiting for its sender holds up no collective of the group
        self.stream = ("p2p", state.stream)
        self.user_edge = state.edge()
        claim_edge(ctx, self.user_edge, "torch send/recv")
        self.edge = channel_edge(self.user_edge, 0)
        self.queues: dict[tuple[int, int], deque] = defaultdict(deque)
        self.lock = threading.Lock()
        ctx.register(self.edge, self._on_record, name="torch send/recv")

    def _on_record(self, src: int, obj: Any) -> bool:
        tag, arrays = obj
        with self.lock:
            self.queues[(src, int(tag))].append([np.array(a, copy=True) for a in arrays])
        self.ctx.notify()
        return True

    def send(self, arrays: list[np.ndarray], dst: int, tag: int, keep: Any) -> Any:
        from collectives.handles import Handle
        h = Handle(self.ctx, f"send to rank {dst} (tag {tag})")
        sh = self.ctx.isend(dst, self.edge, [int(tag), arrays])

        def wait_sent() -> None:
            sh.wait()
        from collectives.handles import engine
        engine(self.ctx, self.stream).submit(h, wait_sent)
        return _work([h], lambda: list(keep))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, timeout: float | None) -> Any:
        from collectives.handles import Handle, engine
        h = Handle(self.ctx, f"recv from rank {src} (tag {tag})", timeout=timeout)
        key = (src, int(tag))

        def take() -> None:
            def ready() -> bool:
                with self.lock:
                    return bool(self.queues[key])
            self.ctx.wait_until(ready, timeout=h.timeout, on_timeout=lambda: OperationTimeout(
                f"recv from rank {src} (tag {tag}): nothing arrived", timeout=h.timeout))
            with self.lock:
                arrays = self.queues[key].popleft()
            if len(arrays) != len(tensors):
                raise TorchBackendError(f"recv: rank {src} sent {len(arrays)} tensors, {len(tensors)} expected")
            for t, a in zip(tensors, arrays):
                _copy_into(t, a, f"recv from rank {src}")
        engine(self.ctx, self.stream).submit(h, take)
        return _work([h], lambda: list(tensors))


# ---------------------------------------------------------------------------------- creation
def _via(backend_options: Any) -> str:
    via = None
    if isinstance(backend_options, dict):
        via = backend_options.get("via")
    elif backend_options is not None:
        via = getattr(backend_options, "via", None)
    via = via or _default_via or os.environ.get(VIA_ENV) or "auto"
    from collectives.allreduce_algorithms import VIAS
    if via not in VIAS:
        raise ConfigError("via", f"the twisternet backend's via must be one of {', '.join(VIAS)}, got {via!r}")
    return via


def _stream_of(global_ranks: list[int], world: int, group_id: str) -> int:
    """The automatic edge stream of a group, the same on every member rank: torch numbers its groups
    "0" (the world), "1", "2", ... in creation order on every rank, and group ``g`` gets stream ``1 + g``
    (no two groups share one); a group named otherwise (hashed names) gets one derived from its name and
    ranks, in the upper half of the streams."""
    from collectives.edges import AUTO_STREAMS
    if group_id.isdigit() and 1 + int(group_id) < AUTO_STREAMS // 2:
        return 1 + int(group_id)
    if group_id in ("default_pg", "") and global_ranks == list(range(world)):
        return 1
    half = AUTO_STREAMS // 2
    return half + zlib.crc32(f"{group_id}|{global_ranks}".encode()) % half


def _create(opts: Any, backend_options: Any) -> ProcessGroupTwisternet:
    """torch's creator hook (``extended_api=True``): a group from torch's store, rank and size."""
    group_rank, group_size = int(opts.group_rank), int(opts.group_size)
    global_ranks = list(opts.global_ranks_in_group) or list(range(group_size))
    ctx = _context(opts.store, group_size)
    if ctx.rank != global_ranks[group_rank]:
        raise TorchBackendError(f"twisternet backend: torch says this process is rank {global_ranks[group_rank]} "
                                f"but twisternet joined it as rank {ctx.rank}; start the job so that both "
                                "agree (torchrun, or twisternet.torch.init_process_group)")
    if max(global_ranks) >= ctx.world:
        raise TorchBackendError(f"twisternet backend: the group's ranks {global_ranks} exceed the twisternet job "
                                f"of {ctx.world}")
    timeout = opts.timeout.total_seconds() if isinstance(opts.timeout, timedelta) else None
    pg = ProcessGroupTwisternet(ctx, group_rank, global_ranks, _stream_of(global_ranks, ctx.world,
                                                                          str(opts.group_id)),
                                _via(backend_options), timeout)
    log.debug("twisternet process group %s: rank %d of %d (global ranks %s)", opts.group_id, group_rank,
              group_size, global_ranks)
    return pg


def register() -> None:
    """Register the "twisternet" backend with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])


def _outward_address() -> str | None:
    """This host's address on the route to the twisternet master (``TWISTERNET_MASTER``), which the other
    hosts of the job reach it by; None when there is no master address (then the hostname is used).
    A host name need not resolve on the other hosts (containers, the emulated cluster)."""
    import socket
    master = os.environ.get("TWISTERNET_MASTER", "")
    host, _, port = master.rpartition(":")
    if not host:
        return None
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port or 1)))       # UDP: picks the route, sends nothing
            return str(s.getsockname()[0])
    except (OSError, ValueError):
        return None


def init_process_group(backend: str = BACKEND_NAME, *, via: str | None = None, timeout: float | None = None,
                       **kwargs: Any) -> Any:
    """``torch.distributed.init_process_group`` for any launcher ``tn.init()`` knows: under torchrun (or
    with torch's env:// variables set) it is the plain call; under ``twisternet run`` or mpiexec the
    Context comes first and rank 0 hosts torch's TCPStore on a free port it tells the others. Returns
    the Context. ``via`` sets the allreduce algorithm of the twisternet backend."""
    global _default_via
    if via is not None:
        _default_via = _via({"via": via})
    td = timedelta(seconds=timeout) if timeout is not None else None
    if td is not None:
        kwargs.setdefault("timeout", td)
    if all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        dist.init_process_group(backend, **kwargs)
        return _context(None, dist.get_world_size()) if backend == BACKEND_NAME else None
    import socket

    import twisternet as tn
    global _owned_ctx
    try:
        ctx = F.current_context()
    except TwisternetError:
        with _ctx_lock:
            ctx = _owned_ctx = tn.init()
        atexit.register(_close_owned)
    port = None
    if ctx.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    here = socket.gethostname()
    host0, addr0, port = F.broadcast((here, _outward_address(), port) if ctx.rank == 0 else None, src=0, ctx=ctx)
    host = "127.0.0.1" if host0 == here else (addr0 or host0)
    store = dist.TCPStore(host, port, ctx.world, ctx.rank == 0, timeout=td or timedelta(seconds=300))
    dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.world, **kwargs)
    return ctx
