"""Which allreduce algorithm a call uses ("auto"), from the value, the operation's ranks and their hosts.

The table, measured on the emulated cluster (docs/topology.md):

========================================  ==========================================================
ranks of the operation                    "auto" picks
========================================  ==========================================================
one rank                                  nothing to do (a copy)
all on one host, not the local channel    ``shm`` (one segment; falls back once if it cannot be mapped)
on several hosts, numpy array, named op   ``hier``: reduce inside each host (shared memory, else local
                                          sockets) to its leader; between leaders a ring for
                                          ``nbytes >= 2 * ring_threshold`` (and at least one element
                                          per host), recursive doubling below; broadcast inside each host
one host without shared memory, or hosts   numpy array, named op: ``ring`` for ``nbytes >=
unknown (sockets, MPI messages, threads)  ring_threshold``, ``doubling`` below (recursive doubling:
                                          ``log2 n`` rounds of one message each way per rank, where
                                          the tree waits for a round trip through its root; 1 KB over
                                          Unix sockets, docs/performance.md)
other values (objects, callables)         ``tree``
========================================  ==========================================================

Every rank decides from what all ranks share (via, the topology, its value's size, the thresholds),
so all ranks of a call pick the same algorithm when their values agree; when they do not, the
records of another algorithm raise MismatchError (see ``rank.RankAllReduce._start``).
"""

from __future__ import annotations

from twisternet.topology import Topology

#: The leaders of the hierarchical algorithm use recursive doubling (log2 H exchanges of the whole array)
#: below this many times ``ring_threshold`` bytes, the rings (2 (H-1) steps of 1/H of it) from it.
LEADER_RING_FACTOR = 2

__all__ = ["choose", "leader_algorithm"]


def choose(via: str, *, nranks: int, array_ok: bool, ring_ok: bool, nbytes: int, ring_threshold: int,
           topology: Topology | None, shm_offered: bool) -> str:
    """The algorithm of one call: "one", "shm", "hier", "ring", "doubling" or "tree".

    ``array_ok``: a non-empty numpy array of numbers with a named reduction; ``ring_ok``: that and at
    least one element per rank; ``shm_offered``: the shared-memory path may be tried (or is set up).
    A forced ``via`` ("tree", "ring", "doubling", "shm", "hier") is returned as it is (the caller checks it
    fits). Where "shm" cannot be set up the caller falls back to what sockets would take: "ring" from
    ``ring_threshold`` bytes, "doubling" below.
    """
    if nranks <= 1:
        return "one"
    if via != "auto":
        return via
    if topology is not None and topology.nhosts > 1:
        return "hier" if array_ok else "tree"
    if array_ok and shm_offered:
        return "shm"
    if ring_ok and nbytes >= ring_threshold:
        return "ring"
    if array_ok:
        return "doubling"
    return "tree"


def leader_algorithm(nbytes: int, size: int, nhosts: int, ring_threshold: int) -> str:
    """Between the host leaders of a hierarchical call: "ring", "doubling", or "none" (one host).

    The rings from ``LEADER_RING_FACTOR * ring_threshold`` bytes (2 MB by default): on the 4 x 2 emulated
    cluster doubling beat the rings by ~40 % at 256 KB and 1 MB and lost by half at 4 MB
    (docs/topology.md)."""
    if nhosts <= 1:
        return "none"
    if nbytes >= LEADER_RING_FACTOR * ring_threshold and size >= nhosts:
        return "ring"
    return "doubling"
