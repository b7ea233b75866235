"""An in-memory ``SwitchControl`` for the P4Runtime server and shell tests (its own checks are in
``test_p4_fake_switch.py``).

The fake holds plain dicts and numpy arrays and lets tests plant aggregator state and counter values, so
server reads can be compared with values the test chose (not with the server's own output).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from innet.control import (
    AggregatorState, AlreadyExists, InvalidArgument, JobEntry, MulticastGroup, NotFound,
)

COUNTER_NAMES = ("aggregated", "forwarded", "collisions", "resends", "acks", "dropped", "ecn_marked",
                 "rejected")


class FakeSwitch:
    """SwitchControl in memory; ``plant`` and ``bump`` let tests set dataplane state directly."""

    def __init__(self, num_aggregators: int = 16, value_count: int = 4) -> None:
        self.num_aggregators = num_aggregators
        self.value_count = value_count
        self._lock = threading.Lock()
        self._ports: dict[int, tuple[str, int]] = {}
        self._jobs: dict[int, JobEntry] = {}
        self._groups: dict[int, MulticastGroup] = {}
        self._members: set[tuple[int, int]] = set()
        self._ecn = 0
        self._counters = {name: 0 for name in COUNTER_NAMES}
        self._job_seq = np.zeros(num_aggregators, np.uint32)
        self._bitmap = np.zeros(num_aggregators, np.uint32)
        self._counter = np.zeros(num_aggregators, np.int64)
        self._ecn_bits = np.zeros(num_aggregators, bool)
        self._timestamp = np.zeros(num_aggregators, np.float64)
        self._values = np.zeros((num_aggregators, value_count), np.int32)

    # ---- test hooks
    def plant(self, index: int, job_seq: int, bitmap: int, counter: int, ecn: bool, timestamp: float,
              values) -> None:
        with self._lock:
            self._job_seq[index] = job_seq
            self._bitmap[index] = bitmap
            self._counter[index] = counter
            self._ecn_bits[index] = ecn
            self._timestamp[index] = timestamp
            self._values[index] = np.asarray(values, np.int32)

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    # ---- SwitchControl
    def set_port(self, port: int, addr: tuple[str, int]) -> None:
        with self._lock:
            self._ports[port] = (str(addr[0]), int(addr[1]))

    def delete_port(self, port: int) -> None:
        with self._lock:
            if port not in self._ports:
                raise NotFound(f"port {port}")
            del self._ports[port]

    def read_ports(self) -> dict[int, tuple[str, int]]:
        with self._lock:
            return dict(self._ports)

    def insert_job(self, entry: JobEntry) -> None:
        if entry.fan_in < 1:
            raise InvalidArgument(f"fan_in must be >= 1, got {entry.fan_in}")
        with self._lock:
            if entry.job_id in self._jobs:
                raise AlreadyExists(f"job {entry.job_id} already exists")
            self._jobs[entry.job_id] = entry

    def modify_job(self, entry: JobEntry) -> None:
        with self._lock:
            if entry.job_id not in self._jobs:
                raise NotFound(f"job {entry.job_id} does not exist")
            self._jobs[entry.job_id] = entry

    def delete_job(self, job_id: int) -> None:
        with self._lock:
            if job_id not in self._jobs:
                raise NotFound(f"job {job_id} does not exist")
            del self._jobs[job_id]

    def read_jobs(self) -> Sequence[JobEntry]:
        with self._lock:
            return list(self._jobs.values())

    def insert_member(self, job_id: int, port: int) -> None:
        with self._lock:
            if (job_id, port) in self._members:
                raise AlreadyExists(f"member {job_id}/{port}")
            self._members.add((job_id, port))

    def delete_member(self, job_id: int, port: int) -> None:
        with self._lock:
            if (job_id, port) not in self._members:
                raise NotFound(f"member {job_id}/{port}")
            self._members.discard((job_id, port))

    def read_members(self) -> Sequence[tuple[int, int]]:
        with self._lock:
            return sorted(self._members)

    def insert_mcast_group(self, group: MulticastGroup) -> None:
        with self._lock:
            if group.group_id in self._groups:
                raise AlreadyExists(f"multicast group {group.group_id} already exists")
            self._groups[group.group_id] = group

    def modify_mcast_group(self, group: MulticastGroup) -> None:
        with self._lock:
            if group.group_id not in self._groups:
                raise NotFound(f"multicast group {group.group_id} does not exist")
            self._groups[group.group_id] = group

    def delete_mcast_group(self, group_id: int) -> None:
        with self._lock:
            if group_id not in self._groups:
                raise NotFound(f"multicast group {group_id} does not exist")
            del self._groups[group_id]

    def read_mcast_groups(self) -> Sequence[MulticastGroup]:
        with self._lock:
            return list(self._groups.values())

    def set_ecn_threshold(self, packets: int) -> None:
        if packets < 0:
            raise InvalidArgument("negative threshold")
        with self._lock:
            self._ecn = packets

    def ecn_threshold(self) -> int:
        with self._lock:
            return self._ecn

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def read_aggregator(self, index: int) -> AggregatorState:
        if not 0 <= index < self.num_aggregators:
            raise InvalidArgument(f"aggregator index {index} out of range")
        with self._lock:
            return AggregatorState(
                index=index, job_seq=int(self._job_seq[index]), bitmap=int(self._bitmap[index]),
                counter=int(self._counter[index]), ecn=bool(self._ecn_bits[index]),
                timestamp=float(self._timestamp[index]), values=self._values[index].copy())
