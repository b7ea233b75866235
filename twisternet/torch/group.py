"""The torch ``ProcessGroup`` of the twisternet backend: each torch.distributed collective of one group
carried out through the functional layer (:mod:`twisternet.functional`) on the group's edge stream."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from twisternet import functional as F

from .p2p import _PointToPoint
from .tensors import TorchBackendError, _check_tensor, _copy_into, _op_name, _split, _view
from .work import _chain, _failed_work, _work

if TYPE_CHECKING:
    from twisternet.context import Context

log = logging.getLogger(__name__)

BACKEND_NAME = "twisternet"


class ProcessGroupTwisternet(dist.ProcessGroup):
    """One torch process group: ``global_ranks`` (twisternet ranks) in group-rank order."""

    def __init__(self, ctx: Context, group_rank: int, global_ranks: list[int], stream: int, via: str,
                 timeout: float | None) -> None:
        super().__init__(group_rank, len(global_ranks))
        self.ctx = ctx
        self.global_ranks = list(global_ranks)
        self.via = via
        self.timeout = timeout
        self.state = F._State(ctx, stream, self.global_ranks)
        self._p2p = _PointToPoint(ctx, self.state, self.global_ranks)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:  # torch's name
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
