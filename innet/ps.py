"""The ATP parameter server: aggregates what the switches could not, and returns the parameter packets.

Contributions arrive as switch aggregates, collision-forwarded or resent raw fragments, partial flushes
and overflow (float) fragments. Each packet stands for a *set of workers* (rank = rack * rack_size +
index in rack):

* ``bitmap0 != 0``: the workers ``bitmap0`` of the single rack ``bitmap1`` (a raw gradient, or a level-0
  aggregate);
* ``bitmap0 == 0``: every worker of the racks in ``bitmap1`` (a level-1 aggregate of whole racks).

Per fragment the PS keeps the union of the sets received and adds a packet only when its set is disjoint
from it; a subset is a duplicate (ignored); a partial overlap cannot be un-added, so it is dropped and
counted (the workers' resends then arrive raw, each disjoint). int32 payloads are summed in int64 and
overflow payloads (float32 bits) in float64; once the union covers all workers, the result
``int_sum / scale + float_sum`` is sent as float32 in a parameter packet.

**Collisions** are answered by aggregating the fragment here, and by setting ``collision`` in the
parameter packet: workers then move the aggregator slot of that fragment to a re-hashed index for the
fragment that reuses the slot next (see ``innet.worker``).

The parameter packet goes to the job's switch (which frees the aggregators on its way and multicasts it),
and directly to every worker seen sending straight to the PS (fallback when the switch is gone).
Completed results are kept for ``keep`` fragments so a duplicate (a worker whose ACK was lost) is
answered with the same packet.

``handle`` below is the per-packet reference. ``run`` uses the compiled packet path (``innet/_pscore.c``,
glue ``innet.pscore``) when it is built: the same outputs, state and statistics, with a whole receive
batch per call and no GIL (``TWISTERNET_INNET_PS_CORE=auto|c|python``); the server's engine is chosen
when it is made, and the compiled core then owns every job's state.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from .hostio import RowIO, key_addr
from .ps_batch import handle_batch
from .pscore import NAME_KEYS, CPSCore, PSCoreUnavailable, choose_ps_core
from .server_thread import ServerThread
from .transport import ROLE_PS, LossConfig, UdpTransport
from .wire import (DEFAULT_VALUE_COUNT, FLAG_ACK, FLAG_COLLISION, FLAG_ECN, FLAG_EDGE, FLAG_OVERFLOW,
                   FLAG_RESEND, HEADER_SIZE, MAX_FAN_IN, MAX_JOB_ID, WireError, decode_header,
                   encode_header, packet_size)

__all__ = ["PSJobConfig", "PSJobStats", "ParameterServer", "PSThread", "main"]

log = logging.getLogger(__name__)

_PENDING_TTL = 60.0
_BATCH = 512         # datagrams per receive call of run()


def _numeric(addr: Sequence) -> tuple[str, int]:
    """``addr`` as recvfrom reports a sender: a numeric IPv4 host (names resolved once, if they resolve)."""
    host, port = str(addr[0]), int(addr[1])
    try:
        host = socket.gethostbyname(host)
    except OSError:
        pass                        # not resolvable here (simulated hosts in tests): compared as given
    return host, port


@dataclass(frozen=True)
class PSJobConfig:
    """A job as the PS sees it: layout of workers into racks, quantization scale, where ACKs go.

    ``switch_addr`` is the UDP address of the switch that multicasts this job's parameter packets (the
    PS-rack ToR), or None when there is no switch. ``keep`` is how many completed fragments are
    remembered for answering duplicates; it must exceed twice the workers' maximum window.
    ``workers[r]`` is the address rank r sends from when it bypasses the switch (``AtpWorker.
    direct_address``); packets of this job from any address other than the switch and these are
    dropped and counted (``PSJobStats.rejected``), and a worker's own packets only count for itself.
    """

    job_id: int
    world: int
    scale: float
    switch_addr: tuple[str, int] | None = None
    rack_size: int | None = None
    keep: int = 4096
    workers: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.job_id <= MAX_JOB_ID:
            raise ValueError(f"job_id must be in 1..{MAX_JOB_ID}, got {self.job_id}")
        rs = self.rack_size or self.world
        if not 1 <= rs <= MAX_FAN_IN:
            raise ValueError(f"rack size must be in 1..{MAX_FAN_IN}, got {rs}")
        if not 1 <= self.world <= rs * MAX_FAN_IN:
            raise ValueError(f"world must be in 1..{rs * MAX_FAN_IN} for rack size {rs}, got {self.world}")
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")
        if self.keep < 0:
            raise ValueError(f"keep must be >= 0, got {self.keep}")
        if self.workers and len(self.workers) != self.world:
            raise ValueError(f"workers must list one address per rank ({self.world}), got {len(self.workers)}")
        object.__setattr__(self, "workers", tuple(_numeric(a) for a in self.workers))
        if self.switch_addr is not None:
            object.__setattr__(self, "switch_addr", _numeric(self.switch_addr))

    @property
    def racks(self) -> int:
        rs = self.rack_size or self.world
        return -(-self.world // rs)


@dataclass
class PSJobStats:
    """What the PS did for one job."""

    packets: int = 0
    switch_aggregates: int = 0     # packets already aggregated by a switch (edgeSwitchIdentifier set)
    raw: int = 0                   # single-worker packets aggregated here
    collisions: int = 0
    overflow: int = 0
    resends: int = 0
    duplicates: int = 0
    overlaps: int = 0
    completed: int = 0
    param_resent: int = 0
    rejected: int = 0              # packets of this job from an address not registered for it
    direct_workers: set[int] = field(default_factory=set)


#: the counters of PSJobStats in field order, as the C core reports them
_STAT_FIELDS = ("packets", "switch_aggregates", "raw", "collisions", "overflow", "resends", "duplicates",
                "overlaps", "completed", "param_resent", "rejected")


class _Pending:
    __slots__ = ("have", "int_sum", "float_sum", "ecn", "collision", "agg_index", "fan", "t0")

    def __init__(self, value_count: int, agg_index: int, fan: int, now: float) -> None:
        self.have = 0
        self.int_sum = np.zeros(value_count, np.int64)
        self.float_sum: np.ndarray | None = None
        self.ecn = False
        self.collision = False
        self.agg_index = agg_index
        self.fan = fan
        self.t0 = now


class _JobState:
    def __init__(self, cfg: PSJobConfig) -> None:
        self.cfg = cfg
        self.rack_size = cfg.rack_size or cfg.world
        self.full = (1 << cfg.world) - 1
        self.rack_masks = [((1 << min(self.rack_size, cfg.world - r * self.rack_size)) - 1)
                           for r in range(cfg.racks)]
        self.pending: dict[int, _Pending] = {}
        self.completed: OrderedDict[int, bytes | np.ndarray] = OrderedDict()   # ndarray: a batch's row
        self.direct: dict[int, tuple[str, int]] = {}
        self.rank_of = {a: r for r, a in enumerate(cfg.workers)}
        self.stats = PSJobStats()

    def contribution(self, b0: int, b1: int) -> int | None:
        """The set of ranks a packet stands for, as a bitset; None when the bitmaps are inconsistent."""
        racks = len(self.rack_masks)
        if b1 == 0 or b1 >> racks:
            return None
        if b0 == 0:
            s = 0
            for r in range(racks):
                if b1 >> r & 1:
                    s |= self.rack_masks[r] << (r * self.rack_size)
            return s
        if b1 & (b1 - 1):
            return None
        r = b1.bit_length() - 1
        if b0 & ~self.rack_masks[r]:
            return None
        return b0 << (r * self.rack_size)


class ParameterServer:
    """The PS end host for several jobs on one UDP socket; ``run()`` loops until ``stop()``.

    ``core`` picks the packet path (``innet.pscore.choose_ps_core``: ``auto``, ``c`` or ``python``; None
    reads ``TWISTERNET_INNET_PS_CORE``); ``self.core`` says which one runs.
    """

    def __init__(self, bind: tuple[str, int] = ("127.0.0.1", 0), value_count: int = DEFAULT_VALUE_COUNT,
                 *, loss: LossConfig | None = None, core: str | None = None) -> None:
        self.value_count = int(value_count)
        self.packet_size = packet_size(self.value_count)
        self.core = choose_ps_core(core)
        self.transport = UdpTransport(bind, role=ROLE_PS, loss=loss)
        self._jobs: dict[int, _JobState] = {}      # the Python path's state (unused with the C core)
        self._c = CPSCore(self.value_count, _PENDING_TTL, log) if self.core == "c" else None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.dropped = 0
        #: packets of a served job from an address not registered for it (forged or stray)
        self.rejected = 0

    @property
    def address(self) -> tuple[str, int]:
        return self.transport.address

    def add_job(self, cfg: PSJobConfig) -> None:
        """Serve a job (replacing any previous state of the same id)."""
        with self._lock:
            if self._c is not None:
                self._c.add_job(cfg)
            else:
                self._jobs[cfg.job_id] = _JobState(cfg)

    def has_job(self, job_id: int) -> bool:
        """Whether the PS serves a job of this id."""
        with self._lock:
            return job_id in (self._c.cfgs if self._c is not None else self._jobs)

    def remove_job(self, job_id: int) -> None:
        with self._lock:
            if self._c is not None:
                self._c.remove_job(job_id)
            else:
                self._jobs.pop(job_id, None)

    def stats(self, job_id: int) -> PSJobStats:
        """A snapshot of the statistics of one job; KeyError if unknown."""
        with self._lock:
            if self._c is not None:
                counts, ranks = self._c.stats(job_id)
                st = PSJobStats(direct_workers=set(ranks))
                for name, v in zip(_STAT_FIELDS, counts, strict=True):
                    setattr(st, name, v)
                return st
            s = self._jobs[job_id].stats
            return PSJobStats(**{**s.__dict__, "direct_workers": set(s.direct_workers)})

    def job_state(self, job_id: int) -> dict[str, Any]:
        """A snapshot of one job's per-fragment state, the same with either packet path (tests):
        ``pending`` {seq: (set of ranks as a bitset, int64 sums as bytes, float64 sums as bytes or None,
        ecn, collision, aggregator index, fan-in bits, first-seen time)}, ``completed`` [(seq, parameter
        packet)] oldest first, ``direct`` [(rank, address)] in the order they were learned."""
        with self._lock:
            if self._c is not None:
                return self._c.state(job_id)
            js = self._jobs[job_id]
            return {"pending": {s: (p.have, p.int_sum.tobytes(),
                                    None if p.float_sum is None else p.float_sum.tobytes(), p.ecn, p.collision,
                                    p.agg_index, p.fan, p.t0) for s, p in js.pending.items()},
                    "completed": [(s, bytes(v)) for s, v in js.completed.items()],
                    "direct": list(js.direct.items())}

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ packet handling
    # Complexity accepted: one branch per ATP packet kind.
    def handle(self, data: bytes, src: tuple[str, int], now: float) -> list[tuple[tuple[str, int], bytes]]:  # noqa: C901
        """Process one received packet; returns the (address, bytes) datagrams to send. (With the C
        core, the packet goes through it: its state is the only one.)"""
        if self._c is not None:
            with self._lock:
                outs = self._c.handle(data, src, now)
                events = self._fold()
            self._c.log_events(events)
            return outs
        if len(data) != self.packet_size:
            self.dropped += 1
            log.debug("PS dropped a %d-byte packet from %s", len(data), src)
            return []
        try:
            h = decode_header(data)
        except WireError as e:
            self.dropped += 1
            log.debug("PS dropped a garbled packet from %s: %s", src, e)
            return []
        with self._lock:
            js = self._jobs.get(h.job_id)
            if js is None or h.flags & FLAG_ACK:
                self.dropped += 1
                return []
            cfg, st = js.cfg, js.stats
            direct = src != cfg.switch_addr
            rank = js.rank_of.get(src)
            if direct and rank is None:
                self.rejected += 1
                st.rejected += 1
                log.debug("job %d: packet from unregistered address %s rejected", h.job_id, src)
                return []
            contrib = js.contribution(h.bitmap0, h.bitmap1)
            if contrib is None:
                self.dropped += 1
                log.warning("job %d: packet with inconsistent bitmaps %#x/%#x dropped", h.job_id,
                            h.bitmap0, h.bitmap1)
                return []
            if rank is not None and direct and (h.flags & FLAG_EDGE or contrib != 1 << rank):
                self.rejected += 1          # a worker speaks for itself only, never as a switch
                st.rejected += 1
                log.debug("job %d: worker %d sent a packet for %#x; rejected", h.job_id, rank, contrib)
                return []
            st.packets += 1
            if direct and rank is not None and js.direct.get(rank) != src:
                js.direct[rank] = src
                st.direct_workers.add(rank)
                log.info("job %d: worker %d sends directly to the PS from %s", h.job_id, rank, src)
            if h.flags & FLAG_RESEND:
                st.resends += 1
            seq = h.seq
            kept = js.completed.get(seq)
            if kept is not None:
                done = kept if isinstance(kept, bytes) else kept.tobytes()
                st.duplicates += 1
                st.param_resent += 1
                if direct:
                    return [(src, done)]
                return [(cfg.switch_addr, done)] if cfg.switch_addr else []
            p = js.pending.get(seq)
            if p is None:
                p = js.pending[seq] = _Pending(self.value_count, h.agg_index,
                                               int.from_bytes(data[8:10], "big") & ~0x3F, now)
            if contrib & p.have:
                if contrib & p.have == contrib:
                    st.duplicates += 1
                else:
                    st.overlaps += 1
                    log.debug("job %d seq %d: partially overlapping contribution dropped", h.job_id, seq)
                return []
            payload = np.frombuffer(data, dtype=">i4", count=self.value_count, offset=HEADER_SIZE)
            if h.flags & FLAG_OVERFLOW:
                st.overflow += 1
                f = payload.view(">f4").astype(np.float64)
                if p.float_sum is None:
                    p.float_sum = f
                else:
                    with np.errstate(over="ignore", invalid="ignore"):   # inf + -inf: NaN, as IEEE says
                        p.float_sum += f
            else:
                p.int_sum += payload
            if h.flags & FLAG_EDGE:
                st.switch_aggregates += 1
            else:
                st.raw += 1
            if h.flags & FLAG_COLLISION:
                st.collisions += 1
                p.collision = True
            if h.flags & FLAG_ECN:
                p.ecn = True
            p.have |= contrib
            if p.have != js.full:
                return []
            del js.pending[seq]
            result = p.int_sum / cfg.scale
            with np.errstate(over="ignore", invalid="ignore"):   # (float32 overflow: inf, as the C core)
                if p.float_sum is not None:
                    result += p.float_sum
                param_values = result.astype(">f4").tobytes()
            flags = FLAG_ACK | (FLAG_ECN if p.ecn else 0) | (FLAG_COLLISION if p.collision else 0)
            fan0 = min(js.rack_size, cfg.world)
            head = encode_header(js.rack_masks[0], (1 << len(js.rack_masks)) - 1, fan0, len(js.rack_masks),
                                 flags, p.agg_index, h.job_seq)
            param = head + param_values
            js.completed[seq] = param
            while len(js.completed) > cfg.keep:
                js.completed.popitem(last=False)
            st.completed += 1
            out = [(cfg.switch_addr, param)] if cfg.switch_addr else []
            out.extend((a, param) for a in js.direct.values())
            if len(js.pending) > cfg.keep:
                self._expire(js, now)
            return out

    @staticmethod
    def _expire(js: _JobState, now: float) -> None:
        old = [s for s, p in js.pending.items() if now - p.t0 > _PENDING_TTL]
        for s in old:
            del js.pending[s]
        if old:
            log.warning("job %d: %d fragments never completed and were dropped", js.cfg.job_id, len(old))

    def process_batch(self, rows: np.ndarray, lengths: np.ndarray, keys: np.ndarray,
                      now: float) -> list[tuple[tuple[str, int], bytes]]:
        """Received packets (rows of a uint8 matrix, their int64 lengths and uint64 sender keys, as
        ``RowIO.recv`` fills them) in order, through this server's packet path; the datagrams to send,
        as ``handle`` returns them (in C mode one call into the core)."""
        if self._c is None:
            return handle_batch(self, rows, lengths, keys, now).datagrams()
        with self._lock:
            outs = self._c.process(rows, lengths, keys, now)
            events = self._fold()
        self._c.log_events(events)
        return [(self._c.addr(k), d) for k, d in outs]

    def _fold(self) -> list[tuple[int, int, int, int, int]]:
        """Add the C core's counters to ``dropped``, ``rejected`` and the transport's; its events to log.
        Call with the lock held."""
        assert self._c is not None
        (dropped, rejected, sent, refused), events = self._c.take()
        self.dropped += dropped
        self.rejected += rejected
        self.transport.sent += sent
        self.transport.refused += refused
        return events

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        """Receive and answer packets until stopped; then close the socket. Batched: up to ``_BATCH``
        datagrams per receive call. With the C core, ``CPSCore.serve`` waits, receives, processes and
        sends batches without the GIL (with loss injection: ``RowIO`` receives, the core processes,
        ``UdpTransport.send`` sends); else they go into preallocated rows, ``innet.ps_batch.handle_batch``
        (same semantics as ``handle`` per packet), all outputs in one send call."""
        if self._c is not None:
            self._run_c(self._c)
            return
        tr = self.transport
        io = RowIO(tr)
        try:
            for rows, lengths, keys in self._batches(io):
                mat, order, dest = handle_batch(self, rows, lengths, keys, time.monotonic()).arrays()
                if len(order):
                    io.send(mat, order, self.packet_size, dest)
        finally:
            tr.close()

    def _batches(self, io: RowIO) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Received batches ``(rows, lengths, sender keys)`` until stopped: up to ``_BATCH`` datagrams
        per receive call into preallocated rows (one byte wider than a packet: an oversize datagram shows
        as too long), up to 64 calls per wake-up. Each batch's arrays are reused by the next."""
        rx = np.zeros((_BATCH, self.packet_size + 1), np.uint8)
        lengths = np.zeros(_BATCH, np.int64)
        keys = np.zeros(_BATCH, np.uint64)
        while not self._stop.is_set():
            r, _, _ = select.select([io.transport.sock], [], [], 0.05)
            if not r:
                continue
            for _ in range(64):
                got = io.recv(rx, lengths, keys, _BATCH)
                if not got:
                    break
                yield rx[:got], lengths[:got], keys[:got]

    def _run_c(self, core: CPSCore) -> None:
        tr = self.transport
        fd = tr.fileno()
        if tr.loss.active:                             # loss injection needs UdpTransport.send
            self._run_c_lossy(core)
            return
        try:
            while not self._stop.is_set():
                # waits up to 50 ms, then up to 64 batches, without the GIL (the core has its own lock)
                if core.serve(fd, _BATCH, 0.05):
                    with self._lock:
                        events = self._fold()
                    if events:
                        core.log_events(events)
        finally:
            tr.close()

    def _run_c_lossy(self, core: CPSCore) -> None:
        tr = self.transport
        try:
            for rows, lengths, keys in self._batches(RowIO(tr)):
                with self._lock:
                    outs = core.process(rows, lengths, keys, time.monotonic())
                    events = self._fold()
                for key, data in outs:
                    if key < NAME_KEYS:
                        tr.send(data, key_addr(key))
                if events:
                    core.log_events(events)
        finally:
            tr.close()


