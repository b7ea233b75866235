"""Dataflow collectives in the style of Twister:Net: Reduce, AllReduce, Gather, AllGather, Partition,
Broadcast, KeyedReduce, KeyedGather and KeyedPartition, each in streaming or batch mode.

Generic form::

    op = Op(ctx, sources, destinations, edge, ..., mode="streaming" | "batch", callback=None)
    op.send(task, ...)          # from a local source task; blocks (while progressing) under back pressure
    op.offer(task, ...)         # the same, but returns False instead of blocking
    op.finish(task)             # end of that source's stream (required in batch mode)
    op.results(task)            # iterator over what local destination ``task`` receives
    op.close()                  # or use the operation as a context manager

``sources``/``destinations`` are task ids of ``ctx.plan`` (default: every task; the single destination of
Reduce and Gather and the single source of Broadcast default to the first task); they may be disjoint, and
several tasks of one process share one operation object. With ``callback(dest_task, item)`` the items go to
the callback (on the progress thread, or on the thread whose call produced them; it must not block or call
``send``) instead of ``results()``. Each concurrent operation needs its own user ``edge``; an operation on
edge ``e`` uses channel edges ``[64 e, 64 e + 64)`` (see :mod:`collectives.edges`). Every blocking call takes
``timeout`` (default ``config.timeout``) and raises :class:`~twisternet.errors.BackPressureTimeout` (a send)
or :class:`~twisternet.errors.OperationTimeout` naming the edge, the operation and the sources that never
called ``finish``. ``limit`` (default ``config.receive_pending_limit``) caps the records an operation holds
per queue in a process; past it the operation refuses input and back pressure reaches the senders. So in
streaming mode a thread that is both a source and a destination must consume as it sends (``drain()``, a
callback, or another thread): results nobody reads eventually stop the sources. ``close()`` first waits until
this process has passed on what other ranks depend on (it may be an inner tree node); ``abort()`` stops at
once.

What a destination receives (``item`` as yielded by ``results()`` / passed to the callback):

=================  ==========================================  ============================================
Operation          batch (after every source finished)          streaming (as results form; ends when every
                                                                source finished)
=================  ==========================================  ============================================
Reduce             one value: the reduction of every value     round ``i`` = reduction of the ``i``-th value
                   sent (``result()``; None if none was sent)  of every source that sent ``> i`` values, in
                                                               round order; a round forms once every
                                                               unfinished source sent its ``i``-th value
AllReduce          as Reduce, at every destination             as Reduce, at every destination (same order)
Gather             ``(source, value)`` ordered by source task,  ``(source, value)`` as they arrive; send
                   then send order                             order per source, none between sources
AllGather          as Gather, at every destination             as they reach the root; every destination
                                                               sees the same order
Broadcast          every value of the one source, in order     every value, in send order
Partition          ``(source, value)`` sent to this            ``(source, value)`` as they arrive; send
                   destination, by source then send order      order per source
KeyedPartition     ``(key, value)`` sent to this destination,  ``(key, value)`` as they arrive; send order
                   by source then send order                   per source
KeyedReduce        ``(key, reduced value)``, each of this      ``(key, running reduction)`` after every
                   destination's keys once, keys ascending     value for the key that reaches it
KeyedGather        ``(key, [values])`` (``group=False``:        ``(key, value)`` as they arrive; send order
                   ``(key, value)``), keys ascending, values   per source
                   by source then send order
=================  ==========================================  ============================================

Routing: Reduce/Gather (and the up half of AllReduce/AllGather) flow up a k-ary tree (``fanout``,
default 2) over the source ranks and the root, with a partial reduce (batch: one combined value per
subtree; streaming: per round) or forwarding at each inner node. Keyed operations build one tree per
destination and route each record by its key: the default selector is a stable hash
(:func:`~collectives.routing.hash_selector`, identical in every process), a
``selector(key, destinations) -> destination`` may replace it. Broadcast and the down half of
AllReduce/AllGather flow down a k-ary tree; Partition is direct. ``AllReduce.allreduce(array)`` is a
rank-level one-shot allreduce, chunked and pipelined over the tree, or a reduce-scatter + allgather
ring for large arrays, or, when all its ranks share a host, through a shared-memory segment
(``collectives.allreduce.shm``; "auto" picks it for numpy arrays with a named reduction; ``via="auto" |
"shm" | "tree" | "ring" | "hier"``; every rank gets bit-identical results), or, when its ranks span
several hosts, hierarchically: inside each host, then between one leader per host
(``collectives.allreduce.hierarchical``, docs/topology.md), or, with ``via="innet"``, float sums aggregated
in the network by an ATP software switch and parameter server that the operation starts for itself
(``collectives.innet_allreduce``; exact within the quantization bound of ``innet.quantize``).

Reductions: ``"sum"``, ``"max"``, ``"min"``, ``"prod"`` (numpy arrays combined in place) or any
associative and commutative callable. A callable never travels: every process builds the operation
with its own copy, so it must be the same function everywhere.

Batch Gather, AllGather, KeyedGather, Partition and KeyedPartition keep at most ``config.memory_limit``
bytes of records per operation in a process and spill sorted, checksummed runs to
``config.spill_dir`` past it, merged back k-way when results are read; the files are removed once every
local destination has read its results, on ``close()``/``abort()`` (a ``with`` block that exits on an
error aborts), and at the latest when the operation is garbage collected.
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
# machines stay in collectives.barrier (e.g. collectives.barrier.PartialBarrier takes no Context).
from .barrier import CatchUp, LATE_FIRE, FIRE
from .barrier.distributed import Barrier, PartialBarrier, SemaphoreBarrier

__all__ = [
    "Operation", "Mode", "Callback", "Reduce", "AllReduce", "Gather", "AllGather", "Broadcast", "Partition",
    "KeyedPartition", "KeyedReduce", "KeyedGather", "Join", "Reduction", "KaryTree", "hash_selector", "stable_hash",
    "SpillStore", "SpillCorruptionError", "EDGE_SPAN", "MAX_USER_EDGE", "channel_edge", "VIAS",
    "Barrier", "PartialBarrier", "SemaphoreBarrier", "CatchUp", "LATE_FIRE", "FIRE",
]
