"""The batched ATP dataplane: a whole receive batch through ``SoftwareSwitch`` at once, same semantics.

``process_batch(switch, rows, lengths, in_ports, now, queue_depths)`` gives exactly the outputs, counters
and registers that ``SoftwareSwitch.process`` gives for the same packets one by one, in the same order
(``tests/innet/test_batch_dataplane.py`` replays identical traces through both). It is faster because the
per-packet work is split in two:

* **control** (one tight Python loop over plain ints): headers are decoded for the whole batch with one
  numpy view, then each packet runs the ATP decisions of ``innet.switch`` (source check, ECN mark,
  ACK/free, resend flush, eligibility, reserve/hit/collide, bitmap dedup, fan-in, completion) against a
  small per-batch copy of the touched aggregators' registers. Instead of adding a payload, the loop
  appends the packet's row to the aggregator's current *epoch* (the contributions between one
  reservation and the next free), and an emission refers to its epoch.
* **data** (vectorized): the payloads of all epochs are summed at once (int64 cumulative sum over the
  rows grouped by epoch). An aggregate never changes after it is emitted (a complete aggregate takes no
  more contributions, a flushed one is freed), so every emission carries its epoch's final sum. Epochs
  whose running sum leaves int32 at any step (rare: the quantizer keeps sums in range) are re-added
  row by row with the reference's saturating add, so ``saturated`` counts the same.

Registers are written back once per batch for the touched aggregators; forwarded packets are copied
out of the receive buffer with their flag bits (ECN, collision) OR-ed in.
"""

from __future__ import annotations

import logging
import struct
from itertools import chain
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

import numpy as np

from .wire import (FLAG_ACK, FLAG_COLLISION, FLAG_ECN, FLAG_EDGE, FLAG_OVERFLOW, FLAG_RESEND,
                   HEADER_DTYPE, HEADER_SIZE, SEQ_BITS)

if TYPE_CHECKING:  # pragma: no cover
    from .switch import SoftwareSwitch

__all__ = ["process_batch"]

log = logging.getLogger(__name__)

_I32_MIN = -(2**31)
_I32_MAX = 2**31 - 1
_HEAD = struct.Struct("!IIHHI")
_FLAG_BYTE = 9
_INELIGIBLE0 = FLAG_EDGE | FLAG_OVERFLOW | FLAG_COLLISION
_INELIGIBLE1 = FLAG_OVERFLOW | FLAG_COLLISION

# slot state list layout (a per-batch copy of one aggregator's registers)
_JS, _BM, _CNT, _ECN, _TS, _EPOCH, _IDX, _B1, _FAN, _COL = range(10)