class PSThread(ServerThread):
    """A parameter server running in a daemon thread (tests, demos); a context manager."""

    def __init__(self, bind: tuple[str, int] = ("127.0.0.1", 0), value_count: int = DEFAULT_VALUE_COUNT,
                 *, loss: LossConfig | None = None, core: str | None = None) -> None:
        self.server = ParameterServer(bind, value_count, loss=loss, core=core)
        super().__init__(self.server, "atp-ps")


def job_config_from_dict(d: Mapping[str, Any]) -> PSJobConfig:
    """A PSJobConfig from a JSON object {job_id, world, scale, switch: [host, port], rack_size, keep,
    workers: [[host, port], ...]}."""
    sw = d.get("switch")
    return PSJobConfig(int(d["job_id"]), int(d["world"]), float(d["scale"]),
                       (str(sw[0]), int(sw[1])) if sw else None,
                       int(d["rack_size"]) if d.get("rack_size") else None, int(d.get("keep", 4096)),
                       tuple((str(h), int(p)) for h, p in d.get("workers", ())))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI (``twisternet ps``): ``--port P --values V --config JSON`` ({"jobs": [...]}, file or inline);
    ``--control-port C --control-token-file F`` also takes jobs at run time (``innet.ps_control``)."""
    ap = argparse.ArgumentParser(prog="twisternet ps", description="ATP parameter server (UDP)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--values", type=int, default=DEFAULT_VALUE_COUNT)
    ap.add_argument("--config", default=None, help='JSON {"jobs": [{job_id, world, scale, switch, ...}]}')
    ap.add_argument("--control-port", type=int, default=None,
                    help="serve job placement on this TCP port (innet.ps_control; needs --control-token-file)")
    ap.add_argument("--control-token-file", default=None, metavar="PATH",
                    help="file whose first line is the token every control request must carry")
    ap.add_argument("--lifeline", action="store_true", help="exit when stdin reaches end of file")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this parent process is gone")
    ap.add_argument("--parent-death-signal", action="store_true",
                    help="also ask the kernel for SIGTERM when the parent dies (PR_SET_PDEATHSIG)")
    ap.add_argument("--core", choices=("auto", "c", "python"), default=None,
                    help="packet path: the compiled core (c), the Python reference, or auto (default: "
                         "$TWISTERNET_INNET_PS_CORE, else auto)")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server = ParameterServer((args.host, args.port), args.values, core=args.core)
    except PSCoreUnavailable as e:
        ap.error(str(e))
    if args.config:
        text = args.config
        if os.path.exists(text):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        try:
            for j in json.loads(text).get("jobs", ()):
                server.add_job(job_config_from_dict(j))
        except (KeyError, TypeError, ValueError) as e:
            ap.error(f"bad --config: {e}")
    control = None
    if args.control_port is not None:
        if args.control_token_file is None:
            ap.error("--control-port needs --control-token-file")
        from .ps_control import PSControlServer
        from .tokens import read_token_file
        try:
            control = PSControlServer(server, args.host, args.control_port,
                                      read_token_file(args.control_token_file))
        except (OSError, ValueError) as e:
            ap.error(f"--control-port: {e}")
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    from .switch_server import start_lifelines
    start_lifelines(args, server.stop)
    host, port = server.address
    sys.stdout.write(f"atp ps listening on udp {host}:{port}\n")
    if control is not None:
        sys.stdout.write(f"ps control on {control.address[0]}:{control.address[1]}\n")
    sys.stdout.flush()
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if control is not None:
            control.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
