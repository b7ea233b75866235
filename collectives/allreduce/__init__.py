"""``AllReduce.allreduce``: the algorithms (tree, ring, shared memory, hierarchical) and their selection.

* :mod:`.rank` — :class:`RankAllReduce`, one operation's calls: checks, choice, record plumbing;
* :mod:`.select` — which algorithm "auto" picks per size and topology;
* :mod:`.tree`, :mod:`.ring`, :mod:`.shm`, :mod:`.hierarchical` — the algorithms;
* :mod:`.mismatch` — what every rank's value must agree on, and the error when it does not.

The in-network path stays in ``collectives.innet_allreduce``.
"""

from .mismatch import describe_value, merge_groups, mismatch_error
from .rank import VIAS, RankAllReduce

__all__ = ["RankAllReduce", "VIAS", "describe_value", "merge_groups", "mismatch_error"]
