"""Fixtures of the emulated-cluster tests: a Testbed of H=2 hosts x k=2 ranks on 1 Gbit/s links.

The tests skip (and print why) only when namespaces cannot be made here: not root, no ``ip``/``tc``/
``unshare``/``nsenter``, or unshare refused. Everything a testbed builds is removed afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from twisternet.testbed import Testbed, unavailable


def _skip_unless_possible() -> None:
    why = unavailable()
    if why:
        print(f"skipping the testbed tests: {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def testbed() -> Iterator[Testbed]:
    """Two hosts, two ranks per host, 1 Gbit/s links; shared by the tests of a module (links left up)."""
    _skip_unless_possible()
    with Testbed(hosts=2, ranks_per_host=2, rate="1gbit") as tb:
        yield tb


@pytest.fixture
def make_testbed() -> Iterator[Callable[..., Testbed]]:
    """A factory of testbeds of the test's own shape, all removed when the test ends."""
    _skip_unless_possible()
    made: list[Testbed] = []

    def make(hosts: int = 2, ranks_per_host: int = 2, rate: str | None = "1gbit") -> Testbed:
        tb = Testbed(hosts=hosts, ranks_per_host=ranks_per_host, rate=rate)
        made.append(tb)
        return tb.up()
    try:
        yield make
    finally:
        for tb in made:
            tb.close()
