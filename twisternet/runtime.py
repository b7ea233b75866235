"""``init``: build a Context from the configuration and the environment the process was launched in."""

from __future__ import annotations

import logging
from typing import Any

from .channel import channel_factory
from .config import Config, load_config
from .context import Context
from .errors import LaunchEnvError
from .functional import set_current
from .launch_env import LaunchInfo, announced_world, detect
from .rendezvous import prepare
from .task_plan import TaskPlan

log = logging.getLogger(__name__)


def _pick_channel(cfg: Config, info: LaunchInfo) -> str:
    if cfg.channel != "auto":
        return cfg.channel
    if cfg.master is not None:
        return "tcp"
    if info.launcher == "mpi":
        return "mpi"
    return "local"


def init(config: Config | None = None, *, plan: TaskPlan | dict[int, int] | None = None,
         comm: Any = None, **overrides: Any) -> Context:
    """Join the job this process belongs to and return its Context.

    The channel comes from ``channel=`` / ``TWISTERNET_CHANNEL``, else from how the process was started:
    ``twisternet run``/``twisternet worker`` (TCP, via ``TWISTERNET_MASTER``), ``mpirun``/``mpiexec``/ ``srun
    --mpi=...`` (MPI), torchrun, ``srun`` without MPI, a Kubernetes indexed Job (TCP, rank 0 hosts the
    bootstrap master: :mod:`twisternet.rendezvous`), or none of them (a one-process job). A launcher that
    announced several processes while this one would end up alone is an error. ``plan`` maps task ids to ranks
    (default: task i on rank i); ``comm`` is an mpi4py communicator to use instead of ``COMM_WORLD``. Other
    keyword arguments are configuration keys (see :class:`twisternet.config.Config`).
    """
    cfg = config.replace(**{k: v for k, v in overrides.items() if v is not None}) if config is not None \
        else load_config(**overrides)
    if cfg.log_level:
        for name in ("twisternet", "channels", "collectives", "innet"):
            logging.getLogger(name).setLevel(cfg.log_level.upper())
    info = detect()
    finish = None
    if cfg.master is None and comm is None:
        cfg, finish = prepare(cfg, info)
    name = _pick_channel(cfg, info)
    factory = channel_factory(name)
    kwargs: dict[str, Any] = {}
    if name == "mpi" and comm is not None:
        kwargs["comm"] = comm
    try:
        channel = factory(cfg, **kwargs)
    except BaseException:
        if finish is not None:
            finish()
        raise
    announced = announced_world()
    if channel.world == 1 and announced is not None and comm is None:
        channel.close(0.5)
        if finish is not None:
            finish()
        var, n = announced
        raise LaunchEnvError(var, f"the launcher started {n} processes ({var}={n}) but this one joined a "
                             f"job of 1 on the {name!r} channel: each process would compute alone. Start it "
                             "the way twisternet.init recognises (see twisternet.launch_env) or remove the "
                             "variable")
    if isinstance(plan, dict):
        plan = TaskPlan(channel.world, plan)
    ctx = Context(channel, cfg, plan, on_close=finish)
    set_current(ctx)      # the Context tn.all_reduce & co. use by default
    log.debug("rank %d of %d on the %s channel", ctx.rank, ctx.world, name)
    return ctx
