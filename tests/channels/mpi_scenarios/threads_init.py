"""Scenarios: how the channel meets MPI: thread levels, a split communicator shared with the user's
own traffic, initialising MPI itself, and waking a waiting progress call."""

from __future__ import annotations

import threading
import time

from tests.channels.mpi_scenarios.helpers import Recorder, check, make_channel, ok, payload, spin

import channels.mpi as mpich
from twisternet.config import load_config
from twisternet.errors import ConfigError, TwisternetError


def scenario_funneled() -> None:
    """MPI granted only THREAD_FUNNELED: threaded progress is refused at start; manual progress from
    the main thread works; a call from another thread is refused."""
    from mpi4py import MPI
    check(MPI.Query_thread() == MPI.THREAD_FUNNELED, f"thread level is {MPI.Query_thread()}")
    config = load_config(env={}, progress="thread")
    ch0 = mpich.create_channel(config)
    check(ch0.requires_main_thread_progress, "requires_main_thread_progress should be True")
    try:
        ch0.start(Recorder(ch0.rank))
        raise AssertionError("start must refuse threaded progress under THREAD_FUNNELED")
    except ConfigError as e:
        check("THREAD_FUNNELED" in str(e) and "manual" in str(e), f"unclear message: {e}")
    ch0.close(1)
    ch, rec = make_channel(progress="manual")
    peer = 1 - ch.rank
    check(ch.send(peer, 1, [b"manual %d" % ch.rank]), "send refused")
    spin(ch, lambda: len(rec.messages) == 1, "a message")
    check(bytes(rec.messages[0][2]) == b"manual %d" % peer, "wrong message")
    rec.messages[0][3]()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            ch.progress(0)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=other)
    th.start()
    th.join(10)
    check(len(errors) == 1 and isinstance(errors[0], TwisternetError), f"other thread got {errors}")
    ch.close(10)
    ok(ch.rank)


def scenario_usercomm() -> None:
    """The channel on a split communicator: its world is the split, and the user's own traffic on
    that communicator with the channel's tag values never mixes with the channel's."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    sub = world.Split(color=world.rank % 2, key=world.rank)
    ch, rec = make_channel(comm=sub, buffer_size=4096)
    check(ch.world == sub.size and ch.rank == sub.rank, "rank/world must come from the communicator")
    from twisternet.bootstrap.addresses import host_id
    from twisternet.topology import from_channel
    check(ch.host_ids == [host_id()] * ch.world and from_channel(ch) == dict.fromkeys(range(ch.world), host_id()),
          f"every rank of the split shares this host: {ch.host_ids}")
    peer = 1 - ch.rank
    user_reqs = [sub.Isend(b"user %d" % tag, peer, tag) for tag in (mpich.TAG_DATA, mpich.TAG_BULK, mpich.TAG_CTRL)]
    check(ch.send(peer, mpich.TAG_DATA, [b"chan small"]), "send refused")
    big = payload(sub.rank, peer, 0, 0, 100_000)
    check(ch.send(peer, 0, [big]), "send refused")
    spin(ch, lambda: len(rec.messages) == 2, "channel messages")
    got = {e: bytes(d) for _, e, d, _ in rec.messages}
    check(got == {mpich.TAG_DATA: b"chan small", 0: payload(peer, sub.rank, 0, 0, 100_000)},
          "channel messages wrong")
    for *_, r in rec.messages:
        r()
    for tag in (mpich.TAG_DATA, mpich.TAG_BULK, mpich.TAG_CTRL):
        buf = bytearray(32)
        st = MPI.Status()
        sub.Recv(buf, peer, tag, st)
        check(bytes(buf[:st.Get_count()]) == b"user %d" % tag, "user message wrong")
    MPI.Request.Waitall(user_reqs)
    ch.close(10)
    check(ch.comm == MPI.COMM_NULL, "the channel's communicator was not freed")
    sub.Free()
    ok(world.rank, sub_rank=ch.rank)


def scenario_selfinit() -> None:
    """mpi4py was told not to initialise MPI: the channel initialises it (asking for MULTIPLE)."""
    import atexit

    from mpi4py import MPI
    check(not MPI.Is_initialized(), "MPI should not be initialised yet")
    # Registered before the channel's hooks, so it runs after them: MPI must be finalized by then.
    atexit.register(lambda: print(f"AT EXIT finalized={MPI.Is_finalized()}", flush=True))
    ch, rec = make_channel()
    check(MPI.Is_initialized(), "create_channel did not initialise MPI")
    check(ch.thread_level == MPI.THREAD_MULTIPLE, f"thread level {ch.thread_level}")
    peer = 1 - ch.rank
    check(ch.send(peer, 0, [b"hi"]), "send refused")
    spin(ch, lambda: len(rec.messages) == 1, "a message")
    rec.messages[0][3]()
    ch.close(10)
    ok(ch.rank)


def scenario_wakeup() -> None:
    """``wakeup`` from another thread cuts a long progress wait short; an idle wait does not spin."""
    ch, rec = make_channel()
    timer = threading.Timer(0.2, ch.wakeup)
    start = time.monotonic()
    timer.start()
    ch.progress(20.0)
    woke = time.monotonic() - start
    timer.join()
    check(woke < 5.0, f"progress did not return after wakeup ({woke:.1f}s)")
    # Idle for 1.5 s: the backoff must keep CPU use well below a full core.
    cpu0, t0 = time.process_time(), time.monotonic()
    while time.monotonic() - t0 < 1.5:
        ch.progress(0.5)
    cpu = (time.process_time() - cpu0) / (time.monotonic() - t0)
    check(cpu < 0.6, f"idle progress used {cpu:.0%} of a core")
    # A message arriving while the peer waits is still seen (the wait polls).
    peer = 1 - ch.rank
    check(ch.send(peer, 0, [b"after idle"]), "send refused")
    spin(ch, lambda: len(rec.messages) == 1, "a message after idling")
    rec.messages[0][3]()
    ch.close(10)
    ok(ch.rank, woke_after=round(woke, 3), idle_cpu=round(cpu, 3))
