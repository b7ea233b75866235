"""Fixtures of the emulated-cluster tests: ``testbed``, a Testbed of H=2 hosts x k=2 ranks on 1 Gbit/s
links shared by the tests of a module. Testbeds of a test's own shape come from ``emulated_cluster``
(tests/conftest.py).

The tests skip (and print why) only when namespaces cannot be made here: not root, no ``ip``/``tc``/
``unshare``/``nsenter``, or unshare refused. Everything a testbed builds is removed afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.jobs import require_emulated_cluster
from twisternet.testbed import Testbed


@pytest.fixture(scope="module")
def testbed() -> Iterator[Testbed]:
    """Two hosts, two ranks per host, 1 Gbit/s links; shared by the tests of a module (links left up)."""
    require_emulated_cluster()
    with Testbed(hosts=2, ranks_per_host=2, rate="1gbit") as tb:
        yield tb


@pytest.fixture
def make_testbed(emulated_cluster):
    """The ``emulated_cluster`` factory under its earlier name (kept for tests written against it)."""
    return emulated_cluster
