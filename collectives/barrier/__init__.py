"""Partial barriers, semaphore barriers and throttled release (Albrecht et al., "Loose Synchronization for
Large-Scale Networked Systems", USENIX ATC 2006), for twisternet jobs.

Three layers:

* **Pure state machines** on an injected clock (every call takes ``now``; no threads): ``BarrierMachine``,
  ``PartialBarrierMachine`` (max / timeout / percent / min_wait / adaptive knee release, late ``"pass"`` or
  ``"catch_up"``, enter-callback, rounds), ``SemaphoreBarrierMachine`` and ``ThrottledRelease`` with
  ``FixedConcurrency`` or the paper's ``AdaptiveConcurrency``. The exact rules are in the docstrings of
  ``partial.py``, ``knee.py``, ``semaphore.py``, ``throttle.py`` and ``concurrency.py``.
* **A transport-agnostic service and client**: ``BarrierService`` (one per job, on the bootstrap master or
  rank 0: ``handle(src_rank, msg, now)``, ``tick(now)``, ``next_deadline()``) and ``BarrierClient(send,
  clock)`` (``deliver(msg)`` from the transport; blocking ``enter``/``acquire``/``release``/``throttle``
  and ``enter_async``). Messages are msgpack-able dicts; see ``protocol.py``.
* **An in-process harness**, ``LocalBarrierCluster``, wiring both through queues and a service thread.

Pure use::

    from collectives.barrier import PartialBarrierMachine, ManualClock
    b = PartialBarrierMachine("phase", max=4, percent=75, min_wait=2.0)
    b.enter("t0", 0, now=0.0); b.enter("t1", 1, now=0.5)
    out = b.enter("t2", 2, now=1.0)        # 3/4 entered, but min_wait not yet elapsed: waits
    released = b.tick(2.0)                 # min_wait elapsed: t0, t1, t2 pass (FireReason.EARLY)

The distributed use through ``LocalBarrierCluster`` and how to wire the service and client into a
transport: docs/collectives.md, section "Partial barriers".

The barriers bound to a job (they take a Context) are ``collectives.Barrier``, ``collectives.PartialBarrier``
and ``collectives.SemaphoreBarrier``. The state machines here once had those same names; the old names
still import from this package, with a DeprecationWarning, and will be removed.
"""

from .client import BarrierClient
from .clock import Clock, ManualClock, MonotonicClock
from .concurrency import AdaptiveConcurrency, ConcurrencyPolicy, FixedConcurrency
from .errors import (BarrierClosed, BarrierError, BarrierMismatchError, BarrierProtocolError, BarrierSpecError,
                     BarrierTimeout, CatchUp, RemoteBarrierError)
from .harness import LocalBarrierCluster
from .knee import KneeDetector
from .partial import BarrierMachine, EnterCallback, PartialBarrierMachine
from .records import Admission, AdmitReason, BarrierRelease, EnterOutcome, FireInfo, FireReason, Status
from .semaphore import AdmitOutcome, ReleaseCallback, SemaphoreBarrierMachine
from .service import BarrierService
from .specs import BarrierSpec, SemaphoreSpec, ThrottleSpec, percent_count, spec_from_dict
from .throttle import ThrottledRelease

#: The status a late arrival gets at a ``late="pass"`` barrier.
LATE_FIRE = Status.LATE_FIRE
#: The status of an entrant released by its round's fire.
FIRE = Status.FIRE

__all__ = [
    "Admission", "AdaptiveConcurrency", "AdmitOutcome", "AdmitReason", "BarrierClient",
    "BarrierClosed", "BarrierError", "BarrierMachine", "BarrierMismatchError", "BarrierProtocolError", "BarrierRelease",
    "BarrierService", "BarrierSpec", "BarrierSpecError", "BarrierTimeout", "CatchUp", "Clock",
    "ConcurrencyPolicy", "EnterCallback", "EnterOutcome", "FIRE", "FireInfo", "FireReason",
    "FixedConcurrency", "KneeDetector", "LATE_FIRE", "LocalBarrierCluster", "ManualClock", "MonotonicClock",
    "PartialBarrierMachine", "ReleaseCallback", "RemoteBarrierError", "SemaphoreBarrierMachine", "SemaphoreSpec",
    "Status", "ThrottleSpec", "ThrottledRelease", "percent_count", "spec_from_dict",
]

#: Old names of the state machines, the same as the job-bound barriers' in ``collectives``.
_RENAMED = {"Barrier": "BarrierMachine", "PartialBarrier": "PartialBarrierMachine",
            "SemaphoreBarrier": "SemaphoreBarrierMachine"}


def __getattr__(name: str) -> object:
    """The state machines under their old names, with a DeprecationWarning."""
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings
    warnings.warn(f"collectives.barrier.{name} is the pure state machine, renamed {new}; the barrier bound "
                  f"to a job is collectives.{name}", DeprecationWarning, stacklevel=2)
    return globals()[new]
