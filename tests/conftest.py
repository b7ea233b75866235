"""Test-wide settings and the fixtures that launch jobs.

Settings: property tests judge inputs, not the machine's speed. CI runs on a busy 2-core machine, where
Hypothesis's wall-clock checks (a per-example deadline and the "input generation is slow" health check)
fail tests that are correct; this profile turns them off for every test (a test's own ``@settings``
still sets its example count). Under CI (``CI=true``) the examples are drawn the same way every run.

Fixtures, one per way the tests start ranks (the helpers behind them are in tests/jobs.py):

- local threads: ``twisternet.testing.run_local`` (no fixture needed: it needs nothing of the machine);
- ``run_job``: a job of N processes under ``twisternet run`` (TCP) or ``mpiexec``;
- ``mpiexec``: the mpiexec path, for tests that build their own MPI command lines;
- ``emulated_cluster``: a factory of testbeds, hosts emulated in network namespaces
  (tests/testbed/conftest.py adds a module-wide ``testbed``).

Each skips, printing why, only where the machine cannot do it (no MPI installed; not root or no
network namespaces), as the CI rule asks.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, settings

from tests.jobs import require_emulated_cluster, require_mpiexec, run_mpi, run_tcp

if TYPE_CHECKING:
    from twisternet.testbed import Testbed

settings.register_profile("twisternet", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Under CI (CI=true) every run draws the same examples, so a run's verdict is the commit's, not the
# draw's; a developer's run explores new ones (and a bug one finds becomes an @example of its test).
settings.register_profile("twisternet-ci", parent=settings.get_profile("twisternet"), derandomize=True,
                          database=None)
settings.load_profile("twisternet-ci" if os.environ.get("CI", "").lower() in ("1", "true") else "twisternet")


def _build_fastpath_in_place() -> None:
    """Build the optional C extensions (``innet._fastpath``, the switch dataplane, ``innet._hostio``, the
    end hosts' batched I/O, ``innet._pscore``, the PS's packet path, and ``twisternet._smallcodec``, the
    codec's short-tuple records) next to their sources when one is missing.

    The tests import this checkout's packages, not the installed copies, and ``pip install .`` puts the
    compiled module in site-packages only: without this the C dataplane would go untested after the
    README's install. The build (``setup.py build_ext --inplace``, about a second with gcc) warns and
    leaves nothing when there is no compiler; then the C tests skip and say why."""
    import importlib
    import importlib.machinery
    import sys
    import tempfile

    # by file, not by import: importing innet here would fix innet.fastpath's answer before the build
    # (and twisternet.smallrecords decides at import whether the compiled codec is there)
    root = Path(__file__).resolve().parents[1]
    wanted = [("innet", "_fastpath"), ("innet", "_hostio"), ("innet", "_pscore"), ("twisternet", "_smallcodec")]
    if all(any((root / package / f"{name}{suffix}").exists() for suffix in importlib.machinery.EXTENSION_SUFFIXES)
           for package, name in wanted):
        return
    with tempfile.TemporaryDirectory(prefix="twisternet-build-") as tmp:
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--build-temp", tmp],
                       cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600, check=False)
    importlib.invalidate_caches()  # the import system cached innet/'s listing before the module existed


# At import, not in pytest_configure: pytest imports the conftest files of the named test directories
# (tests/innet/conftest.py imports innet) before it configures, but always this one first.
_build_fastpath_in_place()

LAUNCHERS = ("tcp", "mpi")


@pytest.fixture(scope="session")
def mpiexec() -> str:
    """The mpiexec of the mpi extra (the mpich wheel's). Skips, printing why, when MPI is not installed;
    fails when the install is broken (mpi4py without mpiexec)."""
    return require_mpiexec()


@pytest.fixture
def run_job() -> Callable[..., subprocess.CompletedProcess]:
    """``run_job(launcher, n, script, *args, timeout=120, **TWISTERNET_settings)``: ``script`` on ``n``
    processes under ``twisternet run`` (launcher "tcp") or ``mpiexec`` ("mpi"; skips like the ``mpiexec``
    fixture when MPI is not installed). Returns the CompletedProcess; the repository is on PYTHONPATH."""
    def run(launcher: str, n: int, script: str | Path, *args: str, timeout: float = 120,
            **env: str) -> subprocess.CompletedProcess:
        if launcher == "tcp":
            return run_tcp(n, script, *args, timeout=timeout, **env)
        if launcher == "mpi":
            return run_mpi(n, script, *args, timeout=timeout, **env)
        raise ValueError(f"unknown launcher {launcher!r}; known: {', '.join(LAUNCHERS)}")
    return run


@pytest.fixture
def emulated_cluster() -> Iterator[Callable[..., Testbed]]:
    """A factory of emulated clusters: ``emulated_cluster(hosts=2, ranks_per_host=2, rate="1gbit")``
    builds a :class:`twisternet.testbed.Testbed` (one network namespace per host, shaped links) and
    brings it up (other keywords go to Testbed, e.g. ``service_hosts``); all are removed when the test
    ends. Skips, printing why, when namespaces cannot be made here (not root, no ``ip``/``tc``/
    ``unshare``/``nsenter``, or unshare refused)."""
    require_emulated_cluster()
    from twisternet.testbed import Testbed

    made: list[Testbed] = []

    def make(hosts: int = 2, ranks_per_host: int = 2, rate: str | None = "1gbit", **kw: Any) -> Testbed:
        tb = Testbed(hosts=hosts, ranks_per_host=ranks_per_host, rate=rate, **kw)
        made.append(tb)
        return tb.up()
    try:
        yield make
    finally:
        for tb in made:
            tb.close()
