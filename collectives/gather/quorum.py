"""Batch Gather's finish quorum: a partial barrier over the sources' ``finish`` calls, run at the
destination, so the result may form without stragglers (a mixin of :class:`~collectives.gather.gather.Gather`).

State (made by :meth:`FinishQuorum._quorum_barrier` and :meth:`FinishQuorum._build_quorum`):
``_quorum`` (None, or the barrier state machine), ``_quorum_rules``, ``_quorum_timer``."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from twisternet.errors import ConfigError

from ..uptree import UpTreeState

log = logging.getLogger(__name__)


class FinishQuorum(UpTreeState):
    """Gather part: the finish quorum (batch only)."""

    # made in Gather.__init__ (and by _quorum_barrier)
    _quorum: Any                           # None, or the partial barrier's state machine
    _quorum_rules: dict[str, Any]
    _quorum_timer: threading.Timer | None
    left_out: list[int] | None

    def _quorum_barrier(self, quorum: Any, allowed: bool) -> Any:
        """A partial barrier over the sources' finishes, run at the destination (None: wait for all).

        ``quorum`` is a dict (or BarrierSpec) of partial-barrier rules without ``max`` (the number of
        sources): ``timeout``, ``percent``, ``min_wait``, ``knee``. When it fires, the destination's
        results hold the records of the sources that had finished; ``left_out`` names the others and
        whatever they send later is dropped.
        """
        if quorum is None:
            return None
        if not allowed:     # batch Gather only
            raise ConfigError("quorum", "a finish quorum is for batch Gather only")
        from ..barrier.specs import BarrierSpec
        rules = quorum.to_dict() if isinstance(quorum, BarrierSpec) else dict(quorum)
        rules.pop("max", None)
        rules.pop("late", None)
        unknown = set(rules) - {"timeout", "percent", "min_wait", "knee"}
        if unknown:
            raise ConfigError("quorum", f"unknown rules {sorted(unknown)}; use timeout, percent, min_wait, knee")
        self._quorum_rules = rules
        self._quorum_timer = None
        return True   # the state machine is built by _build_quorum, once the sources are known

    def _build_quorum(self) -> None:
        """The quorum's state machine, from the rules, once the sources are known (in ``_setup``)."""
        if self._quorum is not None:
            from ..barrier.partial import PartialBarrierMachine as _Rules
            self._quorum = _Rules(f"gather-quorum-{self.edge}", max=len(self.sources), late="pass",
                                  **self._quorum_rules)

    def _root_finished(self, tasks: list[int]) -> None:
        super()._root_finished(tasks)
        if self._quorum is None or self.left_out is not None:
            return
        now = time.monotonic()
        releases: list[Any] = []
        for t in tasks:
            releases.extend(self._quorum.enter(str(t), 0, now).releases)
        self._quorum_settle(releases)

    def _quorum_tick(self) -> None:
        with self._lock:
            if self.left_out is None and not self._closed:
                self._quorum_settle(self._quorum.tick(time.monotonic()))
        self._after()

    def _quorum_settle(self, releases: list[Any]) -> None:
        """Under the lock: complete on a fire, else arm a timer for the barrier's next deadline."""
        if releases:
            passed = {int(label) for label in releases[0].fire.passed}
            node = next(iter(self._nodes.values()))
            node.complete = True
            store = node.state
            self.left_out = sorted(set(self.sources) - passed)
            if self.left_out:
                log.warning("%s on edge %d: finish quorum (%s) reached without sources %s; their records "
                            "are left out", self.describe(), self.edge, releases[0].fire.reason.value,
                            self.left_out)
            self._complete(node.tid, lambda: (r for r in store if r[0] in passed),
                           lambda: (v for t, v in store if t in passed))
            self._changed = True
            return
        deadline = self._quorum.next_deadline()
        if deadline is not None:
            if self._quorum_timer is not None:
                self._quorum_timer.cancel()
            self._quorum_timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._quorum_tick)
            self._quorum_timer.daemon = True
            self._quorum_timer.start()
