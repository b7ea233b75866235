"""``AllReduce(..., via="innet")``: float sums aggregated by an ATP-style switch (the ``innet`` package).

On the first call the operation's ranks set up one in-network job over the operation's own channel
edges (small tree allreduces of int64 arrays, so nothing else is needed):

1. the first rank picks a UDP port for the switch and one for the parameter server, a random job id,
   and shares its host;
2. every rank opens its ATP worker sockets (``innet.InnetJob``: one towards the switch, one towards
   the PS) and the ranks share their addresses;
3. the first rank starts the software switch and the PS as subprocesses
   (``innet.InnetService.launch``) configured for exactly these workers -- the switch and the PS accept
   the job's packets from these addresses only (docs/innet-security.md) -- and everyone waits for it;
4. every call then quantizes, sends fragments through the switch and returns the aggregate, within the
   operation's timeout; a lost rank of the operation ends the call with PeerLostError.

The switch and PS live as long as the operation (closed with it, or at exit, or when the first rank
dies: ``innet.lifeline``). If the switch dies the workers finish through the PS (ATP's fate sharing),
for the rest of the job, and ``last_stats.fallback`` says so, with a log warning. Results equal the
float64 sum within ``innet.quantize.error_bound`` (values are scaled by ``2**20`` and rounded; float64
values are quantized from float64; values that would overflow int32 go to the PS as raw float32).

Packet width and window: ``innet_values`` (default ATP's 62) sets the values per packet of the switch,
PS and workers the operation starts (the first rank's value; wider packets cut a software switch's
per-packet work, docs/innet-performance.md); the worker window holds about 2 MB of fragments, and that
switch, serving only this job, does not ECN-mark. A shared switch has its own width, which the first
rank reads from the P4Info it serves (``P4RuntimeController.packet_values``) and shares; an
``innet_values`` other than the default that differs from it is a ConfigError on every rank.

Host: the workers bind the ``innet_host`` config key (default 127.0.0.1; in a TCP job left at that
default: the address the host uses to reach the bootstrap master); the switch and PS run on the first
rank's. Loopback on some ranks and not on others, or loopback on ranks of different hosts, is a
ConfigError on every rank (instead of a hang).

A shared switch: when the config keys ``innet_switch`` (its UDP ``host:port``) and ``innet_p4runtime``
(its P4Runtime ``host:port``) are set -- ``twisternet run --innet`` sets them for a switch it starts
beside the job -- no switch is started; the first rank starts only the PS and places the job on that
switch through P4Runtime (``innet.controller``, with the token derived from the job token: a random free
job id, free port numbers, the member entries, the multicast group and the job entry), and removes it
again when the operation closes. With ``innet_ps`` too (the control address of a standing PS, ``twisternet
ps``: a server of its own, as in ATP) it starts no PS either but registers the job there
(``innet.ps_control``), so no worker's link also carries the PS's traffic.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import secrets
import socket
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from twisternet.bootstrap import local_address_for, parse_address
from twisternet.errors import ConfigError, PeerLostError

if TYPE_CHECKING:
    from .allreduce import RankAllReduce

log = logging.getLogger(__name__)

__all__ = ["InnetAllReduce"]


#: ECN threshold of a switch started for one operation: it serves no other job, so a queue behind a
#: receive batch (up to 512 packets, mostly a scheduling delay of a loaded host) is no reason to halve
#: the window; congestion still shows as loss.
_EXCLUSIVE_ECN = 1 << 20


def _window_for(values: int) -> dict[str, Any]:
    """Worker window options for ``values``-wide packets: about 2 MB in flight per worker (the
    bandwidth-delay product of a loopback or LAN path with a loaded Python switch's millisecond RTTs),
    at least ATP's 128 fragments, at most 1024 (the switch's 4096 aggregators are shared by jobs)."""
    frags = max(128, min(1024, (2 << 20) // (4 * values)))
    # rto_min 0.2 s: on a loaded host a process may not run for a hundred milliseconds, and a spurious
    # timeout costs a resend (the switch flushes the partial aggregate to the PS) and half the window
    return {"max_window": frags, "initial_window": min(frags, 32), "rto_min": 0.2, "rto_initial": 0.5}


def _ip_to_int(host: str) -> int:
    return int.from_bytes(socket.inet_aton(socket.gethostbyname(host)), "big")


def _int_to_ip(value: int) -> str:
    return socket.inet_ntoa(int(value).to_bytes(4, "big"))


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host == "localhost"


def _machine_id() -> int:
    """This host's name as a 56-bit number (ranks compare it to learn whether they share a host)."""
    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:7], "big")


