"""The ATP worker: quantize, fragment, send with a congestion window, retransmit, collect the parameters.

A tensor becomes ``ceil(n / V)`` fragments (``V`` = values per packet); fragment ``i`` of a call gets the
job-wide sequence number ``base + i`` (``base`` advances by the fragment count of every call, so all
workers of a job, calling ``allreduce`` in the same order with the same sizes, agree on it).

**Aggregator index.** A fragment's ``aggregatorIndex`` must be the same at every worker. The window is
at most ``max_window`` (= D) fragments, so when seq ``s`` is sent, seq ``s - D`` is acknowledged: ``s``
reuses the *slot* ``s mod D``. Its index is ``(hash(job) + s) mod N`` for the first use of a slot, then the
index of ``s - D``, re-hashed when the PS's parameter packet of ``s - D`` carried ``collision`` (the PS's
answer to a collision: move the slot to another aggregator). Every worker sees the same parameter packet,
so every worker picks the same index. ``N`` (``num_aggregators``) must equal the switch's.

**Window.** ``cwnd`` bounds the fragments in flight. AIMD: slow start (+1 per ACK) up to ``max_window``,
then +1 per window of ACKs; halved (at most once per round-trip) on a parameter packet carrying ``ecn``.
The window never exceeds ``max_window`` nor ``window_cap`` (what the receive buffers hold: a larger
window only loses packets), and no fragment is sent ``max_window`` or more ahead of the oldest
unacknowledged one. A call starts with the window the previous one ended with (``keep_window``).

**Batches.** Each pass sends all the fragments the window admits in one call and receives everything
queued in one call (``innet.hostio.RowIO``: ``recvmmsg``/``sendmmsg`` when the C helper is built); the
received results are checked and applied as arrays. ACKs of one batch count as arriving together: one
RTT sample (the oldest fresh fragment's), at most one ECN halving, the window grown by the batch's
unmarked ACKs.

**Loss recovery.** A fragment unacknowledged after the RTO (Jacobson estimate, exponential back-off per
fragment, capped at ``2**max_backoff_exponent`` times the RTO) or overtaken by ``reorder_threshold``
later ACKs is retransmitted with ``resend`` set; a loss halves the window once per loss episode (until
every fragment in flight at the time of the decrease is acknowledged), as in TCP's fast recovery.
Duplicate and stale ACKs are ignored. A decrease is taken back (as TCP's undo of a spurious
retransmission) when every fragment retransmitted with it comes back with the collision flag: a
fragment that met another job's aggregator takes the longer way through the PS, and one worker's
packet may have gone there while another's waits in a slot it reserved after the other job left,
until a resend flushes it. Such a fragment is late, not lost; the path is not congested. An ECN mark
arriving before the undo cancels it: the path is congested after all, and the decrease stands. Nor is the
threshold fixed: a fast retransmission proven spurious that way raises it (``AtpWorker.reorder``) to the
number of later results seen while the fragment was open, plus one (at most the window cap), so the
PS's longer way stops passing for a loss, as TCP adapts its reordering degree; a retransmission timeout
puts it back to ``reorder_threshold``.

**Fate sharing.** If the switch is gone (ICMP port unreachable on the socket connected to it, or no ACK
for ``fallback_timeout`` seconds) the worker sends every unacknowledged fragment, and all later ones,
straight to the PS; ``WorkerStats.fallback`` says so. The fallback lasts for the rest of the job (later
calls do not wait ``fallback_timeout`` again) until the switch proves alive: the PS sends every result
to the switch as well, so a result that arrives through the switch (the passive probe) puts the worker
back on the switch from its next call.
"""

from __future__ import annotations

import logging
import select
import time
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np

from twisternet.errors import OperationTimeout

from .fragments import FragmentPackets, aggregator_indices, decode_headers, rehash_indices
from .hostio import RowIO, addr_key, socket_buffer_window
from .quantize import Quantizer
from .transport import ROLE_WORKER, LossConfig, UdpTransport
from .wire import (DEFAULT_VALUE_COUNT, FLAG_ACK, FLAG_COLLISION, FLAG_ECN, HEADER_SIZE, MAX_FAN_IN,
                   MAX_JOB_ID, SEQ_BITS, SEQ_MASK, WireError, decode_header, encode_flags, packet_size)

