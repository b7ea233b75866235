"""Glue of the compiled parameter-server packet path (``innet/_pscore.c``) and the choice between it and Python.

The C core runs the same per-packet semantics as ``ParameterServer.handle`` (the reference) and, when
chosen, owns every job's state (pending fragments, kept parameter packets, learned direct workers,
statistics): the server's Python dicts are then unused, ``add_job`` / ``remove_job`` / ``stats`` go
to the core. ``serve`` waits for the socket (poll), then receives batches (recvmmsg), processes them and
sends the outputs (sendmmsg, UDP GSO trains for runs to one destination) until none is waiting, all
without the GIL: a wake-up of the PS takes the GIL once, when it returns, where the Python loop takes it
after its ``select`` and after every receive and send call. The core's state has its own lock, held
while it processes (not while it waits), so the server's Python lock is not held around ``serve``.
The rare events ``handle`` logs are recorded by the core and logged here after each call, with the
same messages, when the logger's level asks for them.

Addresses are keys, IPv4 as ``ip << 16 | port`` (``innet.hostio.addr_key``); an address that is not a
numeric IPv4 one (a name that did not resolve, as tests use) gets a key from ``NAME_KEYS`` on, which no
received datagram has and ``serve`` never sends to -- the Python loop could not send to it either.

``TWISTERNET_INNET_PS_CORE`` picks the packet path of the PS: ``auto`` (default: C when the extension
is built, else Python), ``c`` (an error if it is not built) or ``python``. (``TWISTERNET_INNET_PS`` is
taken: it is the config key ``innet_ps``, the address of a standing PS.)
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np

from twisternet.errors import TwisternetError

from .engines import choose_engine, import_extension
from .hostio import addr_key, key_addr

__all__ = ["PS_CORE_ENV", "NAME_KEYS", "PSCoreUnavailable", "CPSCore", "c_available", "c_unavailable_reason",
           "choose_ps_core"]

PS_CORE_ENV = "TWISTERNET_INNET_PS_CORE"
#: keys from here on stand for addresses that are not numeric IPv4 ones (see the module doc)
NAME_KEYS = 1 << 48

# event kinds of _pscore.c
(_E_LENGTH, _E_GARBLED, _E_UNREGISTERED, _E_BITMAPS, _E_WORKER, _E_DIRECT, _E_OVERLAP, _E_EXPIRED) = range(8)
_MAX_EVENTS = 4096

_pscore, _IMPORT_ERROR = import_extension("_pscore")


class PSCoreUnavailable(TwisternetError, RuntimeError):
    """The compiled PS packet path was asked for but its extension (innet._pscore) is not built."""


def c_available() -> bool:
    """True when the compiled core imports."""
    return _pscore is not None


def c_unavailable_reason() -> str | None:
    """Why the compiled core does not import (None when it does)."""
    return _IMPORT_ERROR


def choose_ps_core(requested: str | None = None) -> str:
    """``"c"`` or ``"python"``: ``requested`` (or the ``TWISTERNET_INNET_PS_CORE`` environment variable;
    ``auto`` by default) resolved against what is built. Asking for ``c`` without the extension raises."""
    return choose_engine(requested, PS_CORE_ENV, _pscore, _IMPORT_ERROR, "the compiled PS core (innet._pscore)",
                         PSCoreUnavailable)


def _level(log: logging.Logger) -> int:
    """The lowest level of the events the core should record for ``log`` (100: none)."""
    for level in (logging.DEBUG, logging.INFO, logging.WARNING):
        if log.isEnabledFor(level):
            return level
    return 100


class CPSCore:
    """The compiled core holding the state of one ``ParameterServer``'s jobs; call its methods with the
    server's lock held (``serve`` releases the GIL, not the lock). ``cfgs`` are the jobs it serves."""

    def __init__(self, value_count: int, pending_ttl: float, log: logging.Logger) -> None:
        if _pscore is None:
            raise PSCoreUnavailable(f"the compiled PS core is not built: {_IMPORT_ERROR}")
        self._core = _pscore.Core(int(value_count), float(pending_ttl))
        self.log = log
        self.cfgs: dict[int, Any] = {}                  # job id -> PSJobConfig
        self._names: dict[tuple[str, int], int] = {}
        self._name_of: dict[int, tuple[str, int]] = {}

    # ------------------------------------------------------------------ addresses
    def key(self, addr: Sequence) -> int:
        """The key of an address as ``handle`` compares it: equal keys for equal (host, port) tuples."""
        host, port = str(addr[0]), int(addr[1])
        try:
            if 0 <= port <= 0xFFFF and socket.inet_ntoa(socket.inet_aton(host)) == host:
                return addr_key((host, port))
        except OSError:
            pass
        k = self._names.get((host, port))
        if k is None:
            k = self._names[(host, port)] = NAME_KEYS + len(self._names)
            self._name_of[k] = (host, port)
        return k

    def addr(self, key: int) -> tuple[str, int]:
        """The address of a key (the inverse of :meth:`key`)."""
        return self._name_of[key] if key >= NAME_KEYS else key_addr(key)

    # ------------------------------------------------------------------ jobs
    def add_job(self, cfg: Any) -> None:
        """Serve ``cfg`` (a ``PSJobConfig``) with fresh state."""
        rs = cfg.rack_size or cfg.world
        sw = cfg.switch_addr
        workers = np.array([self.key(a) for a in cfg.workers], np.uint64)
        self._core.add_job(cfg.job_id, cfg.world, rs, float(cfg.scale), int(cfg.keep), sw is not None,
                           self.key(sw) if sw is not None else 0, workers)
        self.cfgs[cfg.job_id] = cfg

    def remove_job(self, job_id: int) -> None:
        self._core.remove_job(job_id)
        self.cfgs.pop(job_id, None)

    def stats(self, job_id: int) -> tuple[tuple[int, ...], list[int]]:
        """(the counters of ``PSJobStats`` in field order up to ``rejected``, the direct ranks); KeyError
        if the job is unknown."""
        return self._core.stats(job_id)

    def state(self, job_id: int) -> dict[str, Any]:
        """The job's state as ``ParameterServer.job_state`` gives it."""
        pending, completed, direct = self._core.state(job_id)
        rs = self.cfgs[job_id].rack_size or self.cfgs[job_id].world
        return {"pending": {s: (sum(m << (r * rs) for r, m in enumerate(have)), ints, floats, bool(ecn),
                                bool(col), agg, fan, t0)
                            for s, (have, ints, floats, ecn, col, agg, fan, t0) in pending.items()},
                "completed": completed,
                "direct": [(r, self.addr(k)) for r, k in direct]}

    # ------------------------------------------------------------------ packets
    def process(self, rows: np.ndarray, lengths: np.ndarray, keys: np.ndarray, now: float) -> list[tuple[int, bytes]]:
        """Packets in rows of a uint8 matrix (``lengths`` int64, sender ``keys`` uint64), in order: the
        (key, bytes) datagrams to send. Counters and events wait for :meth:`take`."""
        return self._core.process(np.ascontiguousarray(rows, np.uint8), np.ascontiguousarray(lengths, np.int64),
                                  np.ascontiguousarray(keys, np.uint64), float(now), _level(self.log))

    def handle(self, data: bytes, src: Sequence, now: float) -> list[tuple[tuple[str, int], bytes]]:
        """One packet, as ``ParameterServer.handle`` takes and answers it."""
        row = np.frombuffer(data, np.uint8).reshape(1, len(data))
        outs = self.process(row, np.array([len(data)], np.int64), np.array([self.key(src)], np.uint64), now)
        return [(self.addr(k), d) for k, d in outs]

    def serve(self, fd: int, max_batch: int, timeout: float = 0.0) -> int:
        """Wait up to ``timeout`` seconds for ``fd`` to be readable, then receive batches of up to
        ``max_batch`` datagrams, process them and send the outputs until none is waiting (at most 64
        batches), all without the GIL; the number received (0: nothing came)."""
        return self._core.serve(fd, max_batch, _level(self.log), int(timeout * 1000))

    def take(self) -> tuple[tuple[int, int, int, int], list[tuple[int, int, int, int, int]]]:
        """((dropped, rejected, sent, refused) since the last call, the events to log) -- then zeroed."""
        dropped, rejected, sent, refused, lost = self._core.take_counters()
        events = self._core.take_events()
        if lost:
            events.append((-1, 0, lost, 0, 0))
        return (dropped, rejected, sent, refused), events

    def log_events(self, events: list[tuple[int, int, int, int, int]]) -> None:
        """Log what ``handle`` would have logged for these events (call without the server's lock)."""
        log = self.log
        for kind, job, a, b, c in events:
            if kind == _E_LENGTH:
                log.debug("PS dropped a %d-byte packet from %s", a, self.addr(b))
            elif kind == _E_GARBLED:
                log.debug("PS dropped a garbled packet from %s: %s", self.addr(a),
                          "garbled packet: job id 0 is reserved")
            elif kind == _E_UNREGISTERED:
                log.debug("job %d: packet from unregistered address %s rejected", job, self.addr(a))
            elif kind == _E_BITMAPS:
                log.warning("job %d: packet with inconsistent bitmaps %#x/%#x dropped", job, a, b)
            elif kind == _E_WORKER:
                log.debug("job %d: worker %d sent a packet for %#x; rejected", job, a, self._contribution(job, b, c))
            elif kind == _E_DIRECT:
                log.info("job %d: worker %d sends directly to the PS from %s", job, a, self.addr(b))
            elif kind == _E_OVERLAP:
                log.debug("job %d seq %d: partially overlapping contribution dropped", job, a)
            elif kind == _E_EXPIRED:
                log.warning("job %d: %d fragments never completed and were dropped", job, a)
            else:
                log.warning("%d PS log events were not logged (more than %d in one batch)", a, _MAX_EVENTS)

    def _contribution(self, job: int, b0: int, b1: int) -> int:
        cfg = self.cfgs.get(job)
        if cfg is None:
            return b0
        from .ps import _JobState
        return _JobState(cfg).contribution(b0, b1) or 0

    @property
    def gso(self) -> bool:
        """Whether ``serve`` sends runs of outputs to one destination as UDP GSO trains (turned off for
        good when the kernel refuses a train)."""
        return self._core.gso()

    @gso.setter
    def gso(self, on: bool) -> None:
        self._core.set_gso(bool(on))
