"""Which ranks share a host, and host-contiguous rank numbering.

A *host* here is what can share memory and Unix sockets: :func:`twisternet.bootstrap.host_id`
(hostname / boot id / network-namespace inode), so two network namespaces on one machine (the emulated
cluster of :mod:`twisternet.testbed`) are two hosts. Where the ids come from:

* the TCP launcher (``twisternet master``/``worker``, ``twisternet run``): every worker sends its host id
  in its hello and the master's table carries it per rank (:func:`from_channel` reads it, no message);
* any other channel (MPI, the local test channel): the operation that needs the topology exchanges the
  ranks' host ids once over its own edges (``collectives.allreduce.hierarchical``), the same ids
  ``MPI_Comm_split_type(SHARED)`` would group by on one machine.

Rank numbering. The bootstrap master numbers the workers that did not ask for a rank with
:func:`assign_ranks`: **host-contiguous and deterministic** — hosts in the order of the address they
joined from (numeric IPv4/IPv6 order, then host id), the workers of one host in pid order, free ranks
dealt host after host. So with H hosts of k workers each, host ``h`` gets ranks ``h*k .. h*k+k-1``
whatever order the workers connected in, and a ring over the ranks crosses host links H times, not
up to ``world`` times. Workers that asked for a rank keep it.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

log = logging.getLogger(__name__)

__all__ = ["Topology", "assign_ranks", "from_channel", "host_name", "ranks_on_this_kernel"]


def host_name(hid: str) -> str:
    """The hostname part of a host id (``hostname/boot/netns``)."""
    return hid.split("/", 1)[0] if hid else "?"


#: The boot part of a host id (``twisternet.bootstrap.addresses.host_id``) where the kernel has none.
NO_BOOT_ID = "no-boot-id"


def kernel_of(hid: str) -> str:
    """The machine of a host id: its boot id (``hostname/boot/netns``), which every container and network
    namespace of one running kernel shares; the whole id where it has no such part."""
    parts = hid.split("/")
    return parts[1] if len(parts) == 3 and parts[1] not in ("", NO_BOOT_ID) else hid


def ranks_on_this_kernel(hosts: Sequence[str] | Mapping[int, str], rank: int) -> int:
    """How many of the ranks in ``hosts`` (rank -> host id) run on ``rank``'s machine, i.e. share its
    cores: hosts that are namespaces or containers of one kernel count together (the emulated cluster
    of :mod:`twisternet.testbed` puts all its hosts on one machine's cores)."""
    ids = dict(enumerate(hosts)) if isinstance(hosts, Sequence) else hosts
    mine = kernel_of(ids[rank])
    return sum(1 for h in ids.values() if kernel_of(h) == mine)


class Topology:
    """The host of each rank of a set of ranks: groups, leaders, and per-rank lookups.

    ``hosts`` maps rank -> host id. Hosts are ordered by their lowest rank; a host's *leader* is its
    lowest rank. Every rank that builds a Topology from the same mapping gets the same groups/leaders.
    """

    def __init__(self, hosts: Mapping[int, str]) -> None:
        if not hosts:
            raise ValueError("a topology needs at least one rank")
        self.host_of: dict[int, str] = {int(r): str(h) for r, h in hosts.items()}
        by_host: dict[str, list[int]] = {}
        for r in sorted(self.host_of):
            by_host.setdefault(self.host_of[r], []).append(r)
        #: Ranks per host, hosts ordered by their lowest rank, ranks ascending.
        self.groups: list[list[int]] = sorted(by_host.values(), key=lambda g: g[0])
        self._group_of = {r: i for i, g in enumerate(self.groups) for r in g}

    @property
    def ranks(self) -> list[int]:
        return sorted(self.host_of)

    @property
    def nhosts(self) -> int:
        return len(self.groups)

    @property
    def leaders(self) -> list[int]:
        """One rank per host (its lowest), in host order."""
        return [g[0] for g in self.groups]

    @property
    def max_per_host(self) -> int:
        return max(len(g) for g in self.groups)

    def group(self, rank: int) -> list[int]:
        """The ranks on ``rank``'s host (ascending; the first is the leader)."""
        return self.groups[self._group_of[rank]]

    def host_index(self, rank: int) -> int:
        return self._group_of[rank]

    def leader(self, rank: int) -> int:
        return self.group(rank)[0]

    def is_leader(self, rank: int) -> bool:
        return self.leader(rank) == rank

    def contiguous(self) -> bool:
        """Whether every host's ranks are consecutive in rank order (a ring crosses hosts H times)."""
        order = self.ranks
        pos = {r: i for i, r in enumerate(order)}
        return all(pos[g[-1]] - pos[g[0]] == len(g) - 1 for g in self.groups)

    def restrict(self, ranks: Iterable[int]) -> Topology:
        """The topology of a subset of ranks."""
        return Topology({r: self.host_of[r] for r in ranks})

    def describe(self) -> str:
        return "; ".join(f"{host_name(self.host_of[g[0]])}: ranks {g}" for g in self.groups)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and other.host_of == self.host_of

    def __repr__(self) -> str:
        return f"Topology({self.describe()})"


def from_channel(channel: Any) -> dict[int, str] | None:
    """rank -> host id from what the channel already knows, the same on every rank (the TCP bootstrap
    table; the MPI channel's ``host_ids``, gathered when it started), or None."""
    world = getattr(channel, "world", None)
    ids = getattr(channel, "host_ids", None)
    if isinstance(ids, (list, tuple)) and len(ids) == world:
        listed = dict(enumerate(ids))
    else:
        session = getattr(channel, "session", None)
        table = getattr(session, "table", None)
        if not isinstance(table, (list, tuple)) or len(table) != world:
            return None
        listed = {r: e.get("host_id") if isinstance(e, Mapping) else None for r, e in enumerate(table)}
    out: dict[int, str] = {}
    for r, hid in listed.items():
        if not isinstance(hid, str) or not hid:
            return None
        out[r] = hid
    return out


def _address_key(address: str) -> tuple[Any, ...]:
    host = address
    if address.startswith("["):
        host = address[1:].partition("]")[0]
    elif address.count(":") == 1:
        host = address.rpartition(":")[0]
    try:
        ip = ipaddress.ip_address(host)
        return (0, ip.version, int(ip))
    except ValueError:
        return (1, 0, host)


def assign_ranks(workers: Sequence[tuple[int | None, str, str, int]], world: int) -> list[int]:
    """Ranks for the workers of a job, host-contiguous and deterministic (see the module docstring).

    ``workers``: per worker in join order ``(requested rank or None, host id, address it joined from,
    pid)``. Returns the rank of each, in the same order. Requested ranks are kept (the caller checked
    they are distinct and in range); the free ranks go in ascending order to the other workers sorted by
    (host's first address, host id, pid).
    """
    taken = {r for r, *_ in workers if r is not None}
    free = iter(r for r in range(world) if r not in taken)
    host_key: dict[str, tuple[Any, ...]] = {}
    for _, hid, addr, _pid in workers:
        k = _address_key(addr)
        if hid not in host_key or k < host_key[hid]:
            host_key[hid] = k
    todo = sorted((i for i, w in enumerate(workers) if w[0] is None),
                  key=lambda i: (host_key[workers[i][1]], workers[i][1], workers[i][3], i))
    out: list[int] = [w[0] if w[0] is not None else -1 for w in workers]
    for i in todo:
        out[i] = next(free)
    return out


def number_workers(conns: Sequence[Any], world: int) -> None:
    """Set ``conn.rank`` of the bootstrap master's joined workers that asked for none (the master's
    hook): :func:`assign_ranks` over ``(conn.rank, hello host_id, peer address, hello pid)``."""
    workers = [(c.rank, str(c.hello.get("host_id") or ""), str(c.peer),
                c.hello.get("pid") if isinstance(c.hello.get("pid"), int) else 0) for c in conns]
    for c, r in zip(conns, assign_ranks(workers, world)):
        c.rank = r
