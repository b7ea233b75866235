"""``init``: build a Context from the configuration and the environment the process was launched in."""

from __future__ import annotations

import logging
from typing import Any

from .channel import channel_factory
from .config import Config, load_config
from .context import Context
from .task_plan import TaskPlan

log = logging.getLogger(__name__)


def _pick_channel(cfg: Config) -> str:
    if cfg.channel != "auto":
        return cfg.channel
    if cfg.master is not None:
        return "tcp"
    from channels.mpi_detect import under_mpi_launcher
    if under_mpi_launcher():
        return "mpi"
    return "local"


def init(config: Config | None = None, *, plan: TaskPlan | dict[int, int] | None = None,
         comm: Any = None, **overrides: Any) -> Context:
    """Join the job this process belongs to and return its Context.

    The channel comes from ``channel=`` / ``TWISTERNET_CHANNEL``, else from how the process was started:
    ``twisternet run``/``twisternet worker`` (TCP, via ``TWISTERNET_MASTER``), ``mpirun``/``mpiexec``
    (MPI), or neither (a one-process job). ``plan`` maps task ids to ranks (default: task i on rank i);
    ``comm`` is an mpi4py communicator to use instead of ``COMM_WORLD``. Other keyword arguments are
    configuration keys (see :class:`twisternet.config.Config`).
    """
    cfg = config.replace(**{k: v for k, v in overrides.items() if v is not None}) if config is not None \
        else load_config(**overrides)
    if cfg.log_level:
        for name in ("twisternet", "channels", "collectives", "innet"):
            logging.getLogger(name).setLevel(cfg.log_level.upper())
    name = _pick_channel(cfg)
    factory = channel_factory(name)
    kwargs: dict[str, Any] = {}
    if name == "mpi" and comm is not None:
        kwargs["comm"] = comm
    channel = factory(cfg, **kwargs)
    if isinstance(plan, dict):
        plan = TaskPlan(channel.world, plan)
    ctx = Context(channel, cfg, plan, on_close=getattr(channel, "on_context_close", None))
    log.debug("rank %d of %d on the %s channel", ctx.rank, ctx.world, name)
    return ctx