__all__ = ["WorkerStats", "AtpWorker", "aggregator_index", "rehash_index"]

log = logging.getLogger(__name__)

def _mix32(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def aggregator_index(job_id: int, seq: int, num_aggregators: int) -> int:
    """The first-use aggregator index of sequence number ``seq`` of job ``job_id``.

    Consecutive from a per-job hashed offset, so one job's window never collides with itself when the
    switch has at least ``max_window`` aggregators.
    """
    return (_mix32(job_id) + (seq & SEQ_MASK)) % num_aggregators


def rehash_index(index: int, seq: int, num_aggregators: int) -> int:
    """The index a slot moves to after a collision on ``index``."""
    return _mix32(index * 0x9E3779B1 + seq + 1) % num_aggregators


@dataclass
class WorkerStats:
    """What one ``allreduce`` call of a worker did."""

    fragments: int = 0
    packets_sent: int = 0
    retransmits: int = 0
    timeouts: int = 0
    fast_retransmits: int = 0
    ecn_signals: int = 0
    duplicate_acks: int = 0
    stale_acks: int = 0
    rejected_acks: int = 0         # datagrams that cannot be a result of this job (source, header)
    collided_fragments: int = 0
    collision_undos: int = 0       # window decreases taken back: the "lost" fragments were collided, not lost
    reorder_raises: int = 0        # fast retransmits proven spurious (collided) that raised the threshold
    reorder_threshold: int = 0     # the fast-retransmit threshold the call ended with
    overflow_fragments: int = 0
    fallback: bool = False
    fallback_reason: str = ""
    min_window: float = 0.0
    final_window: float = 0.0
    peak_inflight: int = 0         # most fragments in flight at once (never above AtpWorker.window_cap)
    elapsed: float = 0.0


class AtpWorker:
    """One worker of an ATP job: owns a UDP socket (connected to its switch) and the job's sequence space."""

    def __init__(self, job_id: int, rank: int, world: int, switch_addr: tuple[str, int] | None,
                 ps_addr: tuple[str, int], *, value_count: int = DEFAULT_VALUE_COUNT,
                 num_aggregators: int = 4096, scale: float = 2.0**20, rack_size: int | None = None,
                 max_window: int = 128, initial_window: int = 8, reorder_threshold: int = 8,
                 rto_initial: float = 0.2, rto_min: float = 0.03, rto_max: float = 1.0,
                 max_backoff_exponent: int = 2, keep_window: bool = True,
                 fallback_timeout: float = 10.0, timeout: float = 300.0, loss: LossConfig | None = None,
                 bind: tuple[str, int] = ("127.0.0.1", 0), hostio: str | None = None) -> None:
        if not 1 <= job_id <= MAX_JOB_ID:
            raise ValueError(f"job_id must be in 1..{MAX_JOB_ID}, got {job_id}")
        rs = rack_size or world
        if not 1 <= rs <= MAX_FAN_IN or not 1 <= world <= rs * MAX_FAN_IN:
            raise ValueError(f"world {world} / rack size {rs}: at most {MAX_FAN_IN} workers per rack and "
                             f"{MAX_FAN_IN} racks")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
        if not 1 <= num_aggregators <= 1 << 16:
            raise ValueError(f"num_aggregators must be in 1..65536, got {num_aggregators}")
        if not 1 <= max_window <= 1 << 16:
            raise ValueError(f"max_window must be in 1..65536, got {max_window}")
        self.job_id, self.rank, self.world = job_id, rank, world
        self.rack_size = rs
        self.rack, self.index_in_rack = divmod(rank, rs)
        racks = -(-world // rs)
        self.fan_in0 = min(rs, world - self.rack * rs)
        self.fan_in1 = racks
        self.bitmap0 = 1 << self.index_in_rack
        self.bitmap1 = 1 << self.rack
        # what the PS puts in every parameter packet: the first rack's workers, every rack
        self._ack_bitmap0 = (1 << min(rs, world)) - 1
        self._ack_bitmap1 = (1 << racks) - 1
        self.switch_addr = switch_addr
        self.ps_addr = ps_addr
        self.value_count = int(value_count)
        self.packet_size = packet_size(self.value_count)
        self.num_aggregators = int(num_aggregators)
        self.quantizer = Quantizer(scale, world)
        self.max_window = int(max_window)
        self.initial_window = max(1, min(int(initial_window), self.max_window))
        self.reorder_threshold = int(reorder_threshold)
        #: the fast-retransmit threshold in use: raised to the overtaking seen on a fragment whose fast
        #: retransmission proved spurious (it came back collided), back to ``reorder_threshold`` on a
        #: retransmission timeout (as TCP adapts its reordering degree)
        self.reorder = self.reorder_threshold
        self.rto_min, self.rto_max = float(rto_min), float(rto_max)
        self.rto_initial = float(rto_initial)
        self.max_backoff_exponent = int(max_backoff_exponent)
        #: start each call with the window (and threshold) the last one ended with
        self.keep_window = bool(keep_window)
        self._carried: tuple[float, float, bool] | None = None    # (cwnd, ssthresh, via the PS)
        self.fallback_timeout = float(fallback_timeout)
        self.timeout = float(timeout)
        self.loss = loss
        self._seed = (loss.seed if loss else 0) * 7919 + rank
        lc = LossConfig(loss.gradient, loss.aggregate, loss.parameter, self._seed) if loss else None
        self.transport = UdpTransport(bind, role=ROLE_WORKER, loss=lc)
        if switch_addr is not None:
            self.transport.sock.connect(switch_addr)
        # the socket for the PS fallback exists from the start, so the PS can be told its address (a PS
        # accepts a worker's packets only from the address registered for that rank)
        self._direct = UdpTransport((self.transport.address[0], 0), role=ROLE_WORKER, loss=lc,
                                    connect=ps_addr)
        # parameter packets are accepted only from the switch and the PS (both sockets are connected,
        # so the kernel filters other senders too; this also covers a worker without a switch)
        self._ps_source = self._direct.sock.getpeername()[:2]
        self._sources = {self._ps_source}
        self._switch_source = None if switch_addr is None else self.transport.sock.getpeername()[:2]
        if self._switch_source is not None:
            self._sources.add(self._switch_source)
        self.switch_dead = switch_addr is None
        self._switch_answered = False
        self._next_seq = 0
        self._slot_index = np.full(self.max_window, -1, np.int64)
        self._slot_collided = np.zeros(self.max_window, np.bool_)
        self._srtt: float | None = None
        # batched I/O: results are received into preallocated rows (one byte wider than a packet, so
        # an oversize datagram shows as too long), fragments sent from FragmentPackets rows
        # hostio: auto / c / python (the job's innet_hostio), None: TWISTERNET_INNET_HOSTIO
        self._io, self._dio = RowIO(self.transport, mode=hostio), RowIO(self._direct, mode=hostio)
        self._ps_key = addr_key(self._ps_source)
        self._source_keys = np.array([addr_key(a) for a in self._sources], np.uint64)
        self._packets: FragmentPackets | None = None
        #: the most fragments in flight: every result queued at once must fit the receive buffer, and
        #: so must every rank's fragments at the switch (sized as this socket's buffer)
        self.window_cap = min(self.max_window,
                              socket_buffer_window(self.transport.sock, self.packet_size, self.world))
        # room for a window of results and duplicates; more queued is read on the next pass
        drain = 2 * self.window_cap + 256
        self._rx = np.zeros((drain, self.packet_size + 1), np.uint8)
        self._rx_len = np.zeros(drain, np.int64)
        self._rx_addr = np.zeros(drain, np.uint64)
        self._rttvar = 0.0
        self.last_stats: WorkerStats | None = None
        #: fragments of the current (or last) call acknowledged so far: progress for monitoring
        self.acked_fragments = 0

    @property
    def address(self) -> tuple[str, int]:
        """The UDP address the switch must map this worker's port to."""
        return self.transport.address

    @property
    def direct_address(self) -> tuple[str, int]:
        """The UDP address this worker sends from when it bypasses the switch (register it at the PS)."""
        return self._direct.address

    def close(self) -> None:
        self.transport.close()
        self._direct.close()

    # ------------------------------------------------------------------ helpers
    def _rto(self) -> float:
        if self._srtt is None:
            return self.rto_initial
        return min(self.rto_max, max(self.rto_min, self._srtt + 4 * self._rttvar))

    def _rtt_sample(self, r: float) -> None:
        if self._srtt is None:
            self._srtt, self._rttvar = r, r / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - r)
            self._srtt = 0.875 * self._srtt + 0.125 * r

    def _index_for(self, gseq: int) -> int:
        slot = gseq % self.max_window
        prev = int(self._slot_index[slot])
        if prev < 0:
            idx = aggregator_index(self.job_id, gseq, self.num_aggregators)
        elif self._slot_collided[slot]:
            idx = rehash_index(prev, gseq, self.num_aggregators)
        else:
            idx = prev
        self._slot_index[slot] = idx
        self._slot_collided[slot] = False
        return idx

    def _drain_switch_socket(self) -> None:
        """Read what waits on the switch socket; a parameter packet of this job from the switch means
        it is alive again (the PS sends every result through it as well)."""
        if self._switch_source is None:
            return
        for data, src in self.transport.recv_batch(1024):
            if src != self._switch_source or len(data) != self.packet_size:
                continue
            try:
                h = decode_header(data)
            except WireError:
                continue
            if h.flags & FLAG_ACK and h.job_id == self.job_id:
                self._switch_answered = True

    def _go_direct(self, reason: str, stats: WorkerStats) -> None:
        stats.fallback = True
        stats.fallback_reason = reason
        log.warning("job %d worker %d: falling back to the PS at %s (%s)", self.job_id, self.rank,
                    self.ps_addr, reason)

    # ------------------------------------------------------------------ the protocol
    def _packets_for(self, nfrag: int) -> FragmentPackets:
        pk = self._packets
        if pk is None or pk.nfrag != nfrag:
            pk = self._packets = FragmentPackets(nfrag, self.value_count)
        return pk

    def _indices_for(self, gseqs: np.ndarray) -> np.ndarray:
        """``_index_for`` of consecutive sequence numbers (at most ``max_window``: distinct slots)."""
        slots = gseqs % self.max_window
        prev = self._slot_index[slots]
        fresh = aggregator_indices(self.job_id, gseqs, self.num_aggregators)
        moved = rehash_indices(np.maximum(prev, 0), gseqs, self.num_aggregators)
        idx = np.where(prev < 0, fresh, np.where(self._slot_collided[slots], moved, prev))
        self._slot_index[slots] = idx
        self._slot_collided[slots] = False
        return idx

    def _receive(self) -> int:
        """Drain both sockets into the receive rows; the count."""
        got = self._io.recv(self._rx, self._rx_len, self._rx_addr, len(self._rx))
        return got + self._dio.recv(self._rx[got:], self._rx_len[got:], self._rx_addr[got:],
                                    len(self._rx) - got)

    # Complexity accepted: the worker window loop: send, receive, resend.
    def allreduce_sum(self, array: np.ndarray, *, timeout: float | None = None,  # noqa: C901
                      abort: Callable[[], None] | None = None) -> tuple[np.ndarray, WorkerStats]:
        """Sum ``array`` over all workers of the job; returns (float32 result, stats).

        float64 input is quantized from float64 (``Quantizer.quantize_fragments``); anything else as
        float32. ``timeout`` (default: the worker's ``timeout``) bounds the call: OperationTimeout past
        it. ``abort`` is called about every 50 ms while waiting; whatever it raises (e.g. PeerLostError
        when a rank of the job died) ends the call at once.

        Batched: a window's new fragments go out in one send call, everything queued is received in
        one call into preallocated rows and checked and applied as a whole (``_receive``)."""
        t_start = time.monotonic()
        limit = self.timeout if timeout is None else float(timeout)
        dtype = np.float64 if np.asarray(array).dtype == np.float64 else np.float32
        x = np.ascontiguousarray(array, dtype=dtype).reshape(-1)
        n = x.size
        V = self.value_count
        psize = self.packet_size
        nfrag = -(-n // V)
        stats = WorkerStats(fragments=nfrag)
        if nfrag == 0:
            self.last_stats = stats
            return np.zeros(np.shape(array), np.float32), stats
        base = self._next_seq
        self._next_seq += nfrag
        pk = self._packets_for(nfrag)
        ovf = pk.fill(x, self.quantizer, bitmap0=self.bitmap0, bitmap1=self.bitmap1,
                      flags_word=encode_flags(self.fan_in0, self.fan_in1, 0),
                      job_seq0=(self.job_id << 24) | (base & SEQ_MASK))
        stats.overflow_fragments = int(ovf.sum())
        result = np.empty((nfrag, V), np.float32)
        acked = np.zeros(nfrag, np.bool_)
        send_time = np.zeros(nfrag, np.float64)
        tries = np.zeros(nfrag, np.int32)
        later_acks = np.zeros(nfrag, np.int32)
        overtaken = np.zeros(nfrag, np.int32)      # later results seen while a fragment was open
        fast_sent = np.zeros(nfrag, np.bool_)      # fast-retransmitted
        indices = np.zeros(nfrag, np.int64)
        self.acked_fragments = 0
        if self.switch_dead and self.switch_addr is not None and not self._switch_answered:
            self._drain_switch_socket()          # results of the last call that came late
        if self.switch_dead and self._switch_answered and self.switch_addr is not None:
            # in the last call the PS's copies of the results came back through the switch: it is alive
            log.info("job %d worker %d: the switch answers again; using it", self.job_id, self.rank)
            self.switch_dead = False
        self._switch_answered = False
        use_direct = self.switch_dead
        if use_direct:
            self._go_direct("switch unreachable earlier in this job", stats)

        # the window a call ended with is where the next one starts (the path's measured capacity;
        # a call must not pay slow start again), if the next one takes the same path (switch or PS)
        cwnd, ssthresh = float(self.initial_window), float(self.max_window)
        if self._carried is not None and self._carried[2] == use_direct:
            cwnd, ssthresh = self._carried[0], self._carried[1]
        stats.min_window = cwnd
        last_decrease = -1.0
        lowest = 0
        nxt = 0
        last_progress = time.monotonic()
        next_timeout_pass = 0.0
        recover_point = 0      # loss-driven decreases: one per loss episode (until this fragment is acked)
        # the window before the last loss-driven decrease, and the fragments it retransmitted: all of
        # them acknowledged with the collision flag -> the decrease is taken back
        undo: tuple[float, float] | None = None
        suspects = np.zeros(nfrag, np.bool_)
        n_suspects = 0

        def decrease() -> None:
            """A loss signal: halve the window (once per episode) and start a new undo episode."""
            nonlocal undo, n_suspects, cwnd, ssthresh, recover_point
            undo, n_suspects = (cwnd, ssthresh), 0
            suspects[:] = False
            ssthresh = cwnd = max(1.0, cwnd / 2)
            recover_point = nxt
            stats.min_window = min(stats.min_window, cwnd)

        def suspect(rows: np.ndarray) -> None:
            """``rows`` are retransmitted in the current undo episode."""
            nonlocal n_suspects
            if undo is not None:
                n_suspects += int(np.count_nonzero(~suspects[rows]))
                suspects[rows] = True
        refused0 = self.transport.refused
        ack_b0, ack_b1, job_id = self._ack_bitmap0, self._ack_bitmap1, self.job_id
        ps_key = self._ps_key

        def send(rows: np.ndarray, resend: bool) -> None:
            if resend:
                pk.mark_resend(rows)
                stats.retransmits += len(rows)
            (self._dio if use_direct else self._io).send(pk.rows, rows, psize)
            send_time[rows] = time.monotonic()
            tries[rows] += 1
            stats.packets_sent += len(rows)

        while lowest < nfrag:
            now = time.monotonic()
            if now - t_start > limit:
                raise OperationTimeout(f"innet allreduce of job {self.job_id} (worker {self.rank}): "
                                       f"{int(nfrag - acked.sum())} of {nfrag} fragments unacknowledged",
                                       operation="innet_allreduce", timeout=limit)
            if abort is not None:
                abort()
            # --- fate sharing: is the switch gone?
            if not use_direct:
                reason = ""
                if self.transport.refused > refused0:
                    reason = "switch port unreachable (ICMP)"
                elif now - last_progress > self.fallback_timeout:
                    reason = f"no parameter packet for {self.fallback_timeout:g} s"
                if reason:
                    # for the rest of the job (later calls do not wait fallback_timeout again), until
                    # results come back through the switch again (the PS always sends it a copy)
                    self.switch_dead = True
                    self._go_direct(reason, stats)
                    use_direct = True
                    send(np.nonzero(~acked[lowest:nxt])[0] + lowest, True)
                    last_progress = now
            # --- send new fragments within the window
            # the window bounds the fragments in flight (sent, unacknowledged); a fragment that waits
            # for recovery does not block the others, but no fragment may run max_window ahead of the
            # oldest unacknowledged one (its aggregator slot must have been released). The window never
            # exceeds what the receive buffers hold (window_cap): a larger one only loses packets.
            send_limit = min(nfrag, lowest + self.max_window)
            inflight = (nxt - lowest) - int(np.count_nonzero(acked[lowest:nxt]))
            room = min(send_limit - nxt, int(min(cwnd, self.window_cap)) - inflight)
            if room > 0:
                indices[nxt:nxt + room] = self._indices_for(np.arange(base + nxt, base + nxt + room))
                pk.set_indices(slice(nxt, nxt + room), indices[nxt:nxt + room])
                send(np.arange(nxt, nxt + room), False)
                nxt += room
                stats.peak_inflight = max(stats.peak_inflight, inflight + room)
            # --- wait for parameter packets
            rto = self._rto()
            seg = slice(lowest, nxt)
            open_ = ~acked[seg]
            wait = 0.05
            if open_.any():
                deadlines = send_time[seg][open_] + rto * np.exp2(
                    np.minimum(tries[seg][open_] - 1, self.max_backoff_exponent))
                first = max(float(deadlines.min()), next_timeout_pass)
                wait = max(0.0, min(0.05, first - time.monotonic()))
            select.select([self.transport.sock, self._direct.sock], [], [], wait)
            # drain everything queued (a window's worth of results can wait after a stall of this
            # process): a result left unread would look like a loss to the timeout pass below
            got = self._receive()
            now = time.monotonic()
            if got:
                rows = self._rx[:got]
                addr = self._rx_addr[:got]
                known = addr == self._source_keys[0]       # (one or two sources: np.isin costs 15x)
                for k in self._source_keys[1:]:
                    known |= addr == k
                ok = (self._rx_len[:got] == psize) & known
                hdr = decode_headers(rows)
                job_seq = hdr["job_seq"].astype(np.int64)
                ok &= (job_seq >> SEQ_BITS) != 0                          # a garbled header
                stats.rejected_acks += int(np.count_nonzero(~ok))
                flags = hdr["flags"].astype(np.int64)
                mine = ok & (flags & FLAG_ACK != 0) & ((job_seq >> SEQ_BITS) == job_id)
                stats.stale_acks += int(np.count_nonzero(ok & ~mine))
                whole = mine & (hdr["bitmap0"] == ack_b0) & (hdr["bitmap1"] == ack_b1)
                stats.rejected_acks += int(np.count_nonzero(mine & ~whole))  # not the whole world's sum
                i_all = (job_seq - base) & SEQ_MASK
                live = whole & (i_all < nxt)
                stats.stale_acks += int(np.count_nonzero(whole & ~live))
                i_clip = np.where(live, i_all, 0)
                right = live & (hdr["agg_index"].astype(np.int64) == indices[i_clip])
                stats.rejected_acks += int(np.count_nonzero(live & ~right))  # not this fragment's aggregator
                fresh = right & ~acked[i_clip]
                stats.duplicate_acks += int(np.count_nonzero(right & ~fresh))
                cand = np.nonzero(fresh)[0]
                new_i, first = np.unique(i_all[cand], return_index=True)    # sorted, first arrival of each
                stats.duplicate_acks += len(cand) - len(new_i)
                if len(new_i):
                    r = cand[first]
                    if use_direct and bool((self._rx_addr[r] != ps_key).any()):
                        self._switch_answered = True          # a result through the switch: it is back
                    acked[new_i] = True
                    self.acked_fragments += len(new_i)
                    values = rows[:, HEADER_SIZE:psize].view(">f4")
                    lo, hi_i = int(new_i[0]), int(new_i[-1]) + 1
                    if hi_i - lo == len(new_i) and bool((np.diff(r) == 1).all()):
                        result[lo:hi_i] = values[int(r[0]):int(r[-1]) + 1]   # in order: one pass, no gather
                    else:
                        result[new_i] = values[r]
                    last_progress = now
                    fl = flags[r]
                    coll = (fl & FLAG_COLLISION) != 0
                    if coll.any():
                        self._slot_collided[(base + new_i[coll]) % self.max_window] = True
                        stats.collided_fragments += int(coll.sum())
                    ecn = (fl & FLAG_ECN) != 0
                    n_ecn = int(ecn.sum())
                    if n_ecn:
                        undo = None                          # congestion confirmed: a decrease stands
                    if undo is not None:
                        sus = suspects[new_i]
                        if sus.any():
                            suspects[new_i[sus]] = False
                            n_suspects -= int(sus.sum())
                            if not coll[sus].all():
                                undo = None                  # one came back the switch's way: lost
                            elif n_suspects == 0:
                                cwnd, ssthresh = max(cwnd, undo[0]), max(ssthresh, undo[1])
                                undo = None
                                stats.collision_undos += 1
                    spurious = coll & fast_sent[new_i]
                    if spurious.any():     # overtaken by the PS's longer path, not lost: tolerate as much
                        seen = int(overtaken[new_i[spurious]].max()) + 1
                        if seen > self.reorder:
                            self.reorder = min(seen, self.max_window)
                            stats.reorder_raises += 1
                    first_try = tries[new_i] == 1
                    if first_try.any():                         # the slowest fresh sample: no spurious RTO
                        self._rtt_sample(float(now - send_time[new_i[first_try]].min()))
                    if n_ecn:
                        stats.ecn_signals += n_ecn
                        if now - last_decrease > (self._srtt or self.rto_initial):
                            ssthresh = cwnd = max(1.0, cwnd / 2)
                            last_decrease = now
                            stats.min_window = min(stats.min_window, cwnd)
                    cwnd = _grow(cwnd, ssthresh, len(new_i) - n_ecn, float(self.max_window))
                    hi = int(new_i[-1])
                    if hi > lowest and self.reorder_threshold > 0:
                        seg = slice(lowest, hi)
                        open_ = ~acked[seg]
                        later = len(new_i) - np.searchsorted(new_i, np.arange(lowest, hi), "right")
                        more = np.where(open_, later, 0).astype(np.int32)
                        later_acks[seg] += more
                        overtaken[seg] += more
                        hit = np.nonzero(open_ & (later_acks[seg] >= self.reorder))[0]
                        if hit.size and lowest >= recover_point:
                            decrease()                                # loss signal: multiplicative decrease
                        if hit.size:
                            again = hit[:max(1, int(cwnd))] + lowest
                            suspect(again)
                            later_acks[again] = 0
                            fast_sent[again] = True
                            stats.fast_retransmits += len(again)
                            send(again, True)
                    if acked[lowest]:
                        gap = np.nonzero(~acked[lowest:])[0]
                        lowest = nfrag if not gap.size else lowest + int(gap[0])
            # --- retransmit on timeout. Each fragment has its own timer with a capped exponential
            # back-off, so retransmissions never exceed about a window per RTO; the window is halved
            # once per loss episode (a loss is a congestion signal, if a weaker one than ECN).
            if lowest < nxt and now >= next_timeout_pass:
                seg = slice(lowest, nxt)
                backoff = rto * np.exp2(np.minimum(tries[seg] - 1, self.max_backoff_exponent))
                late = np.nonzero(~acked[seg] & (now - send_time[seg] > backoff))[0]
                if late.size:
                    if lowest >= recover_point:
                        decrease()
                    suspect(late + lowest)
                    stats.timeouts += len(late)
                    self.reorder = self.reorder_threshold
                    later_acks[late + lowest] = 0
                    send(late + lowest, True)
                next_timeout_pass = now + self.rto_min / 2
        stats.final_window = cwnd
        stats.reorder_threshold = self.reorder
        self._carried = (cwnd, ssthresh, use_direct) if self.keep_window else None
        stats.elapsed = time.monotonic() - t_start
        self.last_stats = stats
        if stats.fallback:
            log.warning("job %d worker %d: allreduce completed via PS fallback (%s)", self.job_id,
                        self.rank, stats.fallback_reason)
        return result.reshape(-1)[:n].reshape(np.shape(array)), stats


def _grow(cwnd: float, ssthresh: float, acks: int, max_window: float) -> float:
    """The window after ``acks`` unmarked ACKs: +1 each in slow start (below ``ssthresh``), then about
    +1/cwnd each (``cwnd**2`` grows by 2 per ACK), never above ``max_window``."""
    if acks <= 0:
        return cwnd
    if cwnd < ssthresh:
        step = min(acks, max(1, int(np.ceil(ssthresh - cwnd))))
        cwnd += step
        acks -= step
    if acks > 0:
        cwnd = float(np.sqrt(cwnd * cwnd + 2.0 * acks))
    return min(cwnd, max_window)
