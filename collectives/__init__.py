"""Dataflow collectives in the style of Twister:Net: Reduce, AllReduce, Gather, AllGather, Partition,
Broadcast, KeyedReduce, KeyedGather, KeyedPartition and Join, each in streaming or batch mode, and
partial barriers bound to a job.

Generic form::

    op = Op(ctx, sources, destinations, edge, ..., mode="streaming" | "batch", callback=None)
    op.send(task, ...)          # from a local source task; blocks (while progressing) under back pressure
    op.offer(task, ...)         # the same, but returns False instead of blocking
    op.finish(task)             # end of that source's stream (required in batch mode)
    op.results(task)            # iterator over what local destination ``task`` receives
    op.close()                  # or use the operation as a context manager

Each concurrent operation needs its own user ``edge`` (see :mod:`collectives.edges`). What a destination
receives from each operation in each mode and in what order, the routing trees, the allreduce
algorithms, reductions, spilling and barriers: docs/collectives.md.
"""

from .allreduce import VIAS
from .base import Callback, Mode, Operation
from .broadcast import Broadcast
from .edges import EDGE_SPAN, MAX_USER_EDGE, channel_edge
from .gather import AllGather, Gather, KeyedGather
from .join import Join
from .keyed_reduce import KeyedReduce
from .partition import KeyedPartition, Partition
from .reduce import AllReduce, Reduce
from .reduction import Reduction
from .routing import KaryTree, hash_selector, stable_hash
from .spill import SpillCorruptionError, SpillStore

# Job-bound barriers (their coordinator runs on the bootstrap master or rank 0); the pure state
# machines stay in collectives.barrier (e.g. collectives.barrier.PartialBarrierMachine takes no Context).
from .barrier import CatchUp, LATE_FIRE, FIRE
from .barrier.distributed import Barrier, PartialBarrier, SemaphoreBarrier

__all__ = [
    "Operation", "Mode", "Callback", "Reduce", "AllReduce", "Gather", "AllGather", "Broadcast", "Partition",
    "KeyedPartition", "KeyedReduce", "KeyedGather", "Join", "Reduction", "KaryTree", "hash_selector", "stable_hash",
    "SpillStore", "SpillCorruptionError", "EDGE_SPAN", "MAX_USER_EDGE", "channel_edge", "VIAS",
    "Barrier", "PartialBarrier", "SemaphoreBarrier", "CatchUp", "LATE_FIRE", "FIRE",
]
