"""The parameter server's batched packet function: a whole receive batch per call.

``handle_batch`` gives the same outputs, in the same order, and the same state and statistics as
``ParameterServer.handle`` (the per-packet reference) called on each packet in turn. The common packet
of a switch job -- the switch's complete aggregate of a fragment the PS has not seen (from the job's
switch address, the whole world's bitmaps, not an overflow packet, its sequence number neither pending,
completed, nor repeated in the batch) -- needs no per-packet state: runs of such packets are turned
into parameter packets at once (vectorized dequantization and header building); every other packet
goes through ``handle`` in its place in the batch.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from .fragments import decode_headers
from .hostio import addr_key, key_addr
from .wire import (FLAG_ACK, FLAG_COLLISION, FLAG_ECN, FLAG_EDGE, FLAG_OVERFLOW, FLAG_RESEND, HEADER_DTYPE,
                   HEADER_SIZE, SEQ_BITS, SEQ_MASK, encode_flags)

if TYPE_CHECKING:  # pragma: no cover
    from .ps import ParameterServer, _JobState

__all__ = ["BatchOutput", "handle_batch"]

#: A batch with fewer fast-path packets than this goes through ``handle`` packet by packet: the vectorized
#: filters and the parameter-packet building cost ~60-80 us per batch, ``handle`` ~6 us per complete
#: aggregate and ~5 us per collided (single-worker) packet. The PS of a latency-bound job mostly sees
#: such batches (measured on this project's host, see docs/innet-performance.md).
SMALL_BATCH = 12


class BatchOutput:
    """Datagrams to send: rows of ``rows`` (each ``packet_size`` bytes) to ``keys`` (``addr_key``)."""

    def __init__(self, packet_size: int) -> None:
        self.packet_size = packet_size
        self._mats: list[np.ndarray] = []
        self._order: list[np.ndarray] = []
        self._keys: list[np.ndarray] = []
        self._count = 0

    def add(self, mat: np.ndarray, order: np.ndarray, keys: np.ndarray) -> None:
        """Send row ``order[k]`` of ``mat`` to ``keys[k]``, for every k, after what was added before."""
        self._mats.append(mat)
        self._order.append(order + self._count)
        self._keys.append(keys)
        self._count += len(mat)

    def add_bytes(self, outs: list[tuple[tuple[str, int], bytes]]) -> None:
        if outs:
            mat = np.frombuffer(b"".join(d for _, d in outs), np.uint8).reshape(len(outs), self.packet_size)
            self.add(mat, np.arange(len(outs)), np.array([addr_key(a) for a, _ in outs], np.uint64))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(matrix, row numbers, destination keys) in sending order."""
        if not self._mats:
            return (np.zeros((0, self.packet_size), np.uint8), np.zeros(0, np.int64), np.zeros(0, np.uint64))
        return np.concatenate(self._mats), np.concatenate(self._order), np.concatenate(self._keys)

    def datagrams(self) -> list[tuple[tuple[str, int], bytes]]:
        """The outputs as ``handle`` returns them (tests)."""
        mat, order, keys = self.arrays()
        return [(key_addr(int(k)), mat[r].tobytes()) for r, k in zip(order.tolist(), keys.tolist())]


def _switch_key(js: _JobState) -> int | None:
    sw = js.cfg.switch_addr
    if sw is None or sw in js.rank_of:
        return None
    try:
        return addr_key(sw)
    except OSError:               # not an IPv4 address (simulated hosts in tests)
        return None


def _count(js: _JobState, hdr: np.ndarray) -> None:
    """The statistics of ``handle`` for complete switch aggregates with headers ``hdr`` (any order)."""
    st = js.stats
    m = len(hdr)
    fl = hdr["flags"].astype(np.int64)
    st.packets += m
    st.resends += int(np.count_nonzero(fl & FLAG_RESEND))
    edge = int(np.count_nonzero(fl & FLAG_EDGE))
    st.switch_aggregates += edge
    st.raw += m - edge
    st.collisions += int(np.count_nonzero(fl & FLAG_COLLISION))
    st.completed += m


def _params(ps: ParameterServer, js: _JobState, rows: np.ndarray, hdr: np.ndarray) -> np.ndarray:
    """The parameter packets of ``rows``, each a complete switch aggregate of a new fragment of ``js``
    (no state is touched)."""
    cfg = js.cfg
    m = len(rows)
    fl = hdr["flags"].astype(np.int64)
    racks = len(js.rack_masks)
    params = np.empty((m, ps.packet_size), np.uint8)
    head = np.empty(m, HEADER_DTYPE)
    head["bitmap0"] = js.rack_masks[0]
    head["bitmap1"] = (1 << racks) - 1
    head["flags"] = encode_flags(min(js.rack_size, cfg.world), racks, FLAG_ACK) | (fl & (FLAG_ECN | FLAG_COLLISION))
    head["agg_index"] = hdr["agg_index"]
    head["job_seq"] = hdr["job_seq"]
    params[:, :HEADER_SIZE] = head.view(np.uint8).reshape(m, HEADER_SIZE)
    values = rows[:, HEADER_SIZE:ps.packet_size].view(">i4")
    result = params[:, HEADER_SIZE:].view(">f4")
    mant, _ = np.frexp(cfg.scale)
    if mant == 0.5 and 2.0**-100 < cfg.scale < 2.0**100:
        # a power-of-two scale: int32 -> float32 rounds once, the scaling is exact, so this equals
        # the reference's float64 quotient rounded to float32
        np.multiply(values.astype(np.float32), np.float32(1.0 / cfg.scale), out=result)
    else:
        result[...] = values.astype(np.int64) / cfg.scale
    return params


