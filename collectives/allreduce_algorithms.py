"""Compatibility name of :mod:`collectives.allreduce` (the algorithms moved into that package)."""

from .allreduce import VIAS, RankAllReduce, describe_value, merge_groups, mismatch_error  # noqa: F401
from .allreduce.mismatch import _human  # noqa: F401
from .allreduce.ring import _RingCall  # noqa: F401

__all__ = ["RankAllReduce", "VIAS", "describe_value", "merge_groups", "mismatch_error"]
