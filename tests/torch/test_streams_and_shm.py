"""The torch backend's speed work, checked for correctness: in-place all_reduce through shared memory with
a rank's own piece read from its array (bit-identical to the sum in rank order), a stream per process
group (and one for send/recv), and the store address on hosts whose names do not resolve elsewhere."""

from __future__ import annotations

import os

import pytest

from tests.jobs import lines, run_tcp

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def _all_ok(proc, world: int, count: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert not lines(proc, "BAD"), out[-4000:]
    assert len(lines(proc, "OK")) == count * world, out[-4000:]
    assert len(lines(proc, "DONE")) == world, out[-4000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_shm_allreduce_in_place_is_the_sum_in_rank_order(world: int) -> None:
    proc = run_tcp(world, os.path.join(SCRIPTS, "shm_inplace.py"), timeout=280)
    _all_ok(proc, world, 9)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_shm_allreduce_of_a_tensor_larger_than_a_functional_slot() -> None:
    pytest.importorskip("torch", reason="torch is not installed (pip install 'twisternet[torch]')")
    proc = run_tcp(2, os.path.join(SCRIPTS, "shm_inplace.py"), "--torch", timeout=380)
    _all_ok(proc, 2, 11)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_process_groups_and_send_recv_have_streams_of_their_own() -> None:
    pytest.importorskip("torch", reason="torch is not installed (pip install 'twisternet[torch]')")
    proc = run_tcp(3, os.path.join(SCRIPTS, "streams.py"), timeout=380)
    _all_ok(proc, 3, 3)


@pytest.mark.timeout(300)
def test_a_failure_learned_before_the_call_keeps_the_ranks_in_step() -> None:
    proc = run_tcp(3, os.path.join(SCRIPTS, "failed_op_race.py"), timeout=280)
    _all_ok(proc, 3, 2)


def test_store_address_is_the_route_to_the_master(monkeypatch) -> None:
    pytest.importorskip("torch", reason="torch is not installed (pip install 'twisternet[torch]')")
    from twisternet.torch.backend import _outward_address
    monkeypatch.setenv("TWISTERNET_MASTER", "127.0.0.1:4242")
    assert _outward_address() == "127.0.0.1"
    monkeypatch.delenv("TWISTERNET_MASTER")
    assert _outward_address() is None
    monkeypatch.setenv("TWISTERNET_MASTER", "not an address")
    assert _outward_address() is None


def test_functional_shm_slots_are_large_and_bounded() -> None:
    from twisternet.functional import SHM_SEGMENT_BUDGET, SHM_SLOT_MAX, shm_slot_bytes
    assert shm_slot_bytes(2) == SHM_SLOT_MAX          # a 64 MB call: 4 rounds, not 64
    for n in (2, 3, 4, 8, 16, 63):
        s = shm_slot_bytes(n)
        assert s % 4096 == 0 and (1 << 20) <= s <= SHM_SLOT_MAX
        assert (2 * n + 2) * s <= SHM_SEGMENT_BUDGET      # the segment of 2n + 2 slots stays in the budget
    assert shm_slot_bytes(1000) == 1 << 20                # never below 1 MB (many ranks: a larger segment)
