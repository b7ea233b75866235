"""A rank SIGKILLed in the middle of an operation: every survivor raises PeerLostError at its next call
(a batch KeyedReduce.send, which only buffers locally, included), naming the killed rank and not a
survivor that failed and exited in reaction; the launcher reports the killed rank first and the others
as "lost after" it. Under the TCP launcher (mpiexec ends the whole job itself when a rank dies)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.jobs import lines, run_tcp

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).parent / "scripts" / "lost_first.py"


@pytest.mark.parametrize("repeat", [0, 1])
@pytest.mark.parametrize("kind", ["gather", "reduce", "keyed_reduce", "batch_keyed_reduce"])
def test_survivors_name_the_killed_rank_at_their_next_call(kind: str, repeat: int) -> None:
    p = run_tcp(4, SCRIPT, kind, timeout=200, grace=30, TWISTERNET_PEER_TIMEOUT="10")
    out = p.stdout + p.stderr
    lost = lines(p, "PEERLOST")
    assert len(lost) == 3, out[-4000:]
    for line in lost:
        assert "lost=3 " in line, out[-4000:]          # the killed rank, never a survivor that left
        # raised by the survivor's own next call, long before finish() or the launcher's grace
        assert float(re.search(r"after=([\d.]+)", line).group(1)) < 20, line
    assert "twisternet: rank 3 was killed by SIGKILL" in p.stderr, p.stderr[-3000:]
    for r in (0, 1, 2):
        assert f"twisternet: rank {r} exited with code 3 (lost after rank 3)" in p.stderr, p.stderr[-3000:]
    assert "HUNG" not in p.stdout


@pytest.mark.parametrize("world", [3, 4])    # 3: the folded-in rank waits on a survivor, not on the victim
def test_doubling_allreduce_survivors_name_the_killed_rank(world: int) -> None:
    victim = world - 1
    p = run_tcp(world, Path(__file__).parent / "scripts" / "lost_doubling.py", timeout=200, grace=30,
                TWISTERNET_PEER_TIMEOUT="10")
    out = p.stdout + p.stderr
    lost = lines(p, "PEERLOST")
    assert len(lost) == world - 1, out[-4000:]
    for line in lost:
        # the victim dies after its 50th call returned, so every survivor entered call 50; one
        # that had not yet taken its partner's last frame when the death was seen fails call 50
        # itself (calls=49), the others fail call 51 (calls=50): never an earlier call
        assert f"lost={victim} " in line and re.search(r"calls=(49|50) ", line), out[-4000:]
    assert f"twisternet: rank {victim} was killed by SIGKILL" in p.stderr, p.stderr[-3000:]
    assert "HUNG" not in p.stdout