def _innet_host(config: Any) -> str:
    """The address this rank's ATP sockets bind: ``innet_host``, or, left at its default in a TCP job,
    the address this host uses to reach the bootstrap master (127.0.0.1 when everything is local)."""
    if config.innet_host != "127.0.0.1" or not config.master:
        return config.innet_host
    if config.advertise_host:
        return config.advertise_host
    try:
        return local_address_for(config.master)
    except (OSError, ValueError):
        return config.innet_host


def _check_reachable(what: str, ranks: list[int], server_host: str, workers: list[tuple[str, int]],
                     machines: list[int] | None = None) -> None:
    """ConfigError (on every rank: they all hold the same table) when the switch/PS host and the workers
    cannot reach each other: some on loopback, others not, or all on loopback but on different hosts
    (``innet_host`` at 127.0.0.1 in a multi-host job), instead of a job that hangs until its timeout."""
    loop = _is_loopback(server_host)
    odd = [(r, h) for r, (h, _) in zip(ranks, workers) if _is_loopback(h) != loop]
    if loop and machines and not odd:
        odd = [(r, f"{h} of another host") for r, (h, _), m in zip(ranks, workers, machines) if m != machines[0]]
    if odd:
        raise ConfigError("innet_host", f"{what}: the in-network switch and PS are at {server_host} but "
                                        f"rank(s) {', '.join(f'{r} at {h}' for r, h in odd)} "
                                        f"{'are not on that host' if loop else 'bind loopback'}; set "
                                        "innet_host (TWISTERNET_INNET_HOST) on every host to an address "
                                        "the others can reach")


_reserved_ids: set[int] = set()      # job ids this process holds on a shared switch
_reserved_lock = threading.Lock()


def _release_shared(controller: Any, placement: Any, ps_stop: Any, job_id: int) -> None:
    """Take a job off the shared switch, stop its PS (``ps_stop()``) and free its id (idempotent enough
    for atexit)."""
    try:
        if controller is not None and placement is not None:
            controller.remove_job(placement)
    except Exception as err:  # noqa: BLE001 - the switch may be gone already; nothing else to do
        log.warning("could not remove in-network job %d from the switch: %s", job_id, err)
    if ps_stop is not None:
        try:
            ps_stop()
        except Exception as err:  # noqa: BLE001 - the PS may be gone already; nothing else to do
            log.warning("could not remove in-network job %d from its parameter server: %s", job_id, err)
    with _reserved_lock:
        _reserved_ids.discard(job_id)


def _standing_ps_info(address: tuple[str, int], token: str | None) -> tuple[str, int, int]:
    """A standing PS's UDP host, port and packet width (``innet.ps_control``)."""
    from innet.ps_control import ps_request
    answer = ps_request(address, token or "", "info")
    host, port = answer["address"]
    return str(host), int(port), int(answer["values"])


def _standing_ps_add(address: tuple[str, int], token: str | None, job_id: int, world: int,
                     switch: tuple[str, int], directs: list[tuple[str, int]]) -> Any:
    """Register a job on a standing PS; returns what removes it again."""
    from innet.ps_control import ps_request
    from innet.service import DEFAULT_SCALE
    job = {"job_id": job_id, "world": world, "scale": DEFAULT_SCALE, "switch": list(switch),
           "workers": [list(a) for a in directs]}
    ps_request(address, token or "", "add", job=job)
    return functools.partial(ps_request, address, token or "", "remove", job_id=job_id)


