"""Coflow data model: flows, coflows, port capacities and the allocation a policy returns.

A fabric is modelled as a non-blocking switch whose only constraints are its ingress ports (where
mappers / source ranks send) and its egress ports (where reducers / destination ranks receive); a port's
capacity is a rate in bytes per second. A coflow keeps its flows in numpy arrays so that policies and the
simulator can work on thousands of flows without per-flow Python objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from .errors import CoflowError

__all__ = ["Flow", "Coflow", "PortCapacities", "Allocation", "GBIT", "MB"]

#: One gigabit per second as the brief defines it (2**30 bit/s), in bytes per second.
GBIT: float = float(2 ** 30) / 8.0
#: One "MB" of the coflow-benchmark trace format (2**20 bytes).
MB: float = float(2 ** 20)


@dataclass(frozen=True)
class Flow:
    """One point-to-point transfer of a coflow: ``bytes`` from ingress ``src_port`` to egress ``dst_port``.

    ``remaining`` defaults to ``bytes`` (nothing sent yet).
    """

    src_port: int
    dst_port: int
    bytes: float
    remaining: float | None = None

    def __post_init__(self) -> None:
        if self.remaining is None:
            object.__setattr__(self, "remaining", float(self.bytes))


class Coflow:
    """A set of flows with a common completion goal (Varys' coflow), optionally with a deadline and parents.

    ``arrival`` and ``deadline`` are in seconds; ``deadline`` is *relative* to ``arrival`` (the coflow
    should complete by ``arrival + deadline``). ``parents`` are ids of coflows that must complete before
    this one is released (a DAG of stages); ``dag_node`` names the job stage that consumes this coflow
    (see :class:`twisternet.coflow.dag.JobDag`). ``weight`` scales the coflow's importance where a
    policy supports weights (the ``dag`` LP objective). Flow state lives in numpy arrays ``src``,
    ``dst``, ``size`` and ``remaining`` (mutated in place as bytes are sent).
    """

    __slots__ = ("id", "arrival", "deadline", "parents", "dag_node", "weight",
                 "src", "dst", "size", "remaining", "_gamma_isolated_cache", "version",
                 "_derived", "_live_cache")

    def __init__(self, id: Hashable, arrival: float, flows: Iterable[Flow | tuple] | None = None,
                 deadline: float | None = None, parents: Sequence[Hashable] = (),
                 dag_node: str | None = None, weight: float = 1.0, *,
                 src: np.ndarray | None = None, dst: np.ndarray | None = None,
                 size: np.ndarray | None = None, remaining: np.ndarray | None = None) -> None:
        self.id = id
        self.arrival = float(arrival)
        if not math.isfinite(self.arrival) or self.arrival < 0:
            raise CoflowError(f"coflow {id!r}: arrival must be a finite time >= 0, got {arrival!r}")
        if deadline is not None:
            deadline = float(deadline)
            if not (deadline > 0) or not math.isfinite(deadline):
                raise CoflowError(f"coflow {id!r}: deadline must be a positive duration, got {deadline!r}")
        self.deadline = deadline
        self.parents = tuple(parents)
        self.dag_node = dag_node
        self.weight = float(weight)
        if not (self.weight > 0):
            raise CoflowError(f"coflow {id!r}: weight must be > 0, got {weight!r}")
        if flows is not None:
            if src is not None:
                raise CoflowError(f"coflow {id!r}: give either flows or arrays, not both")
            fl = [f if isinstance(f, Flow) else Flow(*f) for f in flows]
            src = np.array([f.src_port for f in fl], dtype=np.int64)
            dst = np.array([f.dst_port for f in fl], dtype=np.int64)
            size = np.array([f.bytes for f in fl], dtype=np.float64)
            remaining = np.array([f.remaining for f in fl], dtype=np.float64)
        if src is None or dst is None or size is None:
            raise CoflowError(f"coflow {id!r}: no flows given")
        self.src = np.asarray(src, dtype=np.int64).reshape(-1)
        self.dst = np.asarray(dst, dtype=np.int64).reshape(-1)
        self.size = np.asarray(size, dtype=np.float64).reshape(-1)
        self.remaining = (self.size.copy() if remaining is None
                          else np.array(remaining, dtype=np.float64).reshape(-1))
        n = self.size.shape[0]
        if n == 0:
            raise CoflowError(f"coflow {id!r}: a coflow needs at least one flow")
        if not (self.src.shape[0] == self.dst.shape[0] == n == self.remaining.shape[0]):
            raise CoflowError(f"coflow {id!r}: flow arrays differ in length")
        if (self.src < 0).any() or (self.dst < 0).any():
            raise CoflowError(f"coflow {id!r}: ports must be >= 0")
        if not np.isfinite(self.size).all() or (self.size <= 0).any():
            raise CoflowError(f"coflow {id!r}: every flow needs a finite size > 0 bytes")
        if (self.remaining < 0).any() or (self.remaining > self.size * (1 + 1e-12)).any():
            raise CoflowError(f"coflow {id!r}: remaining bytes must lie in [0, bytes]")
        self._gamma_isolated_cache: tuple | None = None
        #: Progress counter for caches. None (the default): nothing derived from ``remaining`` is
        #: cached. An int: whoever changes ``remaining`` must increment it (the simulator does, at
        #: every event that moves the coflow), and the rate-allocation helpers may reuse what they
        #: derived from ``remaining`` (port loads, live flows) while it stays the same. A versioned
        #: coflow's flows never restart: a finished flow (remaining 0) stays finished.
        self.version: int | None = None
        self._derived: tuple[int, dict] | None = None
        self._live_cache: tuple[int, Any] | None = None

    # ------------------------------------------------------------------ views
    @property
    def flows(self) -> list[Flow]:
        """The flows as :class:`Flow` values (a snapshot; the arrays are the live state)."""
        return [Flow(int(s), int(d), float(b), float(r))
                for s, d, b, r in zip(self.src, self.dst, self.size, self.remaining)]

    def __len__(self) -> int:
        return int(self.size.shape[0])

    def __iter__(self) -> Iterator[Flow]:
        return iter(self.flows)

    @property
    def total_bytes(self) -> float:
        """Sum of the flows' sizes."""
        return float(self.size.sum())

    @property
    def remaining_bytes(self) -> float:
        """Bytes still to send over all flows."""
        return float(self.remaining.sum())

    @property
    def width(self) -> int:
        """Number of flows."""
        return len(self)

    @property
    def done(self) -> bool:
        """True once every flow has sent all its bytes."""
        return bool((self.remaining <= 0).all())

    @property
    def absolute_deadline(self) -> float | None:
        """``arrival + deadline``, or None without a deadline."""
        return None if self.deadline is None else self.arrival + self.deadline

    def copy(self) -> Coflow:
        """A fresh coflow with the same flows and their *remaining* state copied (for reruns)."""
        return Coflow(self.id, self.arrival, deadline=self.deadline, parents=self.parents,
                      dag_node=self.dag_node, weight=self.weight, src=self.src.copy(),
                      dst=self.dst.copy(), size=self.size.copy(), remaining=self.remaining.copy())

    def reset(self) -> Coflow:
        """A fresh copy with nothing sent (``remaining = bytes``)."""
        c = self.copy()
        c.remaining = c.size.copy()
        return c

    def max_port(self) -> tuple[int, int]:
        """Largest ingress and egress port index used."""
        return int(self.src.max()), int(self.dst.max())

    def __repr__(self) -> str:
        return (f"Coflow(id={self.id!r}, arrival={self.arrival:g}, flows={len(self)}, "
                f"bytes={self.total_bytes:g}, deadline={self.deadline!r})")


@dataclass(frozen=True)
class PortCapacities:
    """Capacity in bytes/s of every ingress and every egress port of a non-blocking fabric."""

    ingress: np.ndarray
    egress: np.ndarray

    def __post_init__(self) -> None:
        ing = np.asarray(self.ingress, dtype=np.float64).reshape(-1)
        eg = np.asarray(self.egress, dtype=np.float64).reshape(-1)
        for name, arr in (("ingress", ing), ("egress", eg)):
            if arr.size == 0:
                raise CoflowError(f"{name} capacities: need at least one port")
            if not np.isfinite(arr).all() or (arr <= 0).any():
                raise CoflowError(f"{name} capacities must be finite and > 0")
        ing.setflags(write=False)
        eg.setflags(write=False)
        object.__setattr__(self, "ingress", ing)
        object.__setattr__(self, "egress", eg)

    @classmethod
    def uniform(cls, num_ports: int, rate: float = GBIT) -> PortCapacities:
        """``num_ports`` ingress and egress ports, each of ``rate`` bytes/s (default 1 Gbit/s = 2**27 B/s)."""
        if num_ports <= 0:
            raise CoflowError(f"num_ports must be > 0, got {num_ports}")
        return cls(np.full(num_ports, float(rate)), np.full(num_ports, float(rate)))

    @property
    def num_ingress(self) -> int:
        """Number of ingress ports."""
        return int(self.ingress.shape[0])

    @property
    def num_egress(self) -> int:
        """Number of egress ports."""
        return int(self.egress.shape[0])

    def check(self, coflow: Coflow) -> None:
        """Raise :class:`CoflowError` if ``coflow`` uses a port this fabric does not have."""
        s, d = coflow.max_port()
        if s >= self.num_ingress or d >= self.num_egress:
            raise CoflowError(f"coflow {coflow.id!r} uses ingress port {s} / egress port {d}, but the "
                              f"fabric has {self.num_ingress} ingress and {self.num_egress} egress ports")


@dataclass
class Allocation:
    """What a policy decides: a rate (bytes/s) for every flow of every active coflow, and an order.

    ``rates[cid][i]`` is the rate of flow ``i`` of coflow ``cid`` (same order as the coflow's arrays).
    ``order`` lists coflow ids most urgent first; ``priority(cid)`` is the position (0 = most urgent).
    """

    rates: dict[Hashable, np.ndarray] = field(default_factory=dict)
    order: list[Hashable] = field(default_factory=list)

    def priorities(self) -> dict[Hashable, int]:
        """Coflow id -> rank order (0 = most urgent)."""
        return {cid: i for i, cid in enumerate(self.order)}

    def priority(self, cid: Hashable) -> int:
        """Rank of coflow ``cid`` (0 = most urgent); ValueError if absent."""
        return self.order.index(cid)

    def coflow_rate(self, cid: Hashable) -> float:
        """Sum of the rates of ``cid``'s flows."""
        r = self.rates.get(cid)
        return 0.0 if r is None else float(r.sum())

    def port_loads(self, coflows: Mapping[Hashable, Coflow] | Sequence[Coflow],
                   caps: PortCapacities) -> tuple[np.ndarray, np.ndarray]:
        """Total allocated rate per ingress and egress port (for checking feasibility)."""
        items = coflows.values() if isinstance(coflows, Mapping) else coflows
        ing = np.zeros(caps.num_ingress)
        eg = np.zeros(caps.num_egress)
        for c in items:
            r = self.rates.get(c.id)
            if r is None:
                continue
            ing += np.bincount(c.src, weights=r, minlength=caps.num_ingress)
            eg += np.bincount(c.dst, weights=r, minlength=caps.num_egress)
        return ing, eg
