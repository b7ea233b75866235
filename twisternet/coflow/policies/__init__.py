"""Built-in coflow scheduling policies; importing this package registers them by name."""

from __future__ import annotations

from ..scheduler import register_policy
from .dag import DagScheduler, solve_lat_lp
from .deadline import DeadlineScheduler
from .fair import FairScheduler, fair_share
from .fifo import FifoScheduler
from .sebf import SebfScheduler, StarvationWindows

__all__ = ["FifoScheduler", "FairScheduler", "SebfScheduler", "DeadlineScheduler", "DagScheduler",
           "StarvationWindows", "fair_share", "solve_lat_lp", "BUILTIN_POLICIES"]

BUILTIN_POLICIES = {
    "fifo": FifoScheduler,
    "fair": FairScheduler,
    "sebf": SebfScheduler,
    "deadline": DeadlineScheduler,
    "dag": DagScheduler,
}

for _name, _cls in BUILTIN_POLICIES.items():
    register_policy(_name, _cls, replace=True)
