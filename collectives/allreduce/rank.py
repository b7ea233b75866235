"""Rank-level ``AllReduce.allreduce(value)``: the call, its checks and the choice of algorithm
(:mod:`.select`), and the record plumbing the algorithms share (:mod:`.tree`, :mod:`.ring`, :mod:`.shm`,
:mod:`.hierarchical`, and ``collectives.innet_allreduce``).

* **tree** (any value, any reduction): values flow up the operation's k-ary tree over its ranks, each
  inner node combining its children's chunk ``j`` with its own before passing it on, and the result
  flows back down. Arrays with a named reduction are cut into ``chunk_bytes`` pieces, so levels work
  on different chunks at once (pipelining) and no message is larger than a chunk.
* **ring** (numpy arrays, named reduction): reduce-scatter then allgather around the ranks in order,
  ``2 (n - 1)`` steps each moving ``1/n`` of the array per rank, chunked: every link carries about
  ``2 (n-1)/n`` of the array, so the time approaches the array size over the link bandwidth instead of
  funnelling everything through a root.
* **doubling** (numpy arrays, named reduction): recursive doubling over the ranks, ``log2 n`` rounds
  (two more for a non-power-of-two ``n``) in which each rank swaps its whole partial result with a
  partner (:mod:`.doubling`); "auto" takes it over sockets below ``ring_threshold``: at 2 ranks one
  message each way at once instead of the tree's round trip through its root.
* **shm** (numpy arrays, named reduction, every rank on one host): through a shared-memory segment
  (:mod:`.shm`), one copy in and one out per rank and no message per chunk; "auto"
  uses it whenever every rank could map the first rank's segment, from the first such call on.
* **hier** (numpy arrays, named reduction, ranks on several hosts): inside each host to its leader,
  between the leaders (ring or recursive doubling), back inside each host (:mod:`.hierarchical`).
* **innet**: float sums aggregated by an ATP software switch and parameter server that the first
  rank starts for the operation (``collectives.innet_allreduce``).

Records (edges ``AR_UP``, ``AR_DOWN``, ``RING``) are ``(kind, call, step, chunk, payload[, groups])``
(kinds: ``u``/``w`` tree, ``r`` ring, ``d`` doubling, ``s`` shm, upper case hierarchical);
``call`` counts the ``allreduce`` calls of this operation, so consecutive calls never mix. With a named
reduction, the first record a rank sends in a call (tree: chunk 0 up; ring: step 0 chunk 0; doubling:
every record, see :mod:`.doubling`) also
carries ``groups``, ``{descriptor: [ranks]}`` of the values it covers (descriptor: dtype string with
byte order, and shape, of an array; "-" for anything else), so a rank that receives it compares the
values of its subtree or of its left neighbour with its own at no extra message. On a difference it
raises :class:`~twisternet.errors.MismatchError` naming the ranks, and the operation's ``ABORT`` edge
carries the error to every other rank (see ``Operation._fail``); so does any error of the reduction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from twisternet.errors import (
    ConfigError,
)

from ..edges import AR_DOWN, AR_UP, RING
from ..reduction import own, snapshot
from ..routing import KaryTree
from .hierarchical import HierarchicalPath
from .plumbing import _compatible  # re-exported for tests
from .ring import _RingCall
from .select import choose
from .tree import TreePath

if TYPE_CHECKING:
    from twisternet.topology import Topology

    from ..reduce import AllReduce

VIAS = ("auto", "tree", "ring", "doubling", "shm", "hier", "innet")


class RankAllReduce(TreePath, HierarchicalPath):
    """Carries out ``allreduce`` calls for one AllReduce operation.

    One call at a time per process; every participating rank makes the same sequence of calls, with
    arrays of the same shape and dtype (with a named reduction a difference raises MismatchError on
    every rank, see the module docstring).
    """

    def __init__(self, op: AllReduce) -> None:
        self.op = op
        self.ranks = sorted(set(op.source_ranks) | set(op.destination_ranks))
        self.same_ranks = set(op.source_ranks) == set(op.destination_ranks)
        self.tree = KaryTree(self.ranks[0], self.ranks, op.fanout)
        self.stash: dict[tuple, Any] = {}
        self.groups: dict[tuple, Any] = {}    # (kind, call, src) -> the groups its first record carried
        self.calls = 0
        self.ring: _RingCall | None = None   # the ring call in progress (its records skip the stash)
        self.innet: Any = None               # the in-network path, set up on the first via="innet" call
        self.shm: Any = None                 # the shared-memory path, once set up (see _shm_path)
        self.shm_tried = False
        self.shm_machine: bool | None = None  # whether this machine offers the path at all (probed once)
        self.deferred: tuple[int, BaseException] | None = None   # another rank's failure in a later call
        self.current: tuple[int, str] | None = None   # (call, algorithm) of the call in progress
        self.mine_desc = "-"                          # describe_value of this rank's value in that call
        self.hier: Any = None                # the hierarchical path's per-host state (see hierarchical.py)
        self.topo: Topology | None = None    # which of the ranks share a host, once known (see _topology)
        for offset in (AR_UP, AR_DOWN, RING):
            op._add_handler(offset, self._on_record)
        # the operation's hook for failures of later calls
        op._defer_failures_to(self._defer_failure)

    def _defer_failure(self, call: int, err: BaseException) -> bool:
        """A failure of call ``call`` on another rank: kept until this rank makes that call (under the op lock)."""
        if call < self.calls:
            return False
        if self.deferred is None or call < self.deferred[0]:
            self.deferred = (call, err)
        return True

    def _on_record(self, src: int, msg: Any) -> bool:
        try:
            if len(msg) == 6:
                kind, call, step, chunk, payload, groups = msg
                self.groups[(kind, call, src)] = groups
            else:
                kind, call, step, chunk, payload = msg
        except (TypeError, ValueError):
            raise self.op._protocol(src, msg) from None
        cur = self.current
        if cur is not None and call == cur[0] and not _compatible(kind, cur[1]):
            raise self._path_error(call, cur[1], kind, src)
        rc = self.ring
        if rc is not None and kind == rc.kind and call == rc.call:
            self._apply(rc, step, chunk, payload, src)
        else:
            self.stash[(kind, call, step, chunk, src)] = own(payload)
        self.op._mark_changed()
        return True

    # ------------------------------------------------------------------ entry
    def run(self, value: Any, timeout: float | None, out: np.ndarray | None = None) -> Any:
        op = self.op
        t = op.timeout if timeout is None else timeout
        if out is not None:
            if not isinstance(value, np.ndarray) or not isinstance(out, np.ndarray):
                raise TypeError("allreduce(out=...) needs a numpy array value and a numpy array out")
            if out.shape != value.shape or out.dtype != value.dtype:
                raise ValueError(f"allreduce(out=...): out is {out.dtype}{list(out.shape)}, the value is "
                                 f"{value.dtype}{list(value.shape)}; they must match")
            flags = out.flags
            if not flags.c_contiguous or not flags.writeable:
                raise ValueError("allreduce(out=...): out must be a writeable C-contiguous array")
            if out is not value and np.shares_memory(out, value):
                raise ValueError("allreduce(out=...): out overlaps the value without being the same array")
        result = self._run(value, t, out)
        if out is not None and result is not out:
            out[...] = result
            return out
        return result

    def _run(self, value: Any, t: float, out: np.ndarray | None) -> Any:
        op = self.op
        if not self.same_ranks:
            raise ConfigError("destinations", "allreduce() needs sources and destinations on the same ranks "
                                              f"(sources on {op.source_ranks}, destinations on {op.destination_ranks})")
        if op.rank not in self.ranks:
            raise ValueError(f"rank {op.rank} runs no task of {op.describe()} (edge {op.edge}); "
                             f"allreduce() is called by ranks {self.ranks}")
        op._raise_if_failed()
        if op.via == "innet":
            return self._innet(value, t)
        call = self.calls
        self.calls += 1
        with op._state_lock():
            deferred = self.deferred if self.deferred is not None and self.deferred[0] <= call else None
        if deferred is not None:
            op._fail_everywhere(deferred[1], f"on another rank in allreduce() call {deferred[0]}")
        op._raise_if_failed()
        n = len(self.ranks)
        is_array = isinstance(value, np.ndarray)
        named = op.reduction.named
        ring_ok = is_array and named and n > 1 and value.size >= n
        if op.via == "ring" and n > 1 and not ring_ok:
            raise ConfigError("via", "via='ring' needs a numpy array (at least one element per rank) and a "
                                     "named reduction (sum, prod, max, min)")
        shm_ok = is_array and named and n > 1 and value.size >= 1 and not value.dtype.hasobject
        if self.shm is not None and not shm_ok and n > 1:
            # the other ranks may be in a shared-memory round: join it with "no array", so that a
            # mismatch raises on every rank at once (if all passed such values, go on below)
            self.shm.announce_other(t)
        if op.via == "doubling" and n > 1 and not shm_ok:   # told to every rank: they wait for its records
            raise self._failed(ConfigError("via", "via='doubling' needs a non-empty numpy array of numbers and a "
                                                  "named reduction (sum, prod, max, min)"),
                               f"in allreduce() call {call}", call)
        if op.via == "shm" and n > 1 and not shm_ok:
            raise ConfigError("via", "via='shm' needs a non-empty numpy array of numbers and a named reduction "
                                     "(sum, prod, max, min)")
        if n == 1:
            return snapshot(value)
        if op.via in ("auto", "hier"):
            topo = self._topology(call, t)
            algo = choose(op.via, nranks=n, array_ok=shm_ok, ring_ok=ring_ok, nbytes=value.nbytes if is_array else 0,
                          ring_threshold=op.ring_threshold, topology=topo,
                          shm_offered=op.via == "auto" and shm_ok and self._auto_shm())
        else:
            topo, algo = None, op.via          # (what choose() returns for a forced algorithm)
        if algo == "hier":
            if not shm_ok:   # told to every rank: the others would wait for this one's records
                raise self._failed(ConfigError("via", "via='hier' needs a non-empty numpy array of numbers and "
                                                      "a named reduction (sum, prod, max, min)"),
                                   f"in allreduce() call {call}", call)
            assert topo is not None
            return self._hier(value, call, t, out, topo)
        if shm_ok and algo == "shm":
            # set-up first: where a rank cannot map the segment, every rank falls back in this same call,
            # and a rank that learns it first may send ring/tree records for it before this one has
            shm = self._shm_path(call, t)
            if shm is not None:
                self._start(call, "shm", value)
                return shm.run(value, t, out)
        if ring_ok and (algo == "ring" or (algo == "shm" and value.nbytes >= op.ring_threshold)):
            self._start(call, "ring", value)
            return self._ring(value, call, t, out, cross_host=None if topo is None else topo.nhosts > 1)
        if shm_ok and (algo == "doubling" or (algo == "shm" and op.via == "auto")):
            self._start(call, "doubling", value)
            return self._flat_doubling(value, call, t, out)
        self._start(call, "tree", value)
        return self._tree(value, call, t)

    # ------------------------------------------------------------------ in-network (hook)
    def _innet(self, value: Any, timeout: float) -> Any:
        """``via="innet"``: float sums through an ATP software switch (see collectives.innet_allreduce)."""
        if self.innet is None:
            from ..innet_allreduce import InnetAllReduce
            self.innet = InnetAllReduce(self)
        return self.innet.run(value, timeout)

    # ------------------------------------------------------------------ shared memory
    def _auto_shm(self) -> bool:
        """"auto" tries shared memory once per operation, where it can work at all (not between the
        threads of the local test channel, which share memory anyway)."""
        if self.shm is not None:
            return True
        return not self.shm_tried and self.op.ctx.channel.spans_processes and self._shm_machine()

    def _shm_machine(self) -> bool:
        """:func:`.shm.supported`, asked once per operation: its answer does not change, and an operation
        that never sets the path up (ranks on several hosts) would otherwise ask on every call (a stat of
        /dev/shm, 1.75 us)."""
        if self.shm_machine is None:
            from .shm import supported
            self.shm_machine = supported()
        return self.shm_machine

    def _shm_path(self, call: int, t: float) -> Any:
        """The shared-memory state, setting it up (collectively, in this call) the first time."""
        if not self.shm_tried:
            from .shm import ShmAllReduce
            self.shm_tried = True
            if self._shm_machine():
                self.shm = ShmAllReduce.setup(self, call, self.op.shm_chunk_bytes, t)
        if self.shm is None and self.op.via == "shm":
            raise ConfigError("via", "via='shm': the ranks of this operation cannot share memory (not all on "
                                     "one host, no /dev/shm, or not an x86-64 machine); use 'auto'")
        return self.shm

    def tree_sum(self, value: Any, timeout: float) -> Any:
        """``value`` reduced over the ranks by the tree path, as the operation's next call (so a
        rendezvous of the ranks too): for helpers that exchange their set-up through the operation."""
        return self._tree(value, self.next_call(), timeout)

    def next_call(self) -> int:
        """A fresh call number (every rank draws them in the same order)."""
        call = self.calls
        self.calls += 1
        return call

    def close(self) -> None:
        """Release what a call set up (the in-network job's sockets, switch and PS)."""
        if self.innet is not None:
            self.innet.close()
            self.innet = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    # ------------------------------------------------------------------ tree
