"""Glue of the compiled switch dataplane (``innet/_fastpath.c``) and the choice between it and Python.

The C core runs the same per-packet ATP semantics as ``SoftwareSwitch.process`` (the reference) on the
switch's own numpy registers; this module hands it the control tables (ports, jobs, members, multicast
groups) whenever the switch's ``config_version`` changes, and folds the core's counters into the
switch's ``counters()`` / ``extra``. Control (P4Runtime, config, the stale sweep) stays in Python.

``TWISTERNET_INNET_DATAPLANE`` picks the dataplane of the batched switch loop: ``auto`` (default: C when
the extension is built, else Python), ``c`` (an error if it is not built) or ``python``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from twisternet.errors import TwisternetError

from .engines import choose_engine, import_extension

if TYPE_CHECKING:  # pragma: no cover
    from .switch import SoftwareSwitch

__all__ = ["DATAPLANE_ENV", "DataplaneUnavailable", "CDataplane", "c_available", "c_unavailable_reason",
           "choose_dataplane", "COUNTER_SLOTS"]

log = logging.getLogger(__name__)

DATAPLANE_ENV = "TWISTERNET_INNET_DATAPLANE"
#: the core's int64 counter array, in the order of ``_fastpath.c``; (dict, name) each slot folds into
COUNTER_SLOTS = ("aggregated", "forwarded", "collisions", "resends", "acks", "dropped", "ecn_marked",
                 "rejected", "emitted", "flushed", "reclaimed", "saturated", "sent", "refused")
_EXTRA = frozenset({"emitted", "flushed", "reclaimed", "saturated"})
_JOB_FIELDS = 7

_fastpath, _IMPORT_ERROR = import_extension("_fastpath")


class DataplaneUnavailable(TwisternetError, RuntimeError):
    """The C dataplane was asked for but its extension (innet._fastpath) is not built."""


def c_available() -> bool:
    """True when the compiled core imports."""
    return _fastpath is not None


def c_unavailable_reason() -> str | None:
    """Why the compiled core does not import (None when it does)."""
    return _IMPORT_ERROR


def choose_dataplane(requested: str | None = None) -> str:
    """``"c"`` or ``"python"``: ``requested`` (or the ``TWISTERNET_INNET_DATAPLANE`` environment variable;
    ``auto`` by default) resolved against what is built. Asking for ``c`` without the extension raises."""
    return choose_engine(requested, DATAPLANE_ENV, _fastpath, _IMPORT_ERROR,
                         "the C dataplane (innet._fastpath)", DataplaneUnavailable)


def _ipv4(host: str) -> int | None:
    """The IPv4 address of a numeric host as an int (None for a name or IPv6)."""
    try:
        return int.from_bytes(socket.inet_aton(host), "big") if host.count(".") == 3 else None
    except OSError:
        return None


class CDataplane:
    """The compiled core bound to one ``SoftwareSwitch``; call its methods with ``switch._lock`` held."""

    def __init__(self, switch: SoftwareSwitch) -> None:
        if _fastpath is None:
            raise DataplaneUnavailable(f"the C dataplane is not built: {_IMPORT_ERROR}")
        self.switch = switch
        self._counts = np.zeros(len(COUNTER_SLOTS), np.int64)
        sw = switch
        self._core = _fastpath.Core(sw._job_seq, sw._bitmap, sw._counter, sw._ecn.view(np.uint8), sw._timestamp,
                                    sw._values, sw._meta_index, sw._meta_b1, sw._meta_fan, self._counts,
                                    sw._collided)
        self._version = -1
        #: datagrams sent / refused by serve() since the last fold (the server adds them to its transport)
        self.sent = 0
        self.refused = 0

    def sync(self) -> None:
        """Hand the core the switch's tables if they changed, and the ECN threshold / stale timeout."""
        sw = self.switch
        self._core.set_params(int(sw._ecn_threshold), float(sw.stale_timeout))
        if self._version == sw.config_version:
            return
        ports = dict(sw._ports)
        port_nos = sorted(ports)
        send_ip = np.zeros(len(port_nos), np.uint32)
        send_udp = np.zeros(len(port_nos), np.uint16)
        for i, p in enumerate(port_nos):
            host, udp = ports[p]
            ip = _ipv4(host)
            if ip is None:            # a name: resolve it now for sending, as sendto would
                try:
                    ip = int.from_bytes(socket.inet_aton(socket.gethostbyname(host)), "big")
                except OSError:
                    log.warning("port %d: cannot resolve %r; its packets are not delivered", p, host)
                    ip = 0
            send_ip[i], send_udp[i] = ip, udp
        # sources: the same address -> port map the Python loop uses (last port of an address wins);
        # only numeric IPv4 addresses can match a datagram's source, as in the Python dict lookup
        a2p: dict[int, int] = {}
        for p, (host, udp) in ports.items():
            ip = _ipv4(host)
            if ip is not None and socket.inet_ntoa(ip.to_bytes(4, "big")) == host:
                a2p[ip << 16 | udp] = p
        keys = sorted(a2p)
        jobs = np.zeros((256, _JOB_FIELDS), np.int64)
        group_ports: list[int] = []
        for j, e in sw._jobs.items():
            g = sw._groups.get(e.mcast_group)
            jobs[j] = (1, e.fan_in, e.ps_port, e.level, g is not None, len(group_ports),
                       len(g.ports) if g is not None else 0)
            if g is not None:
                group_ports.extend(g.ports)
        members = sorted(j << 32 | p for j, p in sw._members)
        self._core.set_tables(np.asarray(port_nos, np.uint32), send_ip, send_udp, np.asarray(keys, np.uint64),
                              np.asarray([a2p[k] for k in keys], np.uint32), jobs,
                              np.asarray(members, np.uint64), np.asarray(group_ports, np.uint32))
        self._version = sw.config_version

    def fold_counters(self) -> None:
        """Add the core's counts to the switch's counters and zero them."""
        sw = self.switch
        counts = self._counts.tolist()
        if not any(counts):
            return
        self._counts[:] = 0
        c, extra = sw._counters, sw.extra
        for name, v in zip(COUNTER_SLOTS, counts):
            if not v:
                continue
            if name == "sent":
                self.sent += v
            elif name == "refused":
                self.refused += v
            elif name in _EXTRA:
                extra[name] += v
            else:
                c[name] += v

    def process_batch(self, rows: np.ndarray, lengths: Sequence[int], in_ports: Sequence[int], now: float,
                      queue_depths: Sequence[int] | None = None) -> list[tuple[int, bytes]]:
        """The packet function: same contract as ``SoftwareSwitch.process_batch``."""
        sw = self.switch
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        with sw._lock:
            self.sync()
            try:
                return self._core.process(rows, lengths, in_ports, queue_depths, float(now))
            finally:
                self.fold_counters()

    def serve(self, fd: int, max_batch: int) -> int:
        """Receive up to ``max_batch`` datagrams from ``fd`` (recvmmsg), process them, send the outputs
        (sendmmsg); the number received (0: nothing was waiting). Takes the switch's lock."""
        sw = self.switch
        with sw._lock:
            self.sync()
            try:
                return self._core.serve(fd, max_batch)
            finally:
                self.fold_counters()

    @property
    def gso(self) -> bool:
        """Whether ``serve`` sends each destination's outputs as UDP GSO trains (one syscall and one
        pass through the stack for up to 64 datagrams; the receivers get the same datagrams). Turned
        off for good when the kernel refuses a train."""
        return self._core.gso()

    @gso.setter
    def gso(self, on: bool) -> None:
        self._core.set_gso(bool(on))

    def drain(self, fd: int, max_batch: int) -> int:
        """Receive up to ``max_batch`` datagrams and do nothing else (the compiled receive ceiling)."""
        return self._core.drain(fd, max_batch)
