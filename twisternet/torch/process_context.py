"""The process's twisternet Context as the torch backend finds it: the open one of ``tn.init()``, else
one the backend makes (and closes at exit)."""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading
from typing import TYPE_CHECKING, Any

from twisternet import functional as F
from twisternet.errors import TwisternetError

if TYPE_CHECKING:
    from twisternet.context import Context

log = logging.getLogger(__name__)

_ctx_lock = threading.Lock()
_owned_ctx: Context | None = None


def _context(store: Any = None) -> Context:
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
        except Exception:  # at exit, best effort
            log.debug("closing the twisternet Context failed", exc_info=True)

