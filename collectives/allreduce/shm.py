"""``allreduce`` through shared memory, for ranks that share one host (``via="shm"``, chosen by "auto"),
and the intra-host phases of the hierarchical allreduce (a reduce to the host's leader and a broadcast
from it, over the ranks of one host: :meth:`ShmAllReduce.reduce_to_first` / :meth:`ShmAllReduce.broadcast`).

Sockets cost two kernel copies and a wake-up per message; ranks on one host can instead see each
other's memory. The operation's first rank creates a segment in ``/dev/shm`` (:mod:`twisternet.shm`, kind
``ar``: reserved in full, ``0600``, the owner's pid in its name) and tells the others its path and a
random nonce over the operation's own edges; each one maps it and checks the nonce (so ranks that do
not really share the file, e.g. on other hosts or in other containers, are found out), and only if
every rank succeeded does the operation use it. The first rank unlinks the file when set-up ends, in
every case (all mapped it, one refused, one timed out or was lost): from then on it lives only in the
mappings. A first rank killed during set-up leaves it behind, and the next Context started on the
machine removes it (:func:`twisternet.shm.sweep_stale`). Otherwise the operation keeps its ring/tree.

The segment holds, per rank, a 64-byte header (``in_seq``, ``out_seq``, and per call parity the call's byte
count, dtype string with byte order, and a digest of the shape) and two input slots of ``chunk`` bytes, plus
two shared output slots. An array is reduced one chunk ("round" ``k``, counted over the operation's life) at a
time:

* every rank copies its chunk into its input slot ``k % 2`` and publishes ``in_seq = k``, then waits
  until every rank has published ``k`` (in a split round, below, it leaves out its own piece, which
  only it reads: it combines that part straight from its array);
* a small chunk (at most ``DIRECT_BYTES``) is then reduced by every rank itself, from all input slots in
  rank order, straight into the result: one wait per round;
* a larger one is cut into one piece per rank: each rank reduces its piece from all inputs into output
  slot ``k % 2`` and publishes ``out_seq = k``; once all have, each copies the whole chunk out.

Every rank combines the inputs in the same order, so all ranks get bit-identical results. Two slots
suffice: a rank writes slot ``k % 2`` only after every rank has entered round ``k - 1``, i.e. finished
reading round ``k - 2``. Waits spin briefly, then yield the CPU, then sleep in growing steps while
checking for lost peers, a failed or closed operation and the timeout, so they never hang.

Memory ordering: the sequence numbers are plain aligned 8-byte stores and loads, which x86-64 keeps in
program order (TSO); other CPUs would need fences that Python cannot issue, so "auto" uses this path on
x86-64 only.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import platform
import time
from typing import TYPE_CHECKING

import numpy as np

from twisternet import futex, shm
from twisternet.errors import (
    ClosedError,
    MismatchError,
    OperationTimeout,
    PeerLostError,
    ProtocolError,
)

from ..edges import AR_DOWN, AR_UP

if TYPE_CHECKING:
    from .plumbing import RecordPlumbing as RankAllReduce

log = logging.getLogger(__name__)

#: Where segments live (a tmpfs on Linux). Without it the shared-memory path is not offered.
SHM_DIR = shm.SHM_DIR
#: The kind of twisternet.shm segment this path uses (in its file name).
KIND = "ar"
#: Chunks up to this size are reduced by every rank from all inputs (one wait per chunk); larger
#: ones are split among the ranks (two waits, but each rank combines only its share).
DIRECT_BYTES = 64 << 10
_HDR = 128                     # bytes of header per rank (cache lines of its own: no false sharing)
# int64 fields of a rank's header; a call's byte count, dtype and shape digest sit at
# _NBYTES/_DTYPE/_SHAPE + _DESC * (round % 2), because a rank may already announce its next call while
# a slower one still checks this one
_IN_SEQ, _OUT_SEQ, _NBYTES, _DTYPE, _SHAPE = 0, 1, 2, 3, 4
_DESC = 3
# the header word (index into the int64 headers) + 1 that this rank sleeps on in the kernel, 0: none
_SLEEPS_ON = 8
_NONCE = 32                    # bytes of nonce after the headers
_ALIGN = 4096
_SPIN = 200                    # polls before yielding the CPU (where busy polling is on)
_SPIN_SHORT = 10               # the same where it is off (ranks outnumber cores): then sleep at once
_YIELD = 0.002                 # seconds of yield-polling before sleeping (where busy polling is on)
_YIELD_SHORT = 2e-4            # the same where it is off but the engine thread polls (MPI), see _sleep_on
_SLEEP_SLICE = 0.05            # longest futex wait before the liveness and deadline checks


def supported() -> bool:
    """Whether this machine can offer the path at all (a tmpfs at SHM_DIR, a TSO CPU)."""
    return shm.supported() and platform.machine().lower() in ("x86_64", "amd64")


def _int64(b: bytes) -> int:
    return int.from_bytes(b[:8].ljust(8, b"\0"), "little", signed=True)


def _digest(text: str) -> int:
    return _int64(hashlib.blake2b(text.encode(), digest_size=8).digest())


_DESCS: dict[tuple[np.dtype, tuple], tuple[int, int]] = {}


def describe(dtype: np.dtype, shape: tuple) -> tuple[int, int]:
    """The header words for an array of ``dtype`` (its byte-order string, e.g. ``>f4``, in 8 bytes, or a
    digest of a longer one) and ``shape`` (a digest)."""
    got = _DESCS.get((dtype, shape))
    if got is None:
        s = dtype.str.encode()
        got = (_int64(s) if len(s) <= 8 else _digest(dtype.str), _digest(repr(tuple(shape))))
        if len(_DESCS) < 1024:
            _DESCS[(dtype, shape)] = got
    return got


_NOT_ARRAY = _int64(b"-")


def _dtype_of(word: int) -> np.dtype | None:
    """The dtype a header word names (None if it holds a digest)."""
    try:
        return np.dtype(word.to_bytes(8, "little", signed=True).rstrip(b"\0").decode("ascii"))
    except (UnicodeDecodeError, TypeError, ValueError):
        return None


def _round_up(n: int, k: int = _ALIGN) -> int:
    return (n + k - 1) // k * k


class ShmAllReduce:
    """The shared-memory segment of one AllReduce operation and the rounds run through it."""

    def __init__(self, rar: RankAllReduce, path: str, mm: mmap.mmap, chunk: int,
                 members: list[int] | None = None) -> None:
        self.rar = rar
        self.op = rar.op
        self.members = list(rar.ranks if members is None else members)   # ranks mapping it, in slot order
        self.n = len(self.members)
        self.i = self.members.index(self.op.rank)
        self.path = path
        self.mm = mm
        self._seg: shm.Segment | None = None     # the twisternet.shm segment mm belongs to (set by setup)
        self.chunk = chunk
        self.round = 0                  # rounds done (the next one is round + 1)
        self.failed: BaseException | None = None
        self.seq = memoryview(mm).cast("B")[: self.n * _HDR].cast("q")   # int64 headers
        self.stride = _HDR // 8
        # waiters sleep on a header word in the kernel (twisternet.futex) once spinning is over; a
        # publication wakes them if one said it sleeps there (see _publish). The address is read once
        # (no buffer export stays behind).
        self._futex = futex.available()
        # How long a wait polls, then yields, before it sleeps (see _sleep_on): busy polling on, over MPI
        # (whose engine thread polls the channel instead of sleeping in the kernel), or neither
        busy = self.op.ctx.busy_poll > 0
        engine_polls = not self.op.ctx.channel.can_wait_unlocked
        self._spin = _SPIN if busy or engine_polls else _SPIN_SHORT
        self._yield = _YIELD if busy else _YIELD_SHORT if engine_polls else 0.0
        self._yield_first = _YIELD if busy else 0.0     # (a broadcast member's wait, see _await_first)
        self._seq_addr = np.frombuffer(self.seq, np.int64).ctypes.data if self._futex else 0
        self._sleep_words = [j * self.stride + _SLEEPS_ON for j in range(self.n) if j != self.i]
        self._in_base = _round_up(self.n * _HDR + _NONCE)
        self._out_base = self._in_base + 2 * self.n * chunk
        self._views: dict[np.dtype, tuple[list[list[np.ndarray]], list[np.ndarray]]] = {}

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def size_for(n: int, chunk: int) -> int:
        """Bytes of a segment for ``n`` ranks and ``chunk``-byte slots."""
        return _round_up(n * _HDR + _NONCE) + 2 * n * chunk + 2 * chunk

    @classmethod
    def setup(cls, rar: RankAllReduce, call: int, chunk: int, timeout: float,
              members: list[int] | None = None, kind: str = "s") -> ShmAllReduce | None:
        """Collective: every rank of ``members`` (default: the operation's ranks) calls it in the same
        call. Returns the path's state, or None (on every member alike) if some member could not map the
        first member's segment. Its records are of ``kind`` (steps 0-2), through ``rar.send_record`` /
        ``rar.take_record``."""
        op = rar.op
        ranks = list(rar.ranks if members is None else members)
        root = ranks[0]
        me = op.rank
        size = cls.size_for(len(ranks), chunk)
        seg: shm.Segment | None = None
        agreed = False
        try:
            if me == root:
                try:
                    seg = _create(size, len(ranks))
                except OSError as e:
                    log.info("%s: no shared-memory allreduce: cannot create a segment: %s", op.describe(), e)
                offer = (seg.path, seg.nonce, size) if seg is not None else None
                for r in ranks[1:]:
                    rar.send_record(r, AR_DOWN, (kind, call, 0, 0, offer), timeout)
                oks = [seg is not None] + [bool(rar.take_record((kind, call, 1, 0, r), timeout))
                                           for r in ranks[1:]]
                agreed = all(oks)
                for r in ranks[1:]:
                    rar.send_record(r, AR_DOWN, (kind, call, 2, 0, agreed), timeout)
            else:
                offer = rar.take_record((kind, call, 0, 0, root), timeout)
                if offer is not None:
                    try:
                        path, nonce, size = offer
                        seg = _attach(path, size, nonce, len(ranks))
                    except (OSError, ValueError, TypeError) as e:
                        log.info("%s: no shared-memory allreduce: rank %d cannot map rank %d's segment: %s",
                                 op.describe(), me, root, e)
                        seg = None
                rar.send_record(root, AR_UP, (kind, call, 1, 0, seg is not None), timeout)
                agreed = bool(rar.take_record((kind, call, 2, 0, root), timeout))
        except BaseException:
            agreed = False          # set-up did not finish here: the mapping goes too
            raise
        finally:
            # The root's file goes in every case: once every rank has it mapped it lives on in the
            # mappings alone; if set-up failed (a rank timed out, was lost, refused) nobody needs it.
            if me == root and seg is not None:
                shm.unlink(seg.path)
            if not agreed and seg is not None:
                seg.close()
        if not agreed:
            return None
        assert seg is not None and seg.mm is not None
        state = cls(rar, seg.path, seg.mm, chunk, ranks)
        state._seg = seg
        return state

    def close(self) -> None:
        """Unmap the segment (views made from it must be gone: they are dropped first)."""
        self._views.clear()
        try:
            self.seq.release()
        except (ValueError, BufferError):
            pass
        seg = self._seg
        try:
            if seg is not None:
                seg.close()     # its own view of the mapping first, then the mapping
            else:
                self.mm.close()
        except BufferError:     # a result view escaped (cannot happen: results are copied out)
            log.debug("shared-memory segment %s still referenced at close", self.path)

    # ------------------------------------------------------------------ one call
    def run(self, value: np.ndarray, t: float, out: np.ndarray | None) -> np.ndarray:
        """Reduce ``value`` with every rank's; the result goes to ``out`` (if given) or a new array."""
        op = self.op
        if self.failed is not None:
            raise ProtocolError(f"{op.describe()} edge {op.edge}: a previous shared-memory allreduce failed "
                                f"({self.failed}); the operation cannot be used any more")
        src = np.ascontiguousarray(value).reshape(-1)
        result = np.empty_like(src) if out is None else out.reshape(-1)
        deadline = time.monotonic() + t
        try:
            self._reduce(src, result, deadline, t, value.shape)
        except BaseException as e:
            self.failed = e
            raise
        return result.reshape(value.shape) if out is None else out

    def reduce_to_first(self, value: np.ndarray, t: float) -> np.ndarray | None:
        """Reduce ``value`` with every member's; the first member gets the result (a new array), the
        others None (they leave as soon as their share is reduced)."""
        self._usable()
        src = np.ascontiguousarray(value).reshape(-1)
        result = np.empty_like(src) if self.i == 0 else None
        try:
            self._reduce(src, result, time.monotonic() + t, t, value.shape)
        except BaseException as e:
            self.failed = e
            raise
        return result

    def reduce_scatter(self, value: np.ndarray, t: float, result: np.ndarray | None = None) -> np.ndarray:
        """Reduce ``value`` with every member's; this member gets its share of the result (one block,
        see :func:`pieces`): written into its own place in ``result`` (flat, ``value``'s size and dtype;
        it may be ``value`` itself) and returned as that view, else as a new array. One wait per slot:
        each member reduces its piece of every round from all input slots itself."""
        self._usable()
        src = np.ascontiguousarray(value).reshape(-1)
        seq, stride, me, n = self.seq, self.stride, self.i, self.n
        ins, _ = self._slot_views(src.dtype)
        ufunc = self.op.reduction.ufunc
        shares = [pieces(src.size, src.itemsize, self.chunk, n, x) for x in range(n)]
        mine = shares[me]
        per = _per_member(src.itemsize, self.chunk, n)
        if result is None:
            part = np.empty(sum(b - a for a, b in mine), src.dtype)
        elif result.shape != src.shape or result.dtype != src.dtype:
            raise ValueError(f"reduce_scatter: result must be {src.size} elements of {src.dtype}, got "
                             f"{result.shape} {result.dtype}")
        else:
            part = result[mine[0][0]:mine[-1][1]] if mine else result[:0]
        deadline = time.monotonic() + t
        try:
            pos = 0
            for c, (a, b) in enumerate(mine):
                k = self.round + 1
                par = k & 1
                # the others read their pieces of this round from the slot; this rank's own piece
                # stays in src (only this rank reads it)
                slot = ins[par][me]
                for x in range(n):
                    if x != me:
                        xa, xb = shares[x][c]
                        slot[x * per:x * per + xb - xa] = src[xa:xb]
                if c == 0:
                    base = me * stride + _DESC * par
                    seq[base + _NBYTES] = src.nbytes
                    seq[base + _DTYPE], seq[base + _SHAPE] = describe(src.dtype, value.shape)
                self._publish(me * stride + _IN_SEQ, k)
                self._await(_IN_SEQ, k, deadline, t, "chunk")
                if c == 0:
                    self._check_same(src, value.shape, par)
                dst = part[pos:pos + b - a]
                # in rank order, as every rank reduces (bit-identical results)
                inputs = [src[a:b] if j == me else ins[par][j][me * per:me * per + b - a] for j in range(n)]
                if n == 1:
                    dst[...] = inputs[0]
                else:
                    ufunc(inputs[0], inputs[1], out=dst)
                    for j in range(2, n):
                        ufunc(dst, inputs[j], out=dst)
                pos += b - a
                self.round = k
        except BaseException as e:
            self.failed = e
            raise
        return part

    def allgather(self, part: np.ndarray, result: np.ndarray, t: float) -> None:
        """Every member's ``part`` (its share, as :meth:`reduce_scatter` returned it) into every member's
        ``result`` (flat): per round, each writes its piece into the output slot, and once all have,
        copies the others' pieces out (one wait per slot, two in the first). A ``part`` that is the
        share's own place in ``result`` is not copied."""
        self._usable()
        stride, me, n = self.stride, self.i, self.n
        _, outs = self._slot_views(result.dtype)
        shares = [pieces(result.size, result.itemsize, self.chunk, n, x) for x in range(n)]
        mine = shares[me]
        per = _per_member(result.itemsize, self.chunk, n)
        in_place = bool(mine) and part.size > 0 and part.dtype == result.dtype \
            and part.ctypes.data == result.ctypes.data + mine[0][0] * result.itemsize
        deadline = time.monotonic() + t
        try:
            pos = 0
            for c, (a, b) in enumerate(mine):
                k = self.round + 1
                par = k & 1
                self._publish(me * stride + _IN_SEQ, k)
                if c == 0:
                    # nobody still reads this output slot from round k - 2 (another operation's). In
                    # later rounds the wait for the pieces of round k - 1 said so already: a rank
                    # publishes its piece of a round only after it copied the round before out
                    self._await(_IN_SEQ, k, deadline, t, "start of a gather round")
                slot = outs[par]
                slot[me * per:me * per + b - a] = part[pos:pos + b - a]
                self._publish(me * stride + _OUT_SEQ, k)
                # this rank's own piece comes from part, the others' from the slot once written
                if not in_place:
                    result[a:b] = part[pos:pos + b - a]
                pos += b - a
                self._await(_OUT_SEQ, k, deadline, t, "gathered piece")
                for x in range(n):
                    if x != me:
                        xa, xb = shares[x][c]
                        result[xa:xb] = slot[x * per:x * per + xb - xa]
                self.round = k
        except BaseException as e:
            self.failed = e
            raise

    def broadcast(self, buf: np.ndarray, t: float) -> None:
        """The first member's ``buf`` (flat, C-contiguous) into every member's ``buf``, chunk by chunk
        through the output slots. Every member passes a buffer of the same size and dtype.

        Rounds continue the operation's count. In a first round with no data every member says it has
        finished the rounds before (a reduce reads the input slots until it ends), and the first member
        waits until all have; then in round ``k`` the first
        member writes output slot ``k % 2`` once every member has started round ``k - 1`` (so finished
        reading round ``k - 2`` from that slot) and publishes ``out_seq = k``; the others copy the chunk
        out and publish ``in_seq = k``."""
        self._usable()
        stride, me = self.stride, self.i
        deadline = time.monotonic() + t
        try:
            k = self.round + 1
            self._publish(me * stride + _IN_SEQ, k)
            if me == 0:
                # only the first member waits here: the others wait for its first chunk, which it
                # writes only once all of them have started round k (one wake-up each, not two)
                self._await(_IN_SEQ, k, deadline, t, "start of the broadcast")
            self.round = k
            flat = buf.reshape(-1)
            _, outs = self._slot_views(flat.dtype)
            step = max(1, self.chunk // flat.itemsize)
            for a in range(0, flat.size, step):
                b = min(flat.size, a + step)
                k = self.round + 1
                par = k & 1
                if me == 0:
                    self._await(_IN_SEQ, k - 1, deadline, t, "broadcast acknowledgement")
                    outs[par][:b - a] = flat[a:b]
                    self._publish(_OUT_SEQ, k)
                    self._publish(_IN_SEQ, k)
                else:
                    self._await_first(_OUT_SEQ, k, deadline, t)
                    flat[a:b] = outs[par][:b - a]
                    self._publish(me * stride + _IN_SEQ, k)
                self.round = k
        except BaseException as e:
            self.failed = e
            raise

    def _await_first(self, field: int, k: int, deadline: float, t: float) -> None:
        """Until the first member has published ``k`` in ``field`` (as :meth:`_await`, for one rank)."""
        seq = self.seq
        polls, start, nap = 0, 0.0, 20e-6
        while seq[field] < k:
            polls += 1
            if polls < self._spin:
                continue
            now = time.monotonic()
            if not start:
                start = now
            if self._futex:
                # (no yielding where busy polling is off: the first member of a hierarchical
                # allreduce may be busy between the hosts for a while, and needs the cores)
                self._sleep_on(field, k, deadline, t, "broadcast chunk", now, start, only_first=True,
                               may_yield=False)
                continue
            if now - start < _YIELD:
                os.sched_yield()
                continue
            self._check(field, k, deadline, t, "broadcast chunk", now, only_first=True)
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)

    def _publish(self, idx: int, k: int) -> None:
        """Header word ``idx`` := ``k``, and wake whoever sleeps on it (a member that said so in its
        ``_SLEEPS_ON`` word; fenced, see twisternet.futex)."""
        seq = self.seq
        seq[idx] = k
        if self._futex:
            futex.fence()
            for w in self._sleep_words:
                if seq[w] == idx + 1:
                    futex.wake(self._seq_addr + 8 * idx)
                    return

    def _sleep_on(self, field: int, k: int, deadline: float, t: float, what: str, now: float, start: float,
                  only_first: bool = False, may_yield: bool = True) -> None:
        """One wait in the kernel for the first member still short of ``k`` in ``field`` (a slice of
        :data:`_SLEEP_SLICE` at most, then the checks of :meth:`_check`). Before that, yield the core
        for up to :data:`_YIELD` seconds where busy polling is on (``busy_poll_us``).

        Where it is off (more ranks than cores) the wait sleeps at once, after :data:`_SPIN_SHORT`
        polls: every poll or yield takes a core from a rank that has work. On 2 cores, 1 KB per call
        (benchmarks/_allreduce_worker.py), 4 ranks of one host under ``twisternet run``: 44-50 us
        against 63-80 us with 200 polls and 200 us of yielding first; 4 hosts x 2 ranks of the
        emulated cluster (benchmarks/_cluster_worker.py): 0.70-0.79 ms against 0.84-0.90 ms.

        Not over MPI, whose engine thread polls the channel every few hundred microseconds instead of
        sleeping in the kernel: there the 200 polls and :data:`_YIELD_SHORT` of yielding (when
        ``may_yield``) stay. Sleeping at once gave 67-87 us (median 83) for the same 4 ranks under
        ``mpiexec``, against 69-73 us with them."""
        if now - start < (self._yield if may_yield else self._yield_first):
            os.sched_yield()
            return
        seq, stride = self.seq, self.stride
        for j in (range(1) if only_first else range(self.n)):
            idx = j * stride + field
            if j != self.i and seq[idx] < k:
                mine = self.i * stride + _SLEEPS_ON
                seq[mine] = idx + 1                  # "wake me": then look again (fenced, see _publish)
                futex.fence()
                seen = seq[idx]
                if seen < k:
                    futex.wait(self._seq_addr + 8 * idx, seen, min(_SLEEP_SLICE, max(0.0, deadline - now)))
                seq[mine] = 0
                if seq[idx] < k:
                    self._check(field, k, deadline, t, what, time.monotonic(), only_first)
                return

    def _usable(self) -> None:
        if self.failed is not None:
            raise ProtocolError(f"{self.op.describe()} edge {self.op.edge}: a previous shared-memory allreduce "
                                f"failed ({self.failed}); the operation cannot be used any more")

    def announce_other(self, t: float) -> None:
        """This rank's value cannot go through the segment (not a non-empty array of numbers): take part
        in the round anyway with a "no array" descriptor, so that if the other ranks passed arrays, all
        of them (this one included) raise the same MismatchError at once instead of waiting for a peer
        that took another path. Returns if every rank passed such a value (they then use the tree)."""
        if self.failed is not None:
            raise ProtocolError(f"{self.op.describe()} edge {self.op.edge}: a previous shared-memory allreduce "
                                f"failed ({self.failed}); the operation cannot be used any more")
        seq, stride, me = self.seq, self.stride, self.i
        k = self.round + 1
        par = k & 1
        base = me * stride + _DESC * par
        seq[base + _NBYTES], seq[base + _DTYPE], seq[base + _SHAPE] = -1, _NOT_ARRAY, 0
        self._publish(me * stride + _IN_SEQ, k)
        try:
            self._await(_IN_SEQ, k, time.monotonic() + t, t, "chunk")
            self.round = k
            self._check_same(None, (), par)
        except BaseException as e:
            self.failed = e
            raise

    def _reduce(self, src: np.ndarray, result: np.ndarray | None, deadline: float, t: float,
                shape: tuple | None = None) -> None:
        """The rounds of one reduction; ``result`` None: this rank only contributes (reduce to the first
        member, which passes one) and skips the copies out and the wait for the others' pieces."""
        shape = (src.size,) if shape is None else shape
        seq, stride, me, n = self.seq, self.stride, self.i, self.n
        ins, outs = self._slot_views(src.dtype)
        ufunc = self.op.reduction.ufunc
        step = max(1, self.chunk // src.itemsize)
        total = src.size
        first = True
        for a in range(0, total, step):
            b = min(total, a + step)
            m = b - a
            k = self.round + 1
            par = k & 1
            direct = m * src.itemsize <= DIRECT_BYTES
            lo, hi = m * me // n, m * (me + 1) // n
            mine = ins[par][me]
            if direct:
                mine[:m] = src[a:b]
            else:
                # only this rank reads its own piece: it stays in src, the others' pieces go to the slot
                mine[:lo] = src[a:a + lo]
                mine[hi:m] = src[a + hi:b]
            if first:
                base = me * stride + _DESC * par
                seq[base + _NBYTES] = src.nbytes
                seq[base + _DTYPE], seq[base + _SHAPE] = describe(src.dtype, shape)
            self._publish(me * stride + _IN_SEQ, k)
            self._await(_IN_SEQ, k, deadline, t, "chunk")
            if first:
                self._check_same(src, shape, par)
                first = False
            if direct:
                if result is None:
                    self.round = k
                    continue
                dst = result[a:b]
                ufunc(ins[par][0][:m], ins[par][1][:m], out=dst)
                for j in range(2, n):
                    ufunc(dst, ins[par][j][:m], out=dst)
            else:
                # every rank adds in rank order (bit-identical results); this rank's operand is src itself
                inputs = [src[a + lo:a + hi] if j == me else ins[par][j][lo:hi] for j in range(n)]
                piece = outs[par][lo:hi]
                ufunc(inputs[0], inputs[1], out=piece)
                for j in range(2, n):
                    ufunc(piece, inputs[j], out=piece)
                self._publish(me * stride + _OUT_SEQ, k)
                if result is not None:
                    self._await(_OUT_SEQ, k, deadline, t, "reduced piece")
                    result[a:b] = outs[par][:m]
            self.round = k

    def _check_same(self, src: np.ndarray | None, shape: tuple, par: int) -> None:
        """Every rank reads every rank's header, so all of them find the same difference and raise the
        same MismatchError (no message needed, nobody left waiting)."""
        seq, stride = self.seq, self.stride
        words = [tuple(seq[j * stride + _DESC * par + f] for f in (_NBYTES, _DTYPE, _SHAPE)) for j in range(self.n)]
        if all(w == words[0] for w in words):
            return
        mine = words[self.i]
        groups: dict[tuple, list[int]] = {}
        for j, w in enumerate(words):
            groups.setdefault(w, []).append(self.members[j])
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
        odd = sorted(r for _, rs in ordered[1:] for r in rs)

        def text(w: tuple) -> str:
            if w[0] < 0:
                return "a value that is not a non-empty numpy array of numbers"
            if w == mine and src is not None:
                return f"{w[0]} bytes of {src.dtype.name} ({src.dtype.str}), shape {shape}"
            dt = _dtype_of(w[1])
            what = f"{dt.name} ({dt.str})" if dt is not None else "another dtype"
            if dt is not None and dt.itemsize and w[0] % dt.itemsize == 0 \
                    and describe(dt, (w[0] // dt.itemsize,))[1] == w[2]:
                shp = f"shape {(w[0] // dt.itemsize,)}"
            else:
                shp = f"shape {shape}" if w[2] == mine[2] and src is not None else "another shape"
            return f"{w[0]} bytes of {what}, {shp}"
        listing = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {rs}: {text(w)}" for w, rs in ordered)
        raise MismatchError(f"allreduce() through shared memory: ranks {odd} passed arrays that differ from "
                            f"the others' ({listing}); every rank must pass arrays of the same shape and dtype, "
                            "byte order included", odd)

    def _await(self, field: int, k: int, deadline: float, t: float, what: str) -> None:
        """Until every rank has published ``k`` in ``field``: spin, then yield, then sleep, checking."""
        seq, stride, n = self.seq, self.stride, self.n
        idx = [j * stride + field for j in range(n) if j != self.i]
        polls = 0
        start = 0.0
        nap = 20e-6
        while True:
            for x in idx:
                if seq[x] < k:
                    break
            else:
                return
            polls += 1
            if polls < self._spin:
                continue
            now = time.monotonic()
            if not start:
                start = now
            if self._futex:
                self._sleep_on(field, k, deadline, t, what, now, start)
                continue
            if now - start < _YIELD:
                os.sched_yield()
                continue
            self._check(field, k, deadline, t, what, now)
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)

    def _check(self, field: int, k: int, deadline: float, t: float, what: str, now: float,
               only_first: bool = False) -> None:
        op = self.op
        op._raise_if_failed()
        if op._over():
            raise ClosedError(f"{op.describe()} was closed during allreduce()")
        late = [self.members[j] for j in (range(1) if only_first else range(self.n))
                if self.seq[j * self.stride + field] < k]
        lost = op.ctx.lost_peers
        # a late member lost, or (hierarchical path: a rank on another host) any rank of the operation,
        # whose loss this member would otherwise learn only when its own leader gives up
        gone = [r for r in late if r in lost] or [r for r in self.rar.ranks if r in lost]
        if gone:
            check = getattr(op.ctx, "check_lost", None)
            if check is not None:
                check()          # names the first rank lost, not one that left in reaction
            raise PeerLostError(gone[0], lost[gone[0]])
        if now >= deadline:
            raise OperationTimeout(f"allreduce() through shared memory: no {what} from ranks {late} "
                                   f"(round {k})", edge=op.edge, operation=op.operation, timeout=t)

    def _slot_views(self, dtype: np.dtype) -> tuple[list[list[np.ndarray]], list[np.ndarray]]:
        got = self._views.get(dtype)
        if got is None:
            count = self.chunk // dtype.itemsize
            ins = [[np.frombuffer(self.mm, dtype, count, self._in_base + (p * self.n + j) * self.chunk)
                    for j in range(self.n)] for p in range(2)]
            outs = [np.frombuffer(self.mm, dtype, count, self._out_base + p * self.chunk) for p in range(2)]
            got = self._views[dtype] = (ins, outs)
        return got


def pieces(total: int, itemsize: int, chunk_bytes: int, n: int, i: int) -> list[tuple[int, int]]:
    """Member ``i`` of ``n``'s share of an array of ``total`` elements, round by round.

    The share is one contiguous block, elements ``total*i//n .. total*(i+1)//n`` (so a reduce-scatter can
    write it straight into the caller's result and an allgather need not copy it back), cut into
    pieces of at most ``chunk_bytes // n`` bytes: round ``r`` of the shared-memory slots holds piece
    ``r`` of every member, member ``x``'s at element ``x * (chunk_bytes // itemsize // n)`` of the slot.
    Every member has the same number of rounds (a piece can be empty)."""
    if total <= 0:
        return []
    per = _per_member(itemsize, chunk_bytes, n)
    lo, hi = total * i // n, total * (i + 1) // n
    largest = -(-total // n)                     # the largest share (they differ by one element at most)
    rounds = -(-largest // per)
    return [(min(hi, lo + r * per), min(hi, lo + (r + 1) * per)) for r in range(rounds)]


def _per_member(itemsize: int, chunk_bytes: int, n: int) -> int:
    """Elements of one member's piece in a slot round (see :func:`pieces`)."""
    return max(1, chunk_bytes // itemsize // n)


def _create(size: int, n: int) -> shm.Segment:
    """A new segment for ``n`` ranks (twisternet.shm, kind "ar"): its nonce sits after the headers."""
    return shm.create(KIND, size, nonce_at=n * _HDR, nonce_bytes=_NONCE)


def _attach(path: str, size: int, nonce: bytes, n: int) -> shm.Segment:
    """Map the segment the first rank offered; ValueError/OSError unless it is that very file."""
    if not isinstance(nonce, bytes) or len(nonce) != _NONCE or not isinstance(size, int):
        raise ValueError("malformed shared-memory allreduce offer")
    return shm.attach(path, size, nonce, kind=KIND, nonce_at=n * _HDR)


__all__ = ["ShmAllReduce", "supported", "pieces", "DIRECT_BYTES"]
