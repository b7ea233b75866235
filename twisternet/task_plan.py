"""Task plan: which worker process (rank) runs each logical task of a dataflow graph, and which ranks
share a host (:class:`twisternet.topology.Topology`, learnt from the bootstrap or by the first operation
that needs it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .errors import ConfigError
from .topology import Topology


class TaskPlan:
    """Maps task ids to ranks. By default task ``i`` runs on rank ``i`` for ``i`` in ``range(world)``.

    Sources and destinations of operations are task ids; several tasks may share a rank (they then share
    the operation object in that process) and a rank may run no task of a given operation.
    """

    def __init__(self, world: int, assignment: Mapping[int, int] | None = None) -> None:
        if world < 1:
            raise ConfigError("world", f"must be >= 1, got {world}")
        self.world = world
        if assignment is None:
            assignment = {i: i for i in range(world)}
        self._rank_of: dict[int, int] = {}
        for task, rank in assignment.items():
            if not isinstance(task, int) or isinstance(task, bool) or task < 0:
                raise ConfigError("plan", f"task ids are non-negative ints, got {task!r}")
            if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
                raise ConfigError("plan", f"task {task} mapped to rank {rank!r}, outside [0, {world})")
            self._rank_of[task] = rank
        self._tasks_of: dict[int, list[int]] = {r: [] for r in range(world)}
        for task in sorted(self._rank_of):
            self._tasks_of[self._rank_of[task]].append(task)
        self._hosts: dict[int, str] = {}

    # ------------------------------------------------------------------ hosts
    def set_hosts(self, hosts: Mapping[int, str]) -> None:
        """Record the host id of ranks (``rank -> host id``, see :mod:`twisternet.topology`); a rank's
        host never changes, so a second, different id for it is a ConfigError."""
        for r, h in hosts.items():
            if not isinstance(r, int) or not 0 <= r < self.world:
                raise ConfigError("plan", f"host of rank {r!r}, outside [0, {self.world})")
            old = self._hosts.get(r)
            if old is not None and old != h:
                raise ConfigError("plan", f"rank {r} was on host {old!r}, now said to be on {h!r}")
            self._hosts[r] = str(h)

    def topology(self, ranks: Iterable[int] | None = None) -> Topology | None:
        """Which of ``ranks`` (default: all) share a host; None while some rank's host is unknown."""
        want = range(self.world) if ranks is None else ranks
        try:
            return Topology({r: self._hosts[r] for r in want})
        except KeyError:
            return None

    def host_of(self, rank: int) -> str | None:
        """The host id of ``rank``, if known."""
        return self._hosts.get(rank)

    @classmethod
    def round_robin(cls, world: int, ntasks: int) -> TaskPlan:
        """Tasks ``0..ntasks-1`` dealt to ranks in turn."""
        return cls(world, {t: t % world for t in range(ntasks)})

    @property
    def tasks(self) -> list[int]:
        """All task ids, sorted."""
        return sorted(self._rank_of)

    def rank_of(self, task: int) -> int:
        """The rank running ``task``; ConfigError if the plan has no such task."""
        try:
            return self._rank_of[task]
        except KeyError:
            raise ConfigError("plan", f"task {task!r} is not in the task plan") from None

    def tasks_of(self, rank: int) -> list[int]:
        """Tasks on ``rank``, sorted."""
        return list(self._tasks_of.get(rank, []))

    def ranks_of(self, tasks: Iterable[int]) -> list[int]:
        """Distinct ranks running ``tasks``, sorted."""
        return sorted({self.rank_of(t) for t in tasks})

    def __contains__(self, task: object) -> bool:
        return task in self._rank_of

    def as_dict(self) -> dict[int, int]:
        return dict(self._rank_of)

    def __repr__(self) -> str:
        return f"TaskPlan(world={self.world}, {self._rank_of})"
