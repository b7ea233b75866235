"""A twisternet job under ``mpiexec`` (3 ranks) for the MPI channel's liveness and abort tests.

``freeze OUTDIR``: ranks exchange messages, then the last rank SIGSTOPs itself. Each survivor waits for
a message that never comes (the operation timeout is the default 300 s) and must get PeerLostError
naming the frozen rank from the heartbeat timeout instead; it writes what it caught to
``OUTDIR/lost-<rank>``, waits (bounded) until every survivor did, and lets the error go uncaught, which
must end the whole job (MPI_Abort) although the frozen rank never exits by itself.

``freeze-exit``: the same, but the survivors catch the error and exit with status 3 (no uncaught
error): the job must still end, since the frozen rank never exits by itself.

``idle SECONDS``: rank 1's main thread sleeps that long (past peer_timeout) before it sends; nobody
may be reported lost, since its progress thread keeps sending heartbeats.

``wedge``: rank 0's progress gets stuck in a poll, as in an MPI call that never returns (MPICH's OFI
netmod retrying a send to a cut-off host). Only rank 0 runs with ``mpi_abort_on_error``: the others
catch its loss, print ``LOST``, and wait to be killed. Only rank 0's watchdog can end the job.

``uncaught``: rank 1 raises ValueError while the others wait for a message from it: the job must end
at once with a non-zero exit. ``uncaught-in-with``: the same inside ``with ctx:``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

if os.environ.get("LIVENESS_ERR_DIR"):    # straight to a file: hydra's pipe loses what precedes an abort
    _err = os.open(os.path.join(os.environ["LIVENESS_ERR_DIR"], f"err-{os.environ.get('PMI_RANK', os.getpid())}"),
                   os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(_err, 2)
    os.close(_err)

import twisternet as tn  # (after stderr is in place)
from twisternet.errors import PeerLostError

mode = sys.argv[1]
if mode == "wedge":    # the others must not end the job themselves (see the module docstring)
    ctx = tn.init(mpi_abort_on_error=os.environ.get("PMI_RANK") == "0")
else:
    ctx = tn.init()
got: list[tuple[int, object]] = []
ctx.register(1, lambda src, obj: got.append((src, obj)) or True)
for peer in range(ctx.world):
    if peer != ctx.rank:
        ctx.send(peer, 1, ("hello", ctx.rank))
ctx.wait_until(lambda: len(got) == ctx.world - 1, timeout=60)
with open("/proc/self/maps") as maps:
    segments = sorted({line.split(None, 5)[5].strip() for line in maps if "/dev/shm/mpich_shm_" in line})
print(f"READY rank={ctx.rank} segments={','.join(segments)}", flush=True)

if mode in ("freeze", "freeze-exit"):
    outdir = Path(sys.argv[2])
    victim = ctx.world - 1
    if ctx.rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)   # not reached until someone continues us; the abort kills us first
        sys.exit("the frozen rank was never killed")
    t0 = time.monotonic()
    try:
        ctx.wait_until(lambda: len(got) > ctx.world - 1)   # nobody sends again: default 300 s timeout
    except PeerLostError as e:
        (outdir / f"lost-{ctx.rank}").write_text(f"rank={e.rank} after={time.monotonic() - t0:.2f} {e}")
        limit = time.monotonic() + 30
        while len(list(outdir.glob("lost-*"))) < ctx.world - 1 and time.monotonic() < limit:
            time.sleep(0.05)
        if mode == "freeze-exit":
            ctx.close(timeout=5)
            sys.exit(3)      # handled, then a normal exit: the frozen rank must not keep mpiexec alive
        raise
    print(f"NOT LOST rank={ctx.rank}", flush=True)
elif mode == "idle":
    # rank 1's main thread sleeps past peer_timeout; its progress thread keeps the heartbeats going
    if ctx.rank == 1:
        time.sleep(float(sys.argv[2]))
        for peer in (0, 2):
            ctx.send(peer, 1, ("late", 1))
        ctx.flush()
    else:
        ctx.wait_until(lambda: any(obj == ("late", 1) for _, obj in got), timeout=120)
    print(f"ALIVE rank={ctx.rank}", flush=True)
elif mode == "wedge":
    if ctx.rank == 0:
        never = threading.Event()

        def stuck_poll() -> bool:
            never.wait()         # holds the poll lock for good, as a stuck MPI call inside a poll would
            return False
        ctx.channel._poll = stuck_poll  # type: ignore[method-assign]
        time.sleep(120)
        sys.exit("rank 0 was never aborted")
    t0 = time.monotonic()
    try:
        ctx.wait_until(lambda: len(got) > ctx.world - 1)
    except PeerLostError as e:
        print(f"LOST rank={ctx.rank} lost={e.rank} after={time.monotonic() - t0:.2f}", flush=True)
    time.sleep(120)
    sys.exit(4)
elif mode == "uncaught":
    if ctx.rank == 1:
        raise ValueError("deliberate failure on rank 1")
    ctx.wait_until(lambda: len(got) > ctx.world - 1)
    print(f"SURVIVED rank={ctx.rank}", flush=True)
elif mode == "uncaught-in-with":
    with ctx:       # the context closes (briefly) on the way out; the error still ends the job
        if ctx.rank == 1:
            raise ValueError("deliberate failure on rank 1")
        ctx.wait_until(lambda: len(got) > ctx.world - 1)
        print(f"SURVIVED rank={ctx.rank}", flush=True)
    sys.exit(0)
else:
    sys.exit(f"unknown mode {mode!r}")
ctx.close()
