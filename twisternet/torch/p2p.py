"""send/recv of a process group: records ``(tag, [arrays])`` on a channel edge of the group's own,
queued per (source, tag) until a recv takes them."""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from twisternet.errors import OperationTimeout

from .tensors import TorchBackendError, _copy_into
from .work import _work

if TYPE_CHECKING:
    from twisternet.context import Context
    from twisternet.functional import _State


class _PointToPoint:
    """send/recv of a group on one channel edge of its own: records ``(tag, [arrays])`` queued per
    (source, tag) until a recv takes them."""

    def __init__(self, ctx: Context, state: _State, global_ranks: list[int]) -> None:
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

