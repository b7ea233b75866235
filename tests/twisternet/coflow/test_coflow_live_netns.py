"""Live effect of coflow scheduling: 4 workers in network namespaces on 100 Mbit/s tbf-shaped links run a
big Partition and, 0.3 s later, a small one. Under SEBF the small coflow overtakes the big one's backlog;
under FIFO it waits behind it. Its completion time must drop by a wide margin."""

from __future__ import annotations

import pytest

from benchmarks._coflow_netns import Testbed, ccts, netns_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORLD = 4
BIG_MB, SMALL_MB = 16.0, 0.5
ENV = {"TWISTERNET_BUFFER_SIZE": "256k", "TWISTERNET_POOL_BUFFERS": "256",
        "TWISTERNET_COFLOW_INFLIGHT": "256k"}


@pytest.fixture(scope="module")
def testbed():
    why = netns_unavailable()
    if why:
        print(f"skipping: {why}")
        pytest.skip(why)
    with Testbed(WORLD, rate_mbit=100) as tb:
        yield tb


def _run(tb: Testbed, policy: str) -> dict[str, float]:
    rows = tb.run_job(policy, ["--big-mb", str(BIG_MB), "--small-mb", str(SMALL_MB), "--delay", "0.3"],
                      timeout=120, extra_env=ENV)
    assert [r["rank"] for r in rows] == list(range(WORLD))
    for r in rows:
        assert r["policy"] == policy
        # every rank receives what the others sent it (chunks spread round-robin over the 3 others)
        small_each = int(SMALL_MB * (1 << 20)) // (WORLD - 1)
        assert r["got_small"] == small_each * (WORLD - 1)
    chunks = int(BIG_MB * (1 << 20)) // (1 << 20)
    assert sum(r["got_big"] for r in rows) == chunks * (1 << 20) * WORLD
    return ccts(rows)


def test_sebf_small_coflow_overtakes_big_one(testbed):
    fifo = _run(testbed, "fifo")
    sebf = _run(testbed, "sebf")
    print(f"small CCT fifo {fifo['small']:.3f}s sebf {sebf['small']:.3f}s; "
          f"big CCT fifo {fifo['big']:.3f}s sebf {sebf['big']:.3f}s")
    assert sebf["small"] < 0.6 * fifo["small"]
    # the big coflow is not starved: it still finishes within a generous bound of its FIFO time
    assert sebf["big"] < 2.0 * fifo["big"] + 1.0


def test_namespaces_are_cleaned_up():
    import subprocess
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    with Testbed(2, rate_mbit=100) as tb:
        names = list(tb.spaces) + [tb.bridge_ns]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed.split() for n in names)
