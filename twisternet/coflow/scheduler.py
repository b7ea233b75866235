"""The pluggable coflow ``Scheduler`` interface and the policy registry.

A policy is a class deriving from :class:`Scheduler`. The simulator, the live runtime table and the
channels all drive it the same way:

* ``on_arrival(coflow, now, capacities) -> bool`` when a coflow is released; returning False rejects
  it (admission control). Rejected coflows are reported by the caller and then either never passed to
  ``allocate`` again (``serve_rejected`` False) or passed along as best-effort work.
* ``allocate(coflows, now, capacities) -> Allocation`` whenever the set of active coflows or their
  progress changes (arrival, completion, a policy timer): a rate for every flow of every active coflow
  and an order of the coflows (0 = most urgent). Rates must respect every port capacity.
* ``on_completion(coflow, now)`` once all of a coflow's flows are done (or it is withdrawn).
* ``next_timer(now) -> float | None``: the next time at which the policy's decision changes even if
  no coflow arrives or completes (e.g. the start or end of a starvation-avoidance window).

Add a policy by subclassing and registering it::

    class MyPolicy(Scheduler):
        def allocate(self, coflows, now, capacities): ...
    register_policy("mine", MyPolicy)
    sched = get_policy("mine", some_option=3)
"""

from __future__ import annotations

import abc
import logging
from typing import Any
from collections.abc import Callable, Hashable, Sequence

from .errors import CoflowError, UnknownPolicyError
from .model import Allocation, Coflow, PortCapacities

__all__ = ["Scheduler", "register_policy", "get_policy", "policy_names", "unregister_policy"]

log = logging.getLogger(__name__)


class Scheduler(abc.ABC):
    """Base class of coflow scheduling policies (see the module docstring for the call protocol)."""

    #: Registered name (set by :func:`register_policy`).
    name: str = "?"
    #: Whether rejected coflows are still handed to ``allocate`` as best-effort work.
    serve_rejected: bool = False

    def __init__(self) -> None:
        self.rejected: list[Hashable] = []

    def on_arrival(self, coflow: Coflow, now: float, capacities: PortCapacities) -> bool:
        """A coflow was released at ``now``; return False to reject it. Default: admit everything."""
        return True

    def on_completion(self, coflow: Coflow, now: float) -> None:  # noqa: B027 - an optional hook
        """A coflow finished (or was withdrawn) at ``now``. Default: nothing."""

    def next_timer(self, now: float) -> float | None:
        """Next time after ``now`` at which the policy wants to be re-run without other events."""
        return None

    @abc.abstractmethod
    def allocate(self, coflows: Sequence[Coflow], now: float, capacities: PortCapacities) -> Allocation:
        """Rates for every flow of the active ``coflows`` at time ``now``, and their priority order."""

    def reject(self, coflow: Coflow, reason: str) -> bool:
        """Record a rejection (used by admission-controlled policies); returns False."""
        self.rejected.append(coflow.id)
        log.info("policy %s rejected coflow %r: %s", self.name, coflow.id, reason)
        return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} policy={self.name!r}>"


_REGISTRY: dict[str, Callable[..., Scheduler]] = {}


def register_policy(name: str, cls: Callable[..., Scheduler], *, replace: bool = False) -> None:
    """Make ``cls`` available as ``get_policy(name, **opts)``; ``replace=True`` overrides an existing name."""
    if not isinstance(name, str) or not name or any(ch.isspace() for ch in name):
        raise CoflowError(f"policy name must be a non-empty word, got {name!r}")
    if isinstance(cls, type) and not issubclass(cls, Scheduler):
        raise CoflowError(f"policy {name!r}: {cls!r} is not a Scheduler subclass")
    if name in _REGISTRY and not replace and _REGISTRY[name] is not cls:
        raise CoflowError(f"policy {name!r} is already registered (pass replace=True to override)")
    _REGISTRY[name] = cls


def unregister_policy(name: str) -> None:
    """Remove a registered policy (mainly for tests)."""
    _REGISTRY.pop(name, None)


def get_policy(name: str, **opts: Any) -> Scheduler:
    """A new instance of the policy registered as ``name``, constructed with ``opts``."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown coflow policy {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    try:
        sched = cls(**opts)
    except TypeError as exc:
        raise CoflowError(f"policy {name!r}: bad options {sorted(opts)}: {exc}") from exc
    sched.name = name
    return sched


def policy_names() -> list[str]:
    """Names of all registered policies, sorted."""
    return sorted(_REGISTRY)
