"""An emulated cluster for tests and benchmarks: H namespaced "hosts" on a shaped Linux bridge.

:mod:`.cluster` builds it and runs things in it (:class:`Testbed`); :mod:`.cli` is ``twisternet testbed``.
See docs/testbed.md. The parts: :mod:`.system` (what the machine must offer, the commands run),
:mod:`.inventory` (testbeds present, by name: listing, removing, sweeping the stale), :mod:`.jobs`
(starting twisternet, MPICH and other jobs), :mod:`.processes` (a job's processes and their output),
:mod:`.results` (what a job gives back).
"""

from .cluster import (
                      PREFIX_ROOT,
                      STATE_ROOT,
                      Job,
                      JobResult,
                      LinkCounters,
                      ProcResult,
                      Testbed,
                      TestbedError,
                      list_testbeds,
                      sweep_stale,
                      unavailable,
)

__all__ = ["Testbed", "TestbedError", "Job", "JobResult", "ProcResult", "LinkCounters", "unavailable",
           "sweep_stale", "list_testbeds", "PREFIX_ROOT", "STATE_ROOT"]