class InnetAllReduce:
    """The in-network path of one AllReduce operation (set up lazily, on the first call)."""

    def __init__(self, rank_allreduce: RankAllReduce) -> None:
        self.rar = rank_allreduce
        self.job: Any = None
        self.service: Any = None
        self._finalizer: weakref.finalize | None = None
        # shared-switch mode, on the first rank only
        self._controller: Any = None
        self._placement: Any = None
        self._ps_stop: Any = None         # stops this job's PS (a process, or its job on a standing PS)
        self._job_id = 0
        self._machines: list[int] = []

    # ------------------------------------------------------------------ one call
    def run(self, value: Any, timeout: float) -> np.ndarray:
        op = self.rar.op
        if op.reduction.name not in ("sum",):
            raise ConfigError("op", "AllReduce(via='innet') aggregates sums only (the switch adds "
                                    f"integers); got reduction {op.reduction.name!r}")
        if not isinstance(value, np.ndarray) or not np.issubdtype(value.dtype, np.floating):
            of = "" if not isinstance(value, np.ndarray) else f" of {value.dtype}"
            raise TypeError("AllReduce(via='innet') takes numpy float arrays (float16/32/64), got "
                            f"{type(value).__name__}{of}")
        if self.job is None:
            self._setup(timeout)
        # float64 stays float64 up to the quantizer: a cast to float32 first would break the bound
        flat = np.ascontiguousarray(value, dtype=np.float64 if value.dtype == np.float64 else np.float32
                                    ).reshape(-1)
        out = self.job.allreduce(flat, timeout=timeout, abort=self._abort_if_peer_lost)
        stats = self.job.last_stats
        if stats is not None and stats.fallback:
            log.warning("%s: in-network allreduce fell back to the parameter server (%s)",
                        op.describe(), stats.fallback_reason)
        return out.reshape(value.shape).astype(value.dtype, copy=False)

    def _abort_if_peer_lost(self) -> None:
        """Raise PeerLostError when a rank of this operation is lost (the call cannot complete then)."""
        lost = self.rar.op.ctx.lost_peers
        for rank in self.rar.ranks:
            if rank in lost:
                raise PeerLostError(rank, lost[rank])

    @property
    def last_stats(self) -> Any:
        """The worker statistics of the last call (window, retransmits, fallback...), or None."""
        return None if self.job is None else self.job.last_stats

    # ------------------------------------------------------------------ set-up
    def _exchange(self, local: np.ndarray, timeout: float) -> np.ndarray:
        """Sum of an int64 array over the ranks, over the operation's own tree (a rendezvous too)."""
        return self.rar.tree_sum(local, timeout)

    def _share_addresses(self, me: int, world: int, timeout: float
                         ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """Every rank's ATP worker addresses, by rank: (switch-facing, PS-facing). Each rank fills its
        slot, the sum is the table; the switch and the PS accept the job's packets from these only."""
        mine = np.zeros(4 * world, np.int64)
        addr, direct = self.job.address, self.job.direct_address
        mine[4 * me:4 * me + 4] = (_ip_to_int(addr[0]), addr[1], direct[1], _machine_id())
        table = self._exchange(mine, timeout)
        workers = [(_int_to_ip(table[4 * r]), int(table[4 * r + 1])) for r in range(world)]
        directs = [(_int_to_ip(table[4 * r]), int(table[4 * r + 2])) for r in range(world)]
        self._machines = [int(table[4 * r + 3]) for r in range(world)]
        return workers, directs

    def _setup(self, timeout: float) -> None:
        from innet import InnetJob, InnetService
        from innet.service import free_udp_port

        rar = self.rar
        op = rar.op
        ranks = rar.ranks
        world = len(ranks)
        me = ranks.index(op.rank)
        first = me == 0
        config = op.ctx.config
        host = _innet_host(config)
        if config.innet_switch:
            self._setup_shared(host, parse_address(config.innet_switch), parse_address(config.innet_p4runtime),
                               timeout)
            return
        # one switch per operation: any id in 1..255 will do, so a random one (never derived from the
        # edge: a job's identity is its registered addresses, and its id should not be guessable either)
        # the switch and PS run on the first rank's host: everyone uses its address (not its own)
        # the packet width (innet_values) is the first rank's, so every worker and the switch agree
        ports = np.zeros(5, np.int64)
        if first:
            ports[:] = (free_udp_port(host), free_udp_port(host), secrets.randbelow(255) + 1, _ip_to_int(host),
                        config.innet_values)
        ports = self._exchange(ports, timeout)
        server_host = _int_to_ip(ports[3])
        sw_addr, ps_addr, job_id = (server_host, int(ports[0])), (server_host, int(ports[1])), int(ports[2])
        values = int(ports[4])

        self.job = InnetJob(job_id, me, world, sw_addr, ps_addr, bind=(host, 0), value_count=values,
                            hostio=config.innet_hostio, **_window_for(values))
        workers, directs = self._share_addresses(me, world, timeout)
        try:
            _check_reachable(op.describe(), ranks, server_host, workers, self._machines)
        except ConfigError:
            self.close()
            raise

        ok = np.zeros(1, np.int64)
        if first:
            try:
                self.service = InnetService.launch(job_id, workers, switch_port=sw_addr[1],
                                                   ps_port=ps_addr[1], host=host, direct_addrs=directs,
                                                   value_count=values, ecn_threshold=_EXCLUSIVE_ECN,
                                                   dataplane=config.innet_dataplane,
                                                   ps_core=config.innet_ps_core)
                ok[0] = 1
            except Exception:  # reported to every rank below, then raised here
                log.exception("%s: could not start the in-network switch and PS", op.describe())
        # the rendezvous: nobody sends a gradient before the switch knows every worker's port
        started = self._exchange(ok, timeout)
        if int(started[0]) != 1:
            self.close()
            raise RuntimeError(f"{op.describe()}: the in-network switch and PS did not start on rank "
                               f"{ranks[0]} (see its log)")
        if self.service is not None:
            self._finalizer = weakref.finalize(self, self.service.close)
            atexit.register(self._finalizer)
        log.info("%s: in-network job %d, switch %s, PS %s, %d workers", op.describe(), job_id, sw_addr,
                 ps_addr, world)

    def _setup_shared(self, host: str, sw_addr: tuple[str, int], control: tuple[str, int],
                      timeout: float) -> None:
        """Set up on a running switch (``innet_switch``), placing the job through P4Runtime."""
        from innet import InnetJob
        from innet.service import free_udp_port, start_ps, stop_process
        from innet.wire import DEFAULT_VALUE_COUNT

        rar = self.rar
        op = rar.op
        config = op.ctx.config
        world = len(rar.ranks)
        me = rar.ranks.index(op.rank)
        first = me == 0

        # a standing PS (innet_ps) takes the job, or the first rank starts one on its own host
        standing = parse_address(config.innet_ps) if config.innet_ps else None
        token = None
        if config.token_bytes:
            from innet.tokens import p4runtime_token
            token = p4runtime_token(config.token_bytes)
        where = f"P4Runtime server at {control[0]}:{control[1]}" + (
            f" or the parameter server at {standing[0]}:{standing[1]} (innet_ps)" if standing else "")
        # (job id, PS port, PS host, packet width); a job id of 0 reports a failure
        head = np.zeros(4, np.int64)
        if first:
            try:
                from innet.controller import P4RuntimeController
                self._controller = P4RuntimeController(f"{control[0]}:{control[1]}", token=token)
                with _reserved_lock:
                    job_id = self._controller.free_job_id(exclude=_reserved_ids)
                    _reserved_ids.add(job_id)
                self._job_id = job_id
                values = self._controller.packet_values()
                ps_host, ps_port = host, free_udp_port(host)
                if standing is not None:
                    ps_host, ps_port, ps_values = _standing_ps_info(standing, token)
                    if ps_values != values:
                        raise ConfigError("innet_ps", f"the parameter server at {standing[0]}:{standing[1]} "
                                          f"takes {ps_values} values per packet, the switch {values}")
                head[:] = (job_id, ps_port, _ip_to_int(ps_host), values)
            except Exception:  # reported to every rank below, then raised here
                log.exception("%s: could not set up with the in-network switch's %s", op.describe(), where)
        head = self._exchange(head, timeout)
        job_id, ps_port = int(head[0]), int(head[1])
        if job_id == 0:
            self.close()
            raise RuntimeError(f"{op.describe()}: rank {rar.ranks[0]} could not get a job id and packet width "
                               f"from the in-network switch's {where} (see its log)")
        ps_addr = (_int_to_ip(head[2]), ps_port)
        values = int(head[3])
        if config.innet_values not in (DEFAULT_VALUE_COUNT, values):
            self.close()
            raise ConfigError("innet_values", f"{config.innet_values} values per packet, but the shared switch "
                              f"at {sw_addr[0]}:{sw_addr[1]} (innet_switch) carries {values} (read from its "
                              "P4Info); leave innet_values unset to use the switch's width")

        self.job = InnetJob(job_id, me, world, sw_addr, ps_addr, bind=(host, 0), value_count=values,
                            hostio=config.innet_hostio, **_window_for(values))
        workers, directs = self._share_addresses(me, world, timeout)
        try:
            _check_reachable(op.describe(), rar.ranks, sw_addr[0], workers, self._machines)
        except ConfigError:
            self.close()
            raise

        ok = np.zeros(1, np.int64)
        if first:
            try:
                if standing is not None:
                    self._ps_stop = _standing_ps_add(standing, token, job_id, world, sw_addr, directs)
                else:
                    ps_proc, _ = start_ps(job_id, world, sw_addr, host=host, port=ps_port, workers=directs,
                                          value_count=values, core=config.innet_ps_core)
                    self._ps_stop = functools.partial(stop_process, ps_proc)
                self._placement = self._controller.place_job(job_id, workers, ps_addr)
                ok[0] = 1
            except Exception:  # reported to every rank below, then raised here
                log.exception("%s: could not place in-network job %d on the switch at %s:%d",
                              op.describe(), job_id, *sw_addr)
        started = self._exchange(ok, timeout)
        if int(started[0]) != 1:
            self.close()
            raise RuntimeError(f"{op.describe()}: rank {rar.ranks[0]} could not start the PS or place job "
                               f"{job_id} on the in-network switch at {sw_addr[0]}:{sw_addr[1]} (see its log)")
        if first:
            self._finalizer = weakref.finalize(self, _release_shared, self._controller, self._placement,
                                               self._ps_stop, job_id)
            atexit.register(self._finalizer)
        log.info("%s: in-network job %d on the shared switch %s, PS %s, %d workers, %d values per packet",
                 op.describe(), job_id, sw_addr, ps_addr, world, values)

    def kill_switch(self) -> None:
        """Kill the switch process (fate-sharing tests); only on the rank that started it."""
        if self.service is not None:
            self.service.kill_switch()

    def close(self) -> None:
        """Close the worker socket and (on the first rank) stop the switch and the PS."""
        if self.job is not None:
            self.job.close()
        if self._finalizer is not None:
            self._finalizer()
        elif self.service is not None:
            self.service.close()
        elif self._controller is not None:   # a shared-switch set-up that failed half-way
            _release_shared(self._controller, self._placement, self._ps_stop, self._job_id)
        self.service = None
        self._controller = self._placement = self._ps_stop = None
