"""An emulated cluster for tests and benchmarks: H namespaced "hosts" on a shaped Linux bridge.

:mod:`.cluster` builds it and runs jobs on it (:class:`Testbed`); :mod:`.cli` is ``twisternet testbed``.
See docs/testbed.md.
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
