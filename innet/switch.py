"""The ATP software switch dataplane: a fixed aggregator array and the per-packet logic of an ATP ToR.

``SoftwareSwitch.process(packet, in_port, now)`` is the pure packet function (no sockets): it returns the
``(out_port, bytes)`` pairs to emit. ``SoftwareSwitch`` also implements ``innet.control.SwitchControl``
(ports, job table, multicast groups, ECN threshold, counters, aggregator reads).

**Source check** (first, before any state is touched): a parameter (ACK) packet of a job is accepted
only when it enters on the job's ``ps_port``, a gradient packet only on a port registered for the job
(``insert_member``; the ``member_table`` of ``atp.p4``). ``in_port`` is the port whose address the
datagram came from (``UNKNOWN_PORT`` for any other source), so a process that forges a job's packets from
another address is dropped and counted ``rejected``, and cannot change a sum or free an aggregator.

Per gradient packet of a configured job, at aggregator ``aggregatorIndex mod num_aggregators``:

* **eligibility**: a level-0 switch (worker-rack ToR) aggregates packets with ``edgeSwitchIdentifier``
  clear, keyed by ``bitmap0``; a level-1 switch (PS-rack ToR) aggregates only complete rack aggregates
  (``edgeSwitchIdentifier`` set and ``popcount(bitmap0) == fanInDegree0``), keyed by ``bitmap1``. Every
  other packet (overflow, collision-marked, partial, wrong level) is forwarded unchanged to the job's PS
  port, so each contribution is aggregated at most once on its way up.
* **reserve / hit / collide**: a free aggregator (or one of another fragment whose timestamp is older than
  ``stale_timeout``, which is reclaimed) is reserved for the packet's jobID+seq; one held by the same
  jobID+seq is hit; one held by another live fragment is a *collision*: the packet gets the ``collision``
  flag and goes to the PS unaggregated, and the aggregator remembers the collided jobID+seq
  (``agg_collided``). A later packet of that jobID+seq follows the first to the PS even if the
  aggregator is free by then: reserving it would strand that packet's contribution in a slot that
  waits for one already at the PS, until a worker's resend flushes it (with three jobs on half the
  aggregators they want, about one fragment in twenty did so before). The parameter packet of the
  jobID+seq clears the mark.
* **aggregate**: saturating int32 add of the payload, merge of the key bitmap, counter += contributions.
  A packet whose bits are all already in the bitmap is a duplicate and is dropped (never added twice).
* **complete**: when the counter reaches the job's fan-in, the aggregate is emitted to the PS port with
  ``edgeSwitchIdentifier`` set and the merged bitmap (level 0: ``bitmap0`` = merged workers; level 1:
  ``bitmap0 = 0`` meaning "whole racks", ``bitmap1`` = merged racks). The aggregator stays held until the
  parameter packet frees it, so a lost aggregate can be re-emitted.
* **resend**: a packet with ``resend`` set never reserves nor adds: if the aggregator holds its
  jobID+seq, the held (partial or complete) aggregate is flushed to the PS with ``resend`` set and its
  bitmap, and the aggregator is freed; then the resend packet itself is forwarded to the PS. The PS
  deduplicates by bitmap.
* **parameter (ACK)**: frees the aggregator if it holds that jobID+seq, and is replicated to every port
  of the job's multicast group.
* **ECN**: when the caller reports a queue depth above the threshold, the packet is marked; an aggregate
  carries the OR of its contributions' marks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

from .control import (AggregatorState, AlreadyExists, InvalidArgument, JobEntry, MulticastGroup,
                      NotFound, SwitchControl)
from .wire import (DEFAULT_VALUE_COUNT, FLAG_ACK, FLAG_COLLISION, FLAG_ECN, FLAG_EDGE, FLAG_OVERFLOW,
                   FLAG_RESEND, HEADER_SIZE, MAX_FAN_IN, MAX_JOB_ID, WireError, decode_header,
                   packet_size)

__all__ = ["SoftwareSwitch", "COUNTER_NAMES", "DEFAULT_ECN_THRESHOLD", "DEFAULT_STALE_TIMEOUT"]

log = logging.getLogger(__name__)

COUNTER_NAMES = ("aggregated", "forwarded", "collisions", "resends", "acks", "dropped", "ecn_marked",
                 "rejected")
#: member keys are job_id << 24 | port (the P4 member_table key), so member ports are below 2**24
MEMBER_PORT_LIMIT = 1 << 24
DEFAULT_ECN_THRESHOLD = 64
DEFAULT_STALE_TIMEOUT = 2.0
#: The ingress port of a datagram from an address no configured port has; no port may take this number,
#: or a forger's packets would enter as that port's.
UNKNOWN_PORT = 0xFFFFFFFF
_I32_MIN = -(2**31)
_I32_MAX = 2**31 - 1
_FLAG_BYTE = 9            # the low byte of the u16 flags word holds the six flag bits


def _set_flags(packet: bytes, flags: int) -> bytes:
    """A copy of ``packet`` with flag bits OR-ed into the flags word."""
    if packet[_FLAG_BYTE] & flags == flags:
        return packet
    b = bytearray(packet)
    b[_FLAG_BYTE] |= flags
    return bytes(b)


class SoftwareSwitch(SwitchControl):
    """An ATP ToR switch in software: aggregator registers in numpy arrays, tables in dicts.

    Thread-safe: ``process`` and every control method take one lock, like a switch's single pipeline.
    """

    def __init__(self, num_aggregators: int = 4096, value_count: int = DEFAULT_VALUE_COUNT, *,
                 ecn_threshold: int = DEFAULT_ECN_THRESHOLD,
                 stale_timeout: float = DEFAULT_STALE_TIMEOUT) -> None:
        if not 1 <= num_aggregators <= 1 << 16:
            raise InvalidArgument(f"num_aggregators must be in 1..65536 (16-bit index), got {num_aggregators}")
        if not 1 <= value_count <= 16000:
            raise InvalidArgument(f"value_count must be in 1..16000, got {value_count}")
        if stale_timeout <= 0:
            raise InvalidArgument(f"stale_timeout must be > 0, got {stale_timeout}")
        self.num_aggregators = int(num_aggregators)
        self.value_count = int(value_count)
        self.packet_size = packet_size(self.value_count)
        self.stale_timeout = float(stale_timeout)
        n = self.num_aggregators
        self._job_seq = np.zeros(n, np.uint32)
        self._bitmap = np.zeros(n, np.uint32)
        self._counter = np.zeros(n, np.int32)
        self._ecn = np.zeros(n, np.bool_)
        self._timestamp = np.zeros(n, np.float64)
        self._collided = np.zeros(n, np.uint32)     # jobID+seq that last collided here, 0: none
        self._values = np.zeros((n, self.value_count), np.int32)
        # what an emitted aggregate carries besides bitmap and values: the index as sent, bitmap1 of a
        # level-0 aggregate (the rack bit) and the fan-in word of the packets
        self._meta_index = np.zeros(n, np.uint16)
        self._meta_b1 = np.zeros(n, np.uint32)
        self._meta_fan = np.zeros(n, np.uint16)
        self._lock = threading.RLock()
        self._ports: dict[int, tuple[str, int]] = {}
        self._jobs: dict[int, JobEntry] = {}
        self._groups: dict[int, MulticastGroup] = {}
        self._members: set[tuple[int, int]] = set()
        self._ecn_threshold = int(ecn_threshold)
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        #: counters outside the control contract
        self.extra = {"emitted": 0, "flushed": 0, "reclaimed": 0, "saturated": 0}
        self.config_version = 0

    # ------------------------------------------------------------------ control: ports
    def set_port(self, port: int, addr: tuple[str, int]) -> None:
        """Map switch port ``port`` to the UDP address ``addr`` (insert or replace)."""
        self._check_port(port)
        try:
            host, udp = str(addr[0]), int(addr[1])
        except (TypeError, ValueError, IndexError) as e:
            raise InvalidArgument(f"port {port}: address must be (host, udp_port), got {addr!r}") from e
        if not 0 < udp < 65536:
            raise InvalidArgument(f"port {port}: UDP port must be in 1..65535, got {udp}")
        with self._lock:
            self._ports[port] = (host, udp)
            self.config_version += 1

    def delete_port(self, port: int) -> None:
        """Remove a port mapping; NotFound if absent."""
        with self._lock:
            if port not in self._ports:
                raise NotFound(f"port {port} is not configured")
            del self._ports[port]
            self.config_version += 1

    def read_ports(self) -> dict[int, tuple[str, int]]:
        """A copy of the port -> UDP address map."""
        with self._lock:
            return dict(self._ports)

    # ------------------------------------------------------------------ control: jobs
    def insert_job(self, entry: JobEntry) -> None:
        """Add a job table row; AlreadyExists if the job id is present."""
        self._check_job(entry)
        with self._lock:
            if entry.job_id in self._jobs:
                raise AlreadyExists(f"job {entry.job_id} already exists")
            self._jobs[entry.job_id] = entry
            self.config_version += 1

    def modify_job(self, entry: JobEntry) -> None:
        """Replace a job table row; NotFound if the job id is absent."""
        self._check_job(entry)
        with self._lock:
            if entry.job_id not in self._jobs:
                raise NotFound(f"job {entry.job_id} does not exist")
            self._jobs[entry.job_id] = entry
            self.config_version += 1

    def delete_job(self, job_id: int) -> None:
        """Remove a job and free every aggregator it holds."""
        with self._lock:
            if job_id not in self._jobs:
                raise NotFound(f"job {job_id} does not exist")
            del self._jobs[job_id]
            held = np.nonzero((self._job_seq >> 24) == job_id)[0]
            for idx in held:
                self._free(int(idx))
            self._collided[(self._collided >> 24) == job_id] = 0
            self.config_version += 1

    def read_jobs(self) -> Sequence[JobEntry]:
        """The job table, ordered by job id."""
        with self._lock:
            return [self._jobs[k] for k in sorted(self._jobs)]

    # ------------------------------------------------------------------ control: source check
    def _check_member(self, job_id: int, port: int) -> None:
        if not 1 <= job_id <= MAX_JOB_ID:
            raise InvalidArgument(f"member job_id must be in 1..{MAX_JOB_ID}, got {job_id}")
        if not isinstance(port, (int, np.integer)) or not 0 <= port < MEMBER_PORT_LIMIT:
            raise InvalidArgument(f"member port must be in 0..{MEMBER_PORT_LIMIT - 1}, got {port!r}")

    def insert_member(self, job_id: int, port: int) -> None:
        """Let ``port`` send gradients of ``job_id``; AlreadyExists if it may already."""
        self._check_member(job_id, port)
        with self._lock:
            if (job_id, port) in self._members:
                raise AlreadyExists(f"port {port} is already a member of job {job_id}")
            self._members.add((int(job_id), int(port)))
            self.config_version += 1

    def delete_member(self, job_id: int, port: int) -> None:
        """Stop accepting gradients of ``job_id`` from ``port``; NotFound if it was not a member."""
        with self._lock:
            if (job_id, port) not in self._members:
                raise NotFound(f"port {port} is not a member of job {job_id}")
            self._members.discard((job_id, port))
            self.config_version += 1

    def read_members(self) -> Sequence[tuple[int, int]]:
        """The (job_id, port) pairs of the source check, sorted."""
        with self._lock:
            return sorted(self._members)

    # ------------------------------------------------------------------ control: multicast
    def insert_mcast_group(self, group: MulticastGroup) -> None:
        """Add a multicast group; AlreadyExists if its id is present."""
        self._check_group(group)
        with self._lock:
            if group.group_id in self._groups:
                raise AlreadyExists(f"multicast group {group.group_id} already exists")
            self._groups[group.group_id] = MulticastGroup(group.group_id, tuple(group.ports))
            self.config_version += 1

    def modify_mcast_group(self, group: MulticastGroup) -> None:
        """Replace a multicast group's ports; NotFound if absent."""
        self._check_group(group)
        with self._lock:
            if group.group_id not in self._groups:
                raise NotFound(f"multicast group {group.group_id} does not exist")
            self._groups[group.group_id] = MulticastGroup(group.group_id, tuple(group.ports))
            self.config_version += 1

    def delete_mcast_group(self, group_id: int) -> None:
        """Remove a multicast group; NotFound if absent."""
        with self._lock:
            if group_id not in self._groups:
                raise NotFound(f"multicast group {group_id} does not exist")
            del self._groups[group_id]
            self.config_version += 1

    def read_mcast_groups(self) -> Sequence[MulticastGroup]:
        """The multicast groups, ordered by id."""
        with self._lock:
            return [self._groups[k] for k in sorted(self._groups)]

    # ------------------------------------------------------------------ control: misc
    def set_ecn_threshold(self, packets: int) -> None:
        """Mark ECN on packets processed while more than ``packets`` wait in the queue."""
        if int(packets) < 0:
            raise InvalidArgument(f"ECN threshold must be >= 0, got {packets}")
        with self._lock:
            self._ecn_threshold = int(packets)

    def ecn_threshold(self) -> int:
        """The queue depth (packets) above which packets are ECN-marked."""
        return self._ecn_threshold

    def counters(self) -> dict[str, int]:
        """A snapshot of the packet counters named in ``COUNTER_NAMES``."""
        with self._lock:
            return dict(self._counters)

    def read_aggregator(self, index: int) -> AggregatorState:
        """A snapshot of aggregator ``index``; InvalidArgument if out of range."""
        if not 0 <= index < self.num_aggregators:
            raise InvalidArgument(f"aggregator index {index} out of range 0..{self.num_aggregators - 1}")
        with self._lock:
            return AggregatorState(index=index, job_seq=int(self._job_seq[index]),
                                   bitmap=int(self._bitmap[index]), counter=int(self._counter[index]),
                                   ecn=bool(self._ecn[index]), timestamp=float(self._timestamp[index]),
                                   values=self._values[index].copy(), collided=int(self._collided[index]))

    def occupied(self) -> int:
        """Number of aggregators currently held."""
        with self._lock:
            return int(np.count_nonzero(self._job_seq))

    def reclaim_stale(self, now: float) -> int:
        """Free every aggregator untouched for longer than ``stale_timeout``; returns how many."""
        with self._lock:
            stale = np.nonzero((self._job_seq != 0) & (now - self._timestamp > self.stale_timeout))[0]
            for idx in stale:
                self._free(int(idx))
            self.extra["reclaimed"] += len(stale)
            return len(stale)

    # ------------------------------------------------------------------ validation
    @staticmethod
    def _check_port(port: int) -> None:
        if not isinstance(port, (int, np.integer)) or not 0 <= port < UNKNOWN_PORT:
            raise InvalidArgument(f"port must be an integer in 0..2**32-2 (2**32-1 stands for "
                                  f"unknown sources), got {port!r}")

    def _check_job(self, e: JobEntry) -> None:
        if not 1 <= e.job_id <= MAX_JOB_ID:
            raise InvalidArgument(f"job_id must be in 1..{MAX_JOB_ID}, got {e.job_id}")
        if not 1 <= e.fan_in <= MAX_FAN_IN:
            raise InvalidArgument(f"job {e.job_id}: fan_in must be in 1..{MAX_FAN_IN}, got {e.fan_in}")
        if e.level not in (0, 1):
            raise InvalidArgument(f"job {e.job_id}: level must be 0 or 1, got {e.level}")
        self._check_port(e.ps_port)
        if e.mcast_group < 0:
            raise InvalidArgument(f"job {e.job_id}: mcast_group must be >= 0, got {e.mcast_group}")

    def _check_group(self, g: MulticastGroup) -> None:
        if g.group_id < 0:
            raise InvalidArgument(f"group_id must be >= 0, got {g.group_id}")
        for p in g.ports:
            self._check_port(p)

    # ------------------------------------------------------------------ dataplane
    def _free(self, idx: int) -> None:
        self._job_seq[idx] = 0
        self._bitmap[idx] = 0
        self._counter[idx] = 0
        self._ecn[idx] = False

    def _emit(self, idx: int, level: int, resend: bool) -> bytes:
        """The wire bytes of the aggregate held at ``idx``."""
        flags = FLAG_EDGE | (FLAG_ECN if self._ecn[idx] else 0) | (FLAG_RESEND if resend else 0)
        fan_word = int(self._meta_fan[idx]) | flags
        if level == 0:
            b0, b1 = int(self._bitmap[idx]), int(self._meta_b1[idx])
        else:
            b0, b1 = 0, int(self._bitmap[idx])
        head = (b0.to_bytes(4, "big") + b1.to_bytes(4, "big") + fan_word.to_bytes(2, "big")
                + int(self._meta_index[idx]).to_bytes(2, "big") + int(self._job_seq[idx]).to_bytes(4, "big"))
        return head + self._values[idx].astype(">i4").tobytes()

    def _out(self, port: int, data: bytes, out: list[tuple[int, bytes]]) -> None:
        if port in self._ports:
            out.append((port, data))
        else:
            self._counters["dropped"] += 1
            log.debug("no address for port %d; packet dropped", port)

    def process_batch(self, rows: np.ndarray, lengths: Sequence[int], in_ports: Sequence[int], now: float,
                      queue_depths: Sequence[int] | None = None) -> list[tuple[int, bytes]]:
        """Run a batch of received packets (row ``i`` of ``rows``, ``lengths[i]`` bytes, entered on
        ``in_ports[i]``); same outputs, counters and registers as ``process`` on each packet in turn,
        computed batch-wise (see ``innet.batch_dataplane``)."""
        from .batch_dataplane import process_batch
        return process_batch(self, rows, lengths, in_ports, now, queue_depths)

    # Complexity accepted: the reference dataplane: ATP's per-packet pipeline in order.
    def process(self, packet: bytes, in_port: int, now: float, queue_depth: int = 0  # noqa: C901
                ) -> list[tuple[int, bytes]]:
        """Run one packet through the dataplane; returns the (out_port, packet bytes) to emit.

        ``queue_depth`` is the number of packets waiting behind this one (for ECN marking).
        Malformed packets and packets of unknown jobs are dropped and counted, never raised.
        """
        c = self._counters
        with self._lock:
            if len(packet) != self.packet_size:
                c["dropped"] += 1
                log.debug("dropped a %d-byte packet (expected %d)", len(packet), self.packet_size)
                return []
            try:
                h = decode_header(packet)
            except WireError as e:
                c["dropped"] += 1
                log.debug("dropped a garbled packet: %s", e)
                return []
            job = self._jobs.get(h.job_id)
            if job is None:
                c["dropped"] += 1
                log.debug("dropped a packet of unknown job %d", h.job_id)
                return []
            flags = h.flags
            if (in_port != job.ps_port) if flags & FLAG_ACK else ((h.job_id, in_port) not in self._members):
                c["rejected"] += 1
                log.debug("job %d: %s packet from port %s rejected (not a registered source)", h.job_id,
                          "parameter" if flags & FLAG_ACK else "gradient", in_port)
                return []
            if queue_depth > self._ecn_threshold:
                c["ecn_marked"] += 1
                flags |= FLAG_ECN
                packet = _set_flags(packet, FLAG_ECN)
            idx = h.agg_index % self.num_aggregators
            out: list[tuple[int, bytes]] = []

            if flags & FLAG_ACK:
                c["acks"] += 1
                if self._job_seq[idx] == h.job_seq:
                    self._free(idx)
                if self._collided[idx] == h.job_seq:
                    self._collided[idx] = 0
                group = self._groups.get(job.mcast_group)
                if group is None:
                    c["dropped"] += 1
                    log.debug("job %d: multicast group %d missing; ACK dropped", h.job_id, job.mcast_group)
                    return out
                for p in group.ports:
                    self._out(p, packet, out)
                return out

            if flags & FLAG_RESEND:
                c["resends"] += 1
                if self._job_seq[idx] == h.job_seq:
                    self._out(job.ps_port, self._emit(idx, job.level, resend=True), out)
                    self.extra["flushed"] += 1
                    self._free(idx)
                c["forwarded"] += 1
                self._out(job.ps_port, packet, out)
                return out

            if job.level == 0:
                eligible: bool | int = not flags & (FLAG_EDGE | FLAG_OVERFLOW | FLAG_COLLISION)
                key = h.bitmap0
            else:
                eligible = (flags & FLAG_EDGE and not flags & (FLAG_OVERFLOW | FLAG_COLLISION)
                            and h.bitmap0 != 0 and h.bitmap0.bit_count() == h.fan_in0)
                key = h.bitmap1
            if not eligible or key == 0:
                c["forwarded"] += 1
                self._out(job.ps_port, packet, out)
                return out

            held = int(self._job_seq[idx])
            if held and held != h.job_seq and now - self._timestamp[idx] > self.stale_timeout:
                self._free(idx)
                self.extra["reclaimed"] += 1
                held = 0
            if held == 0 and self._collided[idx] == h.job_seq:
                held = -1                      # its fragment's first packet collided here: to the PS too
            if held == 0:
                self._job_seq[idx] = h.job_seq
                self._values[idx] = 0
                self._meta_index[idx] = h.agg_index
                self._meta_b1[idx] = h.bitmap1
                self._meta_fan[idx] = int.from_bytes(packet[8:10], "big") & ~0x3F
            elif held != h.job_seq:
                self._collided[idx] = h.job_seq
                c["collisions"] += 1
                c["forwarded"] += 1
                self._out(job.ps_port, _set_flags(packet, FLAG_COLLISION), out)
                return out

            have = int(self._bitmap[idx])
            if key & have:
                if key & have == key:
                    c["dropped"] += 1          # duplicate: every contribution already aggregated
                    return out
                c["forwarded"] += 1            # partial overlap cannot be merged: let the PS sort it out
                self._out(job.ps_port, packet, out)
                return out
            if self._counter[idx] >= job.fan_in:
                c["forwarded"] += 1            # more contributions than the fan-in: misconfiguration
                self._out(job.ps_port, packet, out)
                return out

            payload = np.frombuffer(packet, dtype=">i4", count=self.value_count, offset=HEADER_SIZE)
            acc = self._values[idx].astype(np.int64)
            acc += payload
            if acc.max() > _I32_MAX or acc.min() < _I32_MIN:
                np.clip(acc, _I32_MIN, _I32_MAX, out=acc)
                self.extra["saturated"] += 1
            self._values[idx] = acc
            self._bitmap[idx] = have | key
            self._counter[idx] += key.bit_count()
            if flags & FLAG_ECN:
                self._ecn[idx] = True
            self._timestamp[idx] = now
            c["aggregated"] += 1
            if self._counter[idx] >= job.fan_in:
                self.extra["emitted"] += 1
                self._out(job.ps_port, self._emit(idx, job.level, resend=False), out)
            return out

