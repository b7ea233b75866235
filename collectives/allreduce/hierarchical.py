"""Hierarchical allreduce for ranks on several hosts (``via="hier"``; "auto" picks it, see select.py).

Three phases per call, so that each host's link carries one array's worth of the leaders' algorithm
instead of one per rank:

1. **inside each host** every rank's array is reduced to the host's *leader* (its lowest rank): through
   a shared-memory segment of the host's ranks (:class:`.shm.ShmAllReduce` over that group, set up on
   the first such call, records ``S``), or, where it cannot be mapped, over local sockets (records
   ``U`` on ``AR_UP``: every member streams its chunks to the leader, which combines them in rank order);
2. **between the leaders**: the ring (reduce-scatter + allgather, records ``R``) for arrays of at least
   ``ring_threshold`` bytes, recursive doubling below (``log2 H`` exchanges of the whole array, records
   ``D``; a non-power-of-two H folds the extra leaders in first and out last; :mod:`.doubling`);
3. **inside each host** the leader's result goes to the others (shared memory again, or records ``W``).

Which ranks share a host comes from :mod:`twisternet.topology`: the task plan's hosts, the bootstrap
table of the TCP channel, or — under MPI — an exchange of :func:`twisternet.bootstrap.host_id` among
the operation's ranks on its first call (records ``t``).

Results: every rank gets the same array; with float sums it can differ in the last bits from the flat
ring's (another order of additions), integer sums are exact. Values that differ between ranks raise
MismatchError on every rank: inside a host from the shared-memory headers or the first ``U`` record,
between hosts from the first ring record or, with recursive doubling, after its rounds, which gather
every leader's dtype and shape (see doubling.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from twisternet.errors import MismatchError, ProtocolError
from twisternet.topology import Topology, from_channel

from ..edges import AR_DOWN, AR_UP
from .mismatch import describe_value
from .plumbing import HIER_KINDS  # noqa: F401  (the kinds of the module docstring)
from .doubling import DoublingPath
from .ring import RingPath
from .select import leader_algorithm

if TYPE_CHECKING:
    from .shm import ShmAllReduce

log = logging.getLogger(__name__)

#: The host segment's slots are this many times ``shm_chunk_bytes`` (4 MB by default): every slot is a
#: round with two waits for the host's other ranks, and on a busy machine each wait costs a time slice.
HOST_SLOT_FACTOR = 4


class HierarchicalPath(RingPath, DoublingPath):
    """Mixin of :class:`~collectives.allreduce.rank.RankAllReduce`: topology and the hierarchical path."""

    topo: Topology | None

    # ------------------------------------------------------------------ topology
    def _topology(self, call: int, t: float) -> Topology:
        """Which of the operation's ranks share a host (collective on the first call under MPI).

        What every rank knows alike comes first: the task plan's hosts (given with it, or read from
        the TCP bootstrap table), the channel's table, one process's threads. Otherwise the
        operation's ranks exchange host ids on its first call and the operation keeps the answer;
        it is not written into the plan, which other operations read: a rank that took part in
        some other operation's exchange would then know hosts that another rank does not, and the
        two would choose differently (one skipping an exchange the other waits in, or building
        another tree)."""
        if self.topo is not None:
            return self.topo
        op = self.op
        plan = op.ctx.plan
        topo = plan.topology(self.ranks)
        if topo is None:
            channel = op.ctx.channel
            hosts = from_channel(channel)
            if hosts is None and not channel.spans_processes:
                from twisternet.bootstrap import host_id
                hosts = {r: host_id() for r in range(plan.world)}   # threads of one process
            if hosts is not None:
                plan.set_hosts(hosts)       # (the same on every rank)
            else:
                hosts = self._exchange_hosts(call, t)
            topo = Topology({r: hosts[r] for r in self.ranks})
        log.debug("%s: hosts of its ranks: %s", op.describe(), topo.describe())
        self.topo = topo
        return topo

    def _exchange_hosts(self, call: int, t: float) -> dict[int, str]:
        """Every rank's host id, gathered by the first rank and sent back to all (records ``t``)."""
        from twisternet.bootstrap import host_id
        op = self.op
        root = self.ranks[0]
        if op.rank != root:
            self.send_record(root, AR_UP, ("t", call, 0, 0, host_id()), t)
            got = self.take_record(("t", call, 1, 0, root), t)
            if not isinstance(got, dict) or set(got) != set(self.ranks) \
                    or not all(isinstance(h, str) for h in got.values()):
                raise ProtocolError(f"{op.describe()}: rank {root} sent a malformed host table: {got!r:.200}")
            return {int(r): h for r, h in got.items()}
        hosts = {root: host_id()}
        for r in self.ranks[1:]:
            h = self.take_record(("t", call, 0, 0, r), t)
            if not isinstance(h, str):
                raise ProtocolError(f"{op.describe()}: rank {r} sent a host id that is not a string: {h!r:.100}")
            hosts[r] = h
        for r in self.ranks[1:]:
            self.send_record(r, AR_DOWN, ("t", call, 1, 0, hosts), t)
        return hosts

    # ------------------------------------------------------------------ one call
    def _hier(self, value: np.ndarray, call: int, t: float, out: np.ndarray | None, topo: Topology) -> np.ndarray:
        op = self.op
        me = op.rank
        group = topo.group(me)
        leader = group[0]
        leaders = topo.leaders
        src = np.ascontiguousarray(value).reshape(-1)
        flat_out = None if out is None else out.reshape(-1)   # one view: results land in it, never copied
        how = leader_algorithm(src.nbytes, src.size, len(leaders), op.ring_threshold)
        self._start(call, f"hier/{how}", value)
        local = self._host_shm(call, t, group) if len(group) > 1 else None
        if how == "ring" and self._multi_ring_ok(src, topo):
            return self._multi_ring(value, src, call, t, out, topo, local)
        # 1. inside the host, to the leader
        if len(group) == 1:
            partial: np.ndarray | None = src
        elif local is not None:
            try:
                partial = local.reduce_to_first(value, t)
            except MismatchError as e:     # the host's ranks saw it in the headers: tell the other hosts
                raise self._failed(e, f"in allreduce() call {call}", call) from None
        else:
            partial = self._local_up(src, value, call, t, group)
        # 2. between the leaders
        if me == leader:
            assert partial is not None
            if how == "ring":
                # straight into the caller's array (in place when out is the value and no host phase ran)
                dest = partial if out is value and partial is src else flat_out
                res = self._ring(partial, call, t, dest, ranks=leaders, kind="R", cross_host=True).reshape(-1)
            elif how == "doubling":
                acc = partial if partial is not src else src.copy()
                res = self._doubling(acc, describe_value(value), call, t, leaders)
            else:
                res = partial if partial is not src else src.copy()
        else:
            res = np.empty_like(src) if flat_out is None else flat_out
        # 3. inside the host, from the leader
        if len(group) > 1:
            if local is not None:
                local.broadcast(res, t)
            else:
                self._local_down(res, call, t, group)
        if out is not None:
            assert flat_out is not None
            if not np.may_share_memory(res, flat_out):
                flat_out[...] = res
            return out
        return res.reshape(value.shape)

    # ------------------------------------------------------------------ one ring per local rank
    def _slot_bytes(self) -> int:
        return HOST_SLOT_FACTOR * self.op.shm_chunk_bytes

    def _multi_ring_ok(self, src: np.ndarray, topo: Topology) -> bool:
        """Every host has the same number k > 1 of ranks, and every one of the k rings gets at least one
        element per host: then local rank j of every host runs ring j on its pieces."""
        k = len(topo.groups[0])
        if k < 2 or any(len(g) != k for g in topo.groups):
            return False
        from .shm import pieces
        return all(sum(b - a for a, b in pieces(src.size, src.itemsize, self._slot_bytes(), k, j)) >= topo.nhosts
                   for j in range(k))

    def _multi_ring(self, value: np.ndarray, src: np.ndarray, call: int, t: float, out: np.ndarray | None,
                    topo: Topology, local: ShmAllReduce | None) -> np.ndarray:
        """Reduce-scatter inside the host (rank j gets piece j of every slot-sized chunk), ring j between
        the hosts' j-th ranks on those pieces, allgather inside the host: every host link carries
        2 (H-1)/H of the array, split over k concurrent rings."""
        me = self.op.rank
        group = topo.group(me)
        j = group.index(me)
        ring = [g[j] for g in topo.groups]
        result = np.empty_like(src) if out is None else out.reshape(-1)
        if local is not None:
            # this rank's share is one block of the result: reduced into its place, ringed there, and
            # left there by the allgather (see shm.pieces)
            try:
                part = local.reduce_scatter(value, t, result)
            except MismatchError as e:
                raise self._failed(e, f"in allreduce() call {call}", call) from None
        else:
            part = self._local_reduce_scatter(src, value, call, t, group)
        part = self._ring(part, call, t, part, ranks=ring, kind="R", cross_host=True)
        if local is not None:
            local.allgather(part, result, t)
        else:
            self._local_allgather(part, result, call, t, group)
        return result.reshape(value.shape) if out is None else out

    def _local_reduce_scatter(self, src: np.ndarray, value: np.ndarray, call: int, t: float,
                              group: list[int]) -> np.ndarray:
        """:meth:`ShmAllReduce.reduce_scatter` over local sockets (records ``U``, step 1)."""
        from .shm import pieces
        me = self.op.rank
        k = len(group)
        j = group.index(me)
        share = [pieces(src.size, src.itemsize, self._slot_bytes(), k, x) for x in range(k)]
        desc = describe_value(value)
        for x, m in enumerate(group):
            if m == me:
                continue
            for c, (a, b) in enumerate(share[x]):
                rec: tuple = ("U", call, 1, c, src[a:b])
                if c == 0:
                    rec += ({desc: [me]},)
                self.send_record(m, AR_UP, rec, t)
        part = np.concatenate([src[a:b] for a, b in share[j]]) if share[j] else src[:0].copy()
        groups: dict[str, list[int]] = {desc: [me]}
        pos = 0
        for c, (a, b) in enumerate(share[j]):
            for m in group:
                if m == me:
                    continue
                got = self.take_record(("U", call, 1, c, m), t)
                if c == 0:
                    self._check_child(call, groups, "U", m)
                if not isinstance(got, np.ndarray) or got.size != b - a:
                    raise self._failed(ProtocolError(f"allreduce() call {call}: rank {m} sent a piece of "
                                                     f"{getattr(got, 'size', '?')} elements, expected {b - a}"),
                                       f"in allreduce() call {call}", call)
                self._combine_into(part, pos, pos + b - a, got.reshape(-1), call)
            pos += b - a
        return part

    def _local_allgather(self, part: np.ndarray, result: np.ndarray, call: int, t: float,
                         group: list[int]) -> None:
        """:meth:`ShmAllReduce.allgather` over local sockets (records ``W``, step 1)."""
        from .shm import pieces
        me = self.op.rank
        k = len(group)
        share = [pieces(result.size, result.itemsize, self._slot_bytes(), k, x) for x in range(k)]
        j = group.index(me)
        pos = 0
        for c, (a, b) in enumerate(share[j]):
            result[a:b] = part[pos:pos + b - a]
            for m in group:
                if m != me:
                    self.send_record(m, AR_DOWN, ("W", call, 1, c, part[pos:pos + b - a]), t)
            pos += b - a
        for x, m in enumerate(group):
            if m == me:
                continue
            for c, (a, b) in enumerate(share[x]):
                got = self.take_record(("W", call, 1, c, m), t)
                if not isinstance(got, np.ndarray) or got.size != b - a:
                    raise self._failed(ProtocolError(f"allreduce() call {call}: rank {m} sent a piece of "
                                                     f"{getattr(got, 'size', '?')} elements, expected {b - a}"),
                                       f"in allreduce() call {call}", call)
                result[a:b] = got.reshape(-1)

    def _host_shm(self, call: int, t: float, group: list[int]) -> ShmAllReduce | None:
        """This host's shared-memory segment for the hierarchical path (set up in the first such call)."""
        if self.hier is None:
            from .shm import ShmAllReduce, supported
            state: Any = False
            if supported():
                state = ShmAllReduce.setup(self, call, HOST_SLOT_FACTOR * self.op.shm_chunk_bytes, t,
                                           members=group, kind="S")
                if state is None:
                    log.info("%s: ranks %s share a host but not memory: local phases go over sockets",
                             self.op.describe(), group)
            self.hier = state or False
        return self.hier or None

    # ------------------------------------------------------------------ local sockets
    def _local_up(self, src: np.ndarray, value: np.ndarray, call: int, t: float, group: list[int]) -> np.ndarray | None:
        """Every member's chunks to the leader, which combines them in rank order (records ``U``)."""
        op = self.op
        me = op.rank
        leader = group[0]
        bounds = self._chunks(0, src.size, src.itemsize)
        desc = describe_value(value)
        if me != leader:
            for c, (a, b) in enumerate(bounds):
                rec: tuple = ("U", call, 0, c, src[a:b])
                if c == 0:
                    rec += ({desc: [me]},)
                self.send_record(leader, AR_UP, rec, t)
            return None
        acc = src.copy()
        groups: dict[str, list[int]] = {desc: [me]}
        for c, (a, b) in enumerate(bounds):
            for m in group[1:]:
                got = self.take_record(("U", call, 0, c, m), t)
                if c == 0:
                    self._check_child(call, groups, "U", m)
                if not isinstance(got, np.ndarray) or got.size != b - a:
                    raise self._failed(ProtocolError(f"allreduce() call {call}: rank {m} sent a chunk of "
                                                     f"{getattr(got, 'size', '?')} elements, expected {b - a}"),
                                       f"in allreduce() call {call}", call)
                self._combine_into(acc, a, b, got.reshape(-1), call)
        return acc

    def _local_down(self, res: np.ndarray, call: int, t: float, group: list[int]) -> None:
        """The leader's result to the members (records ``W``), chunk by chunk."""
        op = self.op
        bounds = self._chunks(0, res.size, res.itemsize)
        if op.rank == group[0]:
            for c, (a, b) in enumerate(bounds):
                for m in group[1:]:
                    self.send_record(m, AR_DOWN, ("W", call, 0, c, res[a:b]), t)
            return
        for c, (a, b) in enumerate(bounds):
            got = self.take_record(("W", call, 0, c, group[0]), t)
            if not isinstance(got, np.ndarray) or got.size != b - a:
                raise self._failed(ProtocolError(f"allreduce() call {call}: rank {group[0]} sent a result chunk "
                                                 f"of {getattr(got, 'size', '?')} elements, expected {b - a}"),
                                   f"in allreduce() call {call}", call)
            res[a:b] = got.reshape(-1)