def _keep_and_send(js: _JobState, params: np.ndarray, seqs: list[int], out: BatchOutput) -> None:
    """Keep ``params`` (rows of the fragments ``seqs``) as completed, as ``handle`` does, and send each to
    the switch and to the workers that send directly (as they stand now: a packet before may have
    added one)."""
    cfg = js.cfg
    for k, seq in enumerate(seqs):
        js.completed[seq] = params[k]         # a row of params: the matrix stays alive, no copy
    while len(js.completed) > cfg.keep:
        js.completed.popitem(last=False)
    dests = ([addr_key(cfg.switch_addr)] if cfg.switch_addr else []) + [addr_key(a) for a in js.direct.values()]
    if dests:
        m = len(params)
        out.add(params, np.repeat(np.arange(m), len(dests)), np.tile(np.array(dests, np.uint64), m))


# Complexity accepted: one vectorized filter per condition of the fast path, in the reference's order.
def handle_batch(ps: ParameterServer, rows: np.ndarray, lengths: np.ndarray, keys: np.ndarray,
                 now: float) -> BatchOutput:
    """Process received packets (rows of a uint8 matrix, their lengths and sender keys) in order; the
    datagrams to send (see the module doc)."""
    out = BatchOutput(ps.packet_size)
    n = len(rows)
    if n < SMALL_BATCH:
        _one_by_one(ps, rows, lengths, keys, 0, n, now, out)
        return out
    hdr = decode_headers(rows[:n])
    job_seq = hdr["job_seq"].astype(np.int64)
    jobs = job_seq >> SEQ_BITS
    fl = hdr["flags"].astype(np.int64)
    valid = (lengths[:n] == ps.packet_size) & (jobs != 0)
    fast = valid & (fl & (FLAG_ACK | FLAG_OVERFLOW) == 0)
    with ps._lock:
        states = dict(ps._jobs)
        for job in sorted(set(jobs[fast].tolist())):        # (sets: np.unique costs ~10 us a call)
            js = states.get(job)
            this = fast & (jobs == job)
            sw = None if js is None else _switch_key(js)
            if js is None or sw is None:
                fast &= ~this
                continue
            ok = this & (keys[:n] == np.uint64(sw))
            bits = hdr["bitmap0"].astype(np.int64) << 32 | hdr["bitmap1"].astype(np.int64)
            for pair in set(bits[ok].tolist()):
                if js.contribution(pair >> 32, pair & 0xFFFFFFFF) != js.full:
                    ok &= bits != pair
            if not ok.any():                     # no complete aggregate of this job (collided packets)
                fast &= ~this
                continue
            seqs = job_seq & SEQ_MASK
            known = np.fromiter((s in js.pending or s in js.completed for s in seqs[ok].tolist()), np.bool_,
                                int(ok.sum()))
            ok[np.nonzero(ok)[0][known]] = False
            # a sequence number that occurs twice in the batch: every occurrence goes the reference way
            same_job = np.nonzero(valid & (jobs == job))[0]
            listed = seqs[same_job].tolist()
            counts = Counter(listed)
            if len(counts) < len(listed):
                twice = np.zeros(n, np.bool_)
                twice[same_job[np.fromiter((counts[q] > 1 for q in listed), np.bool_, len(listed))]] = True
                ok &= ~twice
            fast &= ~this | ok
    fast_idx = np.nonzero(fast)[0]
    if len(fast_idx) < SMALL_BATCH:
        _one_by_one(ps, rows, lengths, keys, 0, n, now, out)
        return out
    # every fast packet's parameter packet at once per job (no state touched: a job's fast packets
    # are fragments no other packet of the batch names); then in packet order, runs of fast packets
    # kept and sent as handle() would at their place, everything between them through handle()
    built: dict[int, tuple[np.ndarray, np.ndarray]] = {}          # job -> (parameters, their batch rows)
    with ps._lock:
        for job in sorted(set(jobs[fast_idx].tolist())):
            js = ps._jobs.get(job)
            if js is None:
                continue
            where = fast_idx[jobs[fast_idx] == job]
            _count(js, hdr[where])
            built[job] = (_params(ps, js, rows[where], hdr[where]), where)
    seq_of = (job_seq & SEQ_MASK).tolist()
    job_of = jobs.tolist()
    start = 0
    k = 0
    while start < n:
        if k < len(fast_idx) and fast_idx[k] == start:
            end = start
            while k < len(fast_idx) and fast_idx[k] == end and job_of[end] == job_of[start]:
                end += 1
                k += 1
            job = job_of[start]
            with ps._lock:
                js = ps._jobs.get(job)
                if js is not None and job in built:
                    params, where = built[job]
                    first = int(np.searchsorted(where, start))   # a run is consecutive in the matrix too
                    _keep_and_send(js, params[first:first + end - start], seq_of[start:end], out)
            start = end
            continue
        stop = int(fast_idx[k]) if k < len(fast_idx) else n
        _one_by_one(ps, rows, lengths, keys, start, stop, now, out)
        start = stop
    return out


def _one_by_one(ps: ParameterServer, rows: np.ndarray, lengths: np.ndarray, keys: np.ndarray, start: int,
                stop: int, now: float, out: BatchOutput) -> None:
    """Packets ``start:stop`` through the per-packet reference, their outputs added to ``out`` at once."""
    sends: list[tuple[tuple[str, int], bytes]] = []
    for i, length, key in zip(range(start, stop), lengths[start:stop].tolist(), keys[start:stop].tolist()):
        sends.extend(ps.handle(rows[i, :length].tobytes(), key_addr(key), now))
    out.add_bytes(sends)