# Complexity accepted: one pass over the batch with ATP's per-packet decisions in order.
def process_batch(sw: SoftwareSwitch, rows: np.ndarray, lengths: Sequence[int], in_ports: Sequence[int],  # noqa: C901
                  now: float, queue_depths: Sequence[int] | None = None) -> list[tuple[int, bytes]]:
    """Run ``len(lengths)`` received packets through ``sw``; returns the (out_port, bytes) to emit, in
    the order ``sw.process`` would have emitted them packet after packet.

    ``rows`` is a 2-D uint8 array whose row ``i`` holds packet ``i`` (``lengths[i]`` bytes received;
    rows may be wider than a packet so oversize datagrams show as a wrong length). ``in_ports[i]`` is
    the port packet ``i`` entered on, ``queue_depths[i]`` the packets queued behind it (ECN)."""
    n = len(lengths)
    if n == 0:
        return []
    size = sw.packet_size
    V = sw.value_count
    rows = rows[:n]
    heads = np.ascontiguousarray(rows[:, :HEADER_SIZE]).view(HEADER_DTYPE).reshape(n)
    js_arr = heads["job_seq"].astype(np.int64)
    B0 = heads["bitmap0"].tolist()
    B1 = heads["bitmap1"].tolist()
    FW = heads["flags"].tolist()
    AI = heads["agg_index"].tolist()
    JS = js_arr.tolist()
    LN = lengths.tolist() if isinstance(lengths, np.ndarray) else list(lengths)
    PORTS = in_ports.tolist() if isinstance(in_ports, np.ndarray) else list(in_ports)
    if queue_depths is None:
        DEP = [0] * n
    else:
        DEP = queue_depths.tolist() if isinstance(queue_depths, np.ndarray) else list(queue_depths)

    with sw._lock:
        c = sw._counters
        extra = sw.extra
        groups = sw._groups
        ports = sw._ports
        ecn_threshold = sw._ecn_threshold
        stale = sw.stale_timeout
        nagg = sw.num_aggregators
        js_reg, bm_reg, cnt_reg = sw._job_seq, sw._bitmap, sw._counter
        ecn_reg, ts_reg = sw._ecn, sw._timestamp
        mi_reg, mb1_reg, mf_reg = sw._meta_index, sw._meta_b1, sw._meta_fan
        col_reg = sw._collided
        # per job: (fan_in, ps_port, level, mcast_group, ports allowed to send gradients, ps_port mapped)
        member_ports: dict[int, set[int]] = {}
        for j, p in sw._members:
            member_ports.setdefault(j, set()).add(p)
        jinfo: dict[int, tuple[Any, ...]] = {
            j: (e.fan_in, e.ps_port, e.level, e.mcast_group, member_ports.get(j, frozenset()), e.ps_port in ports)
            for j, e in sw._jobs.items()}
        IDX = (heads["agg_index"].astype(np.int64) % nagg)
        # the touched aggregators' registers, fetched at once: [job_seq, bitmap, counter, ecn,
        # timestamp, epoch (-1: the register's own), meta index, meta bitmap1, meta fan word, collided]
        uniq = np.unique(IDX)
        slots: dict[int, list] = {
            k: [a, b, c_, d, e, -1, f, g, h, x] for k, a, b, c_, d, e, f, g, h, x in zip(
                uniq.tolist(), js_reg[uniq].tolist(), bm_reg[uniq].tolist(), cnt_reg[uniq].tolist(),
                ecn_reg[uniq].tolist(), ts_reg[uniq].tolist(), mi_reg[uniq].tolist(),
                mb1_reg[uniq].tolist(), mf_reg[uniq].tolist(), col_reg[uniq].tolist())}
        IDX = IDX.tolist()
        epochs: list[list] = []            # [slot, continues the register's sum]
        epoch_rows: list[list[int]] = []   # the rows aggregated into each epoch, in order
        out: list = []          # (port, what): what is a row number (forward) or an emission tuple
        marks: dict[int, int] = {}       # row -> flag bits to OR into its forwarded copy
        n_dropped = n_agg = n_fwd = n_coll = n_res = n_acks = n_ecn = n_rej = 0
        n_emit = n_flush = n_reclaim = 0

        i = -1
        for ln, job_seq, word, in_port, dep, idx in zip(LN, JS, FW, PORTS, DEP, IDX):
            i += 1
            if ln != size:
                n_dropped += 1
                continue
            job_id = job_seq >> SEQ_BITS
            job = jinfo.get(job_id)
            if job is None:                # job 0 (garbled) or not configured
                n_dropped += 1
                continue
            fan_in, ps_port, level, mcast, allowed, ps_ok = job
            flags = word & 0x3F
            if (in_port != ps_port) if flags & FLAG_ACK else (in_port not in allowed):
                n_rej += 1
                continue
            if dep > ecn_threshold:
                n_ecn += 1
                flags |= FLAG_ECN
                marks[i] = FLAG_ECN
            st = slots[idx]

            if flags & FLAG_ACK:
                n_acks += 1
                if st[_JS] == job_seq:
                    st[_JS] = st[_BM] = st[_CNT] = 0
                    st[_ECN] = False
                    st[_EPOCH] = -2
                if st[_COL] == job_seq:
                    st[_COL] = 0
                group = groups.get(mcast)
                if group is None:
                    n_dropped += 1
                    continue
                for p in group.ports:
                    if p in ports:
                        out.append((p, i))
                    else:
                        n_dropped += 1
                continue

            if flags & FLAG_RESEND:
                n_res += 1
                if st[_JS] == job_seq:
                    if ps_ok:
                        out.append((ps_port, _emission(st, True, level, sw._values, idx)))
                    else:
                        n_dropped += 1
                    n_flush += 1
                    st[_JS] = st[_BM] = st[_CNT] = 0
                    st[_ECN] = False
                    st[_EPOCH] = -2            # the next reservation starts a new epoch
                n_fwd += 1
                if ps_ok:
                    out.append((ps_port, i))
                else:
                    n_dropped += 1
                continue

            if level == 0:
                eligible = not flags & _INELIGIBLE0
                key = B0[i]
            else:
                b0 = B0[i]
                eligible = (flags & FLAG_EDGE and not flags & _INELIGIBLE1 and b0 != 0
                            and b0.bit_count() == _fan0(word))
                key = B1[i]
            if not eligible or key == 0:
                n_fwd += 1
                if ps_ok:
                    out.append((ps_port, i))
                else:
                    n_dropped += 1
                continue

            held = st[_JS]
            if held and held != job_seq and now - st[_TS] > stale:
                st[_JS] = st[_BM] = st[_CNT] = 0
                st[_ECN] = False
                st[_EPOCH] = -2
                n_reclaim += 1
                held = 0
            if held == 0 and st[_COL] == job_seq:
                held = -1                      # its fragment's first packet collided here: to the PS too
            if held == 0:
                st[_JS] = job_seq
                st[_IDX] = AI[i]
                st[_B1] = B1[i]
                st[_FAN] = word & ~0x3F
                st[_EPOCH] = len(epochs)
                epochs.append([idx, False])
                epoch_rows.append([])
            elif held != job_seq:
                st[_COL] = job_seq
                n_coll += 1
                n_fwd += 1
                if ps_ok:
                    marks[i] = marks.get(i, 0) | FLAG_COLLISION
                    out.append((ps_port, i))
                else:
                    n_dropped += 1
                continue

            have = st[_BM]
            if key & have:
                if key & have == key:
                    n_dropped += 1
                else:
                    n_fwd += 1
                    if ps_ok:
                        out.append((ps_port, i))
                    else:
                        n_dropped += 1
                continue
            if st[_CNT] >= fan_in:
                n_fwd += 1
                if ps_ok:
                    out.append((ps_port, i))
                else:
                    n_dropped += 1
                continue
            e = st[_EPOCH]
            if e < 0:                          # held since before this batch: continue the register
                e = st[_EPOCH] = len(epochs)
                epochs.append([idx, True])
                epoch_rows.append([])
            epoch_rows[e].append(i)
            st[_BM] = have | key
            st[_CNT] += key.bit_count()
            if flags & FLAG_ECN:
                st[_ECN] = True
            st[_TS] = now
            n_agg += 1
            if st[_CNT] >= fan_in:
                n_emit += 1
                if ps_ok:
                    out.append((ps_port, _emission(st, False, level, sw._values, idx)))
                else:
                    n_dropped += 1

        # ---- data: the sum of every epoch, vectorized
        sums = _epoch_sums(sw, rows, epochs, epoch_rows, V) if epochs else None

        # ---- write the touched registers back
        if slots:
            idxs = np.fromiter(slots.keys(), np.int64, len(slots))
            states = list(slots.values())
            js_reg[idxs] = [s[_JS] for s in states]
            bm_reg[idxs] = [s[_BM] for s in states]
            cnt_reg[idxs] = [s[_CNT] for s in states]
            ecn_reg[idxs] = [s[_ECN] for s in states]
            ts_reg[idxs] = [s[_TS] for s in states]
            mi_reg[idxs] = [s[_IDX] for s in states]
            mb1_reg[idxs] = [s[_B1] for s in states]
            mf_reg[idxs] = [s[_FAN] for s in states]
            col_reg[idxs] = [s[_COL] for s in states]
            if sums is not None:
                last: dict[int, int] = {}
                for e, ep in enumerate(epochs):
                    last[ep[0]] = e
                sw._values[list(last.keys())] = sums[list(last.values())]

        c["dropped"] += n_dropped
        c["aggregated"] += n_agg
        c["forwarded"] += n_fwd
        c["collisions"] += n_coll
        c["resends"] += n_res
        c["acks"] += n_acks
        c["ecn_marked"] += n_ecn
        c["rejected"] += n_rej
        extra["emitted"] += n_emit
        extra["flushed"] += n_flush
        extra["reclaimed"] += n_reclaim

        # ---- materialize the outputs
        result: list[tuple[int, bytes]] = []
        if not out:
            return result
        # big-endian sums (None without sums, when every output below is a held packet: e < 0)
        sums_be: Any = sums.astype(">i4") if sums is not None else None
        cache: dict[int, bytes] = {}
        for port, what in out:
            if what.__class__ is int:
                data = cache.get(what)
                if data is None:
                    data = rows[what, :size].tobytes()
                    m = marks.get(what)
                    if m:
                        b = bytearray(data)
                        b[_FLAG_BYTE] |= m
                        data = bytes(b)
                    cache[what] = data
                result.append((port, data))
            else:
                e, resend, bitmap, ecn, level, job_seq, meta_idx, meta_b1, meta_fan, held = what
                vals = held if e < 0 else sums_be[e].tobytes()
                fan_word = meta_fan | FLAG_EDGE | (FLAG_ECN if ecn else 0) | (FLAG_RESEND if resend else 0)
                b0, b1 = (bitmap, meta_b1) if level == 0 else (0, bitmap)
                result.append((port, _HEAD.pack(b0, b1, fan_word, meta_idx, job_seq) + vals))
        return result


