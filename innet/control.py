"""The control API of the ATP switch: what the P4Runtime server drives and the dataplane implements.

This module is the contract between ``innet.switch`` (the software dataplane) and
``innet.p4runtime`` (the P4Runtime gRPC server). It holds only data types, errors and the Protocol.

Ports: the software switch has numbered ports (u32, as P4Runtime egress ports). Each port maps to a UDP
address (host, udp_port) of a worker, a PS, or another switch; ``set_port`` configures that map. A
datagram enters on the port whose address it came from (its source address is the match key).

Source check: a job's parameter (ACK) packets are accepted only on its ``ps_port``, its gradient packets
only on the ports registered for it with ``insert_member``; the rest is dropped and counted ``rejected``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol
from collections.abc import Sequence

import numpy as np


class ControlError(Exception):
    """Base of control-plane errors; each maps to a gRPC / P4Runtime canonical code."""

    code = "UNKNOWN"


class AlreadyExists(ControlError):
    code = "ALREADY_EXISTS"


class NotFound(ControlError):
    code = "NOT_FOUND"


class InvalidArgument(ControlError):
    code = "INVALID_ARGUMENT"


class ResourceExhausted(ControlError):
    code = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class JobEntry:
    """One row of the job table: how the switch treats packets of ``job_id``.

    ``fan_in`` is the number of gradient contributions this switch waits for before emitting an
    aggregate (fanInDegree of the level this switch serves); ``ps_port`` is the switch port leading to
    the job's parameter server (or to the next-level switch); ``mcast_group`` is the group the parameter
    (ACK) packet is replicated to; ``level`` is 0 for a worker-rack ToR, 1 for the PS-rack ToR.
    """

    job_id: int
    fan_in: int
    ps_port: int
    mcast_group: int
    level: int = 0


@dataclass(frozen=True)
class MulticastGroup:
    group_id: int
    ports: tuple[int, ...]


@dataclass(frozen=True)
class AggregatorState:
    """A snapshot of one aggregator slot (what register reads return)."""

    index: int
    job_seq: int          # jobID+sequence number held, 0 when free
    bitmap: int
    counter: int
    ecn: bool
    timestamp: float      # last-touched time, seconds (switch clock)
    values: np.ndarray = field(repr=False)  # int32[value_count]
    collided: int = 0     # jobID+seq whose packet last collided here (its later packets follow to the PS)


class SwitchControl(Protocol):
    """What a control plane may do to a switch. Methods are thread-safe; errors are ControlError."""

    num_aggregators: int
    value_count: int

    def set_port(self, port: int, addr: tuple[str, int]) -> None: ...
    def delete_port(self, port: int) -> None: ...
    def read_ports(self) -> dict[int, tuple[str, int]]: ...

    def insert_job(self, entry: JobEntry) -> None: ...            # AlreadyExists if job_id present
    def modify_job(self, entry: JobEntry) -> None: ...            # NotFound if absent
    def delete_job(self, job_id: int) -> None: ...                # NotFound if absent
    def read_jobs(self) -> Sequence[JobEntry]: ...

    # the source check: (job_id, port) pairs whose port may send the job's gradients (port < 2**24)
    def insert_member(self, job_id: int, port: int) -> None: ...  # AlreadyExists if present
    def delete_member(self, job_id: int, port: int) -> None: ...  # NotFound if absent
    def read_members(self) -> Sequence[tuple[int, int]]: ...

    def insert_mcast_group(self, group: MulticastGroup) -> None: ...   # AlreadyExists
    def modify_mcast_group(self, group: MulticastGroup) -> None: ...   # NotFound
    def delete_mcast_group(self, group_id: int) -> None: ...           # NotFound
    def read_mcast_groups(self) -> Sequence[MulticastGroup]: ...

    def set_ecn_threshold(self, packets: int) -> None: ...   # queue depth (packets) above which ECN is marked
    def ecn_threshold(self) -> int: ...

    #: Counter names: "aggregated", "forwarded", "collisions", "resends", "acks", "dropped", "ecn_marked", "rejected".
    #: ("rejected": packets of a known job from a source not registered for it.)
    def counters(self) -> dict[str, int]: ...
    def read_aggregator(self, index: int) -> AggregatorState: ...     # InvalidArgument if out of range
