"""Scenarios: failures: an MPI error on a request, mismatched configs, a rank that dies, MPI_Abort."""

from __future__ import annotations

import os
import time

from tests.channels.mpi_scenarios.helpers import DEADLINE, check, make_channel, ok, spin

import channels.mpi as mpich
from twisternet.config import load_config
from twisternet.errors import ConfigError, PeerLostError


def scenario_mpi_error() -> None:
    """An MPI error on a request (here: rank 1 sends an oversized message into rank 0's control
    receive, so MPI reports truncation) makes rank 0 report rank 1 lost; the rest carries on."""
    ch, rec = make_channel(buffer_size=16 << 10)
    if ch.rank == 1:
        ch.comm.Send(b"z" * 10000, 0, mpich.TAG_CTRL)
        ch.close(1.0)  # rank 0 no longer talks to us: its goodbye never comes
        check(not rec.lost, f"rank 1 should not lose anyone: {rec.lost}")
        ok(1)
        return
    if ch.rank == 0:
        spin(ch, lambda: 1 in rec.lost, "rank 1 to be reported lost", limit=20)
        check("truncat" in rec.lost[1].lower(), f"reason should name the MPI error: {rec.lost[1]!r}")
        try:
            ch.send(1, 0, [b"x"])
            raise AssertionError("send to a lost peer must raise")
        except PeerLostError:
            pass
    others = [p for p in range(ch.world) if p not in (ch.rank, 1)]
    for p in others:
        check(ch.send(p, 0, [b"still here"]), "send refused")
    spin(ch, lambda: len(rec.messages) == len(others), "messages from the survivors", limit=20)
    ch.close(10)
    check(set(rec.lost) == ({1} if ch.rank == 0 else set()), f"unexpected losses {rec.lost}")
    ok(ch.rank)


def scenario_config_mismatch() -> None:
    """Ranks that disagree on buffer_size get a clear ConfigError on every rank (not a truncation)."""
    from mpi4py import MPI
    size = 8192 if MPI.COMM_WORLD.rank == 1 else 4096
    try:
        mpich.create_channel(load_config(env={}, buffer_size=size))
        raise AssertionError("mismatched buffer_size must be refused")
    except ConfigError as e:
        check(e.key == "buffer_size" and "4096" in str(e) and "8192" in str(e), f"unclear error: {e}")
    ok(MPI.COMM_WORLD.rank)


def scenario_rank_dies() -> None:
    """Rank 1 dies (os._exit) in the middle of traffic: the launcher must end the job."""
    ch, rec = make_channel(buffer_size=16 << 10)
    _forget_mpich_segments()
    print(f"READY rank={ch.rank}", flush=True)
    end = time.monotonic() + 0.3
    peer = (ch.rank + 1) % ch.world
    while True:
        ch.send(peer, 0, [b"x" * 1000])
        ch.progress(0.001)
        for *_, r in rec.messages:
            r()
        rec.messages.clear()
        if ch.rank == 1 and time.monotonic() > end:
            os._exit(7)
        check(time.monotonic() < DEADLINE, "survived the death of rank 1")


def scenario_mpi_abort() -> None:
    """Rank 2 calls MPI_Abort(3) while the others progress: the launcher must end the job."""
    from mpi4py import MPI
    ch, rec = make_channel()
    print(f"READY rank={ch.rank}", flush=True)
    _forget_mpich_segments()  # (a barrier: every rank is up and said READY before the abort)
    if ch.rank == 2:
        MPI.COMM_WORLD.Abort(3)
    while time.monotonic() < DEADLINE:  # the others wait forever: only the launcher can end them
        ch.progress(0.01)
    raise AssertionError("survived the abort")


def _forget_mpich_segments() -> None:
    """Once every rank has attached them (a barrier), unlink MPICH's shared-memory files: these jobs end
    by a death MPICH does not clean up after (hydra kills the rest), which would leave them in /dev/shm
    for good; the ranks keep their mappings. (The channel does the same before its own MPI_Abort.)"""
    from mpi4py import MPI

    from channels.mpi.launch import _unlink_mpich_segments
    MPI.COMM_WORLD.Barrier()
    _unlink_mpich_segments()
