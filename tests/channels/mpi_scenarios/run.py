"""Run one MPI channel scenario: ``mpiexec -n N python tests/channels/mpi_scenarios/run.py SCENARIO``
(``test_mpi_channel.py`` does, with the repository on PYTHONPATH). The scenarios live in this
directory, one module per feature; every ``scenario_<name>`` function of those modules is a scenario
called ``<name>``."""

from __future__ import annotations

import logging
import os
import sys

SCENARIO = sys.argv[1] if len(sys.argv) > 1 else "mixed"
# Before anything imports mpi4py's MPI module (which initialises MPI):
if SCENARIO == "funneled":
    import mpi4py
    mpi4py.rc.thread_level = "funneled"
elif SCENARIO == "selfinit":
    import mpi4py
    mpi4py.rc.initialize = False

from tests.channels.mpi_scenarios import endings
from tests.channels.mpi_scenarios import failures
from tests.channels.mpi_scenarios import flow
from tests.channels.mpi_scenarios import placement
from tests.channels.mpi_scenarios import slot_scenarios
from tests.channels.mpi_scenarios import threads_init
from tests.channels.mpi_scenarios import transfers

SCENARIOS = {name[len("scenario_"):]: fn
             for module in (transfers, placement, slot_scenarios, flow, endings, failures, threads_init)
             for name, fn in vars(module).items() if name.startswith("scenario_")}

if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("MPI_SCENARIO_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if SCENARIO not in SCENARIOS:
        sys.exit(f"unknown scenario {SCENARIO!r}; known: {', '.join(sorted(SCENARIOS))}")
    SCENARIOS[SCENARIO]()
