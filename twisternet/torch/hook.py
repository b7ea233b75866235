"""``allreduce_hook``: a DDP communication hook that averages each gradient bucket through twisternet.

Use it on a model whose process group is another backend (gloo)::

    ddp = DistributedDataParallel(model)                  # process group: gloo
    ddp.register_comm_hook(state=None, hook=twisternet.torch.allreduce_hook)

The hook needs a twisternet Context on every rank of the group (``tn.init()``, or the one the backend
made); ``state`` may be None (the Context's whole job) or a dict ``{"via": "innet", "ctx": ctx}``.
Buckets are averaged in place ("avg": the sum over ranks divided by their number, like DDP's default
hook), non-blocking: the returned future completes on the Context's collective stream.
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations as objects
from typing import Any

import torch
import torch.distributed as dist

from twisternet import functional as F


def allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP ``register_comm_hook`` hook: average ``bucket.buffer()`` over the ranks, in place."""
    opts = state if isinstance(state, dict) else {}
    ctx = F.current_context(opts.get("ctx"))
    buf = bucket.buffer()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    h = F.all_reduce(buf, "avg", out=buf, async_op=True, via=opts.get("via", "auto"), ctx=ctx)

    def done(f: Any) -> None:
        err = f.exception()
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(buf)
    h.get_future().add_done_callback(done)
    return fut