def _fan0(word: int) -> int:
    f = (word >> 11) & 0x1F
    return f if f else 32


def _emission(st: list, resend: bool, level: int, values: np.ndarray, idx: int) -> tuple:
    """What an aggregate emitted now carries; the values come from its epoch's sum (or, for an
    aggregate held since before the batch and untouched in it, from the register as it is now)."""
    e = st[_EPOCH]
    held = values[idx].astype(">i4").tobytes() if e < 0 else None
    return (e, resend, st[_BM], st[_ECN], level, st[_JS], st[_IDX], st[_B1], st[_FAN], held)


def _epoch_sums(sw: SoftwareSwitch, rows: np.ndarray, epochs: list, epoch_rows: list[list[int]],
                V: int) -> np.ndarray:
    """The int32 value registers every epoch ends with: its base (zero, or the register it continues)
    plus its rows' payloads, with the reference's per-add saturation where a running sum leaves int32."""
    E = len(epochs)
    counts = np.fromiter((len(r) for r in epoch_rows), np.int64, E)
    order = np.fromiter(chain.from_iterable(epoch_rows), np.int64, int(counts.sum()))
    pay = rows[:, HEADER_SIZE:HEADER_SIZE + 4 * V].view(">i4")
    P32 = pay[order].astype(np.int32)
    base = np.zeros((E, V), np.int64)
    from_reg = [e for e, ep in enumerate(epochs) if ep[1]]
    if from_reg:
        base[from_reg] = sw._values[[epochs[e][0] for e in from_reg]]
    ends = np.cumsum(counts)
    starts = ends - counts
    # fast path: when no running sum can leave int32 (|row| x rows + |base| fits), one reduceat pass
    if P32.size:
        amax = max(int(P32.max()), -int(P32.min()))
        bmax = int(np.abs(base).max()) if from_reg else 0
        if amax * int(counts.max()) + bmax <= _I32_MAX:
            return (np.add.reduceat(P32, starts, axis=0, dtype=np.int64) + base).astype(np.int32)
    P = P32.astype(np.int64)
    C = np.cumsum(P, axis=0)
    before = np.zeros((E, V), np.int64)
    nz = starts > 0
    before[nz] = C[starts[nz] - 1]
    prefix = C - np.repeat(before - base, counts, axis=0)
    totals = prefix[ends - 1]
    if prefix.size and (prefix.max() > _I32_MAX or prefix.min() < _I32_MIN):
        row_epoch = np.repeat(np.arange(E), counts)
        bad_rows = (prefix > _I32_MAX).any(axis=1) | (prefix < _I32_MIN).any(axis=1)
        for e in np.unique(row_epoch[bad_rows]).tolist():
            acc = base[e].copy()
            for r in range(int(starts[e]), int(ends[e])):
                acc += P[r]
                if acc.max() > _I32_MAX or acc.min() < _I32_MIN:
                    np.clip(acc, _I32_MIN, _I32_MAX, out=acc)
                    sw.extra["saturated"] += 1
            totals[e] = acc
    return totals.astype(np.int32)
