"""Single-machine launcher behind ``twisternet run``: a bootstrap master plus N worker processes.

Each worker runs ``python script.py args`` with the environment contract read by
:mod:`twisternet.config` (``TWISTERNET_MASTER``, ``TWISTERNET_TOKEN``, ``TWISTERNET_RANK``,
``TWISTERNET_WORLD``). Their output is forwarded line by line with a ``[rank] `` prefix. When a worker
fails while others run, the master tells the survivors at once (they raise PeerLostError), they get a
grace period to exit, then SIGTERM, then SIGKILL. Workers run in their own process groups and, on Linux,
die with the launcher (``PR_SET_PDEATHSIG``), so none outlives it. (Except when :func:`run` is called
from a process that has loaded gRPC: see :func:`spawn_preexec`.)
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any
from collections.abc import Callable, Mapping, Sequence

from .bootstrap import Master, install_job_services
from .config import load_config
from .errors import LaunchError

__all__ = ["run", "exit_status", "describe_exit", "spawn_preexec"]

log = logging.getLogger(__name__)

#: Seconds between SIGTERM and SIGKILL when stopping workers.
KILL_AFTER = 3.0
_POLL = 0.05
_LAUNCH_KEYS = ("master", "token", "rank", "world")


def exit_status(returncode: int) -> int:
    """A shell-style exit status: a death by signal k (Popen's ``-k``) becomes 128 + k."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """Human words for a Popen return code: ``exited with code 3`` / ``was killed by SIGKILL``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def spawn_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` making the child die (SIGKILL) when the spawning thread dies (Linux), else None.

    Spawn from the main thread: the kernel ties PDEATHSIG to the thread that forked.

    None too when this process has loaded gRPC. A ``preexec_fn`` makes ``subprocess`` fork the child and
    run the process's fork handlers in it, and gRPC's abort the child (SIGABRT, "Epoll1Poller encountered
    epoll error") while gRPC's threads are busy. Without one, ``subprocess`` starts the child with
    ``vfork``, which runs no fork handlers; such workers still stop with the launcher on its own exit
    and on the signals it forwards, but not when it is killed with SIGKILL. ``twisternet run`` never
    loads gRPC (see ``_start_innet_switch``): this is for programs that call :func:`run` themselves.
    """
    if _PRCTL is None or "grpc" in sys.modules:
        return None
    parent = os.getpid()
    prctl = _PRCTL

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)
    return preexec


class _Output:
    """Forwards a worker's pipe to our stream, one prefixed line at a time (bytes, so any encoding)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._threads: list[threading.Thread] = []

    def pump(self, src: IO[bytes], dst: IO[bytes], prefix: bytes) -> None:
        t = threading.Thread(target=self._pump, args=(src, dst, prefix), daemon=True,
                             name="twisternet-output")
        t.start()
        self._threads.append(t)

    def _pump(self, src: IO[bytes], dst: IO[bytes], prefix: bytes) -> None:
        broken = False
        try:
            while True:
                line = src.readline(1 << 20)  # a longer line is forwarded in 1 MiB pieces
                if not line:
                    break
                if broken:
                    continue  # keep draining so the worker never blocks on a full pipe
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self._lock:
                    try:
                        dst.write(prefix + line)
                        dst.flush()
                    except (BrokenPipeError, ValueError, OSError):
                        broken = True
        finally:
            src.close()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _binary(stream: IO[Any] | None, default: IO[Any]) -> IO[bytes]:
    stream = default if stream is None else stream
    return getattr(stream, "buffer", stream)


def _connect_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def _start_innet_switch(host: str, env: dict[str, str], token: str) -> Any:
    """Start the job's in-network switch and put its addresses into ``env`` (the workers' environment).
    Its P4Runtime server takes only calls with the token derived from the job token (never the job
    token itself: see innet.p4runtime.auth)."""
    import importlib.util
    # only look for grpc: loading it here, in the process that then forks the workers (with a
    # preexec_fn), would run gRPC's fork handlers in them (SIGABRT when gRPC threads are busy)
    missing = next((m for m in ("grpc", "numpy") if importlib.util.find_spec(m) is None), None)
    try:
        if missing is not None:
            raise ModuleNotFoundError(name=missing)
        from innet.service import start_switch
        from innet.tokens import p4runtime_token
    except ModuleNotFoundError as e:
        raise LaunchError(f"--innet needs the innet extra ({e.name} is not installed): "
                          "pip install 'twisternet[innet]'") from None
    try:
        switch = start_switch(host, p4runtime_token=p4runtime_token(token.encode()))
    except (RuntimeError, OSError) as e:
        raise LaunchError(f"the in-network switch did not start: {e}") from None
    env["TWISTERNET_INNET_SWITCH"] = f"{switch.udp_addr[0]}:{switch.udp_addr[1]}"
    env["TWISTERNET_INNET_P4RUNTIME"] = f"{switch.p4runtime_addr[0]}:{switch.p4runtime_addr[1]}"
    env.setdefault("TWISTERNET_INNET_HOST", host)
    return switch


# One step per launcher option, in order (complexity accepted).
def run(n: int, script: str, args: Sequence[str] = (), *, grace: float = 10.0, host: str = "127.0.0.1",  # noqa: C901
        port: int = 0, env: Mapping[str, str] | None = None, python: str | None = None,
        stdout: IO[Any] | None = None, stderr: IO[Any] | None = None,
        setup: Callable[[Master], None] | None = None, innet: bool = False) -> int:
    """Run ``n`` workers of ``script`` under a fresh bootstrap master; return the first non-zero exit
    status (128 + k for a death by signal k), or 0.

    ``env`` adds variables to the workers' environment. The master gets the job services
    (:func:`~twisternet.bootstrap.install_job_services`), then ``setup(master)`` may add more. Call it
    from the main thread (signal handling and PDEATHSIG rely on it).

    ``innet`` starts an ATP software switch with its P4Runtime server beside the job (needs the ``innet``
    extra) and tells the workers where it is (config keys ``innet_switch`` and ``innet_p4runtime``),
    so every ``AllReduce(via="innet")`` of the job places itself on that switch; it stops with the job.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of workers must be >= 1, got {n!r}")
    if not grace >= 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace!r}")
    out, err = _binary(stdout, sys.stdout), _binary(stderr, sys.stderr)
    extra = dict(env or {})
    base_env = {k: v for k, v in {**os.environ, **extra}.items()
                if k.upper() not in {"TWISTERNET_" + key.upper() for key in _LAUNCH_KEYS}}
    config = load_config(env=base_env)  # the master uses the same timeouts as the workers

    token = secrets.token_hex(32)
    master = Master(n, token.encode(), host, port, handshake_timeout=config.handshake_timeout,
                    peer_timeout=config.peer_timeout, heartbeat_interval=config.heartbeat_interval,
                    join_timeout=config.connect_timeout)
    try:
        install_job_services(master)
        if setup is not None:
            setup(master)
    except BaseException:
        master.stop()
        raise
    master_addr = f"{_connect_host(host)}:{master.address[1]}"
    lock = threading.Lock()
    switch = None
    if innet:
        try:
            switch = _start_innet_switch(_connect_host(host), base_env, token)
        except BaseException:
            master.stop()
            raise

    def say(text: str) -> None:
        log.info("%s", text)
        with lock:
            try:
                err.write(f"twisternet: {text}\n".encode())
                err.flush()
            except (OSError, ValueError):
                pass

    procs: list[subprocess.Popen[bytes]] = []
    output = _Output(lock)
    interrupted: list[int] = []
    old_handlers: dict[signal.Signals, Any] = {}

    def on_signal(signum: int, frame: object) -> None:
        interrupted.append(signum)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old_handlers[sig] = signal.signal(sig, on_signal)
    try:
        preexec = spawn_preexec()
        for rank in range(n):
            worker_env = {**base_env, "TWISTERNET_MASTER": master_addr, "TWISTERNET_TOKEN": token,
                          "TWISTERNET_RANK": str(rank), "TWISTERNET_WORLD": str(n)}
            worker_env.setdefault("PYTHONUNBUFFERED", "1")
            procs.append(subprocess.Popen(
                [python or sys.executable, script, *args], env=worker_env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=preexec))
        for rank, p in enumerate(procs):
            prefix = f"[{rank}] ".encode()
            output.pump(p.stdout, out, prefix)  # type: ignore[arg-type]
            output.pump(p.stderr, err, prefix)  # type: ignore[arg-type]
        master.start()
        log.info("launched %d workers of %s (master %s)", n, script, master_addr)
        if switch is not None:
            say(f"in-network switch on udp {switch.udp_addr[0]}:{switch.udp_addr[1]} "
                f"(P4Runtime {switch.p4runtime_addr[0]}:{switch.p4runtime_addr[1]})")
        return _supervise(procs, master, grace, say, interrupted)
    finally:
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not die after SIGKILL", p.pid)
            _signal_group(p, signal.SIGKILL)  # leftover children of the worker, if any
        output.join(timeout=2.0)
        master.stop()
        if switch is not None:
            switch.close()
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the worker leads its own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def _supervise(procs: list[subprocess.Popen[bytes]], master: Master, grace: float,
               say: Callable[[str], None], interrupted: list[int]) -> int:
    """Wait for the workers; on a failure report it, allow ``grace``, then terminate the rest."""
    status: int | None = None       # first non-zero exit status
    first: int | None = None        # the rank that failed first: later failures are "after" it
    done: set[int] = set()
    term_at: float | None = None    # when to SIGTERM the survivors
    kill_at: float | None = None    # when to SIGKILL them
    stopping = False                # we terminate the rest: their deaths are not news
    handled_signals = 0
    # When each worker died, from one waiting thread per worker: a survivor that learns of a failure
    # may exit (non-zero) within the same poll round as the failed rank, and the exit status must be
    # the failed rank's, the first to die, not the lowest rank's.
    died_at: dict[int, float] = {}

    def watch(rank: int, p: subprocess.Popen[bytes]) -> None:
        p.wait()
        died_at[rank] = time.monotonic()
    for rank, p in enumerate(procs):
        threading.Thread(target=watch, args=(rank, p), name=f"twisternet-watch-{rank}", daemon=True).start()
    while len(done) < len(procs):
        now = time.monotonic()
        ended = [rank for rank, p in enumerate(procs) if rank not in done and p.poll() is not None]
        for rank in sorted(ended, key=lambda r: died_at.get(r, now)):
            p = procs[rank]
            done.add(rank)
            rc = p.returncode
            if rc == 0:
                # Harmless if it left the job cleanly; otherwise (e.g. it exited before joining) the
                # others must not wait for it.
                master.report_lost(rank, "process exited (code 0) without leaving the job")
                continue
            if status is None:
                status = exit_status(rc)
            if not stopping:
                if first is None:
                    first = rank
                    say(f"rank {rank} {describe_exit(rc)}")
                    master.report_lost(rank, f"process {describe_exit(rc)}")
                else:
                    say(f"rank {rank} {describe_exit(rc)} (lost after rank {first})")
                    master.report_lost(rank, f"process {describe_exit(rc)} after rank {first} was lost")
                if term_at is None and len(done) < len(procs):
                    term_at = now + grace
                    say(f"waiting up to {grace:g}s for the other workers to exit")
        if handled_signals < len(interrupted):
            signum = interrupted[handled_signals]
            handled_signals += 1
            if status is None:
                status = 128 + signum
            if not stopping:
                say(f"received {signal.Signals(signum).name}; stopping the workers")
                term_at = now
            else:
                kill_at = now  # a second signal: no more patience
        if term_at is not None and now >= term_at and not stopping and len(done) < len(procs):
            stopping = True
            alive = [r for r in range(len(procs)) if r not in done]
            if not interrupted:
                say(f"stopping rank(s) {', '.join(map(str, alive))} with SIGTERM")
            for r in alive:
                _signal_group(procs[r], signal.SIGTERM)
            kill_at = now + KILL_AFTER if kill_at is None else kill_at
        if kill_at is not None and now >= kill_at:
            alive = [r for r in range(len(procs)) if r not in done and procs[r].poll() is None]
            if alive:
                say(f"rank(s) {', '.join(map(str, alive))} still running; sending SIGKILL")
                for r in alive:
                    _signal_group(procs[r], signal.SIGKILL)
            kill_at = float("inf")
        if len(done) < len(procs):
            time.sleep(_POLL)
    return status or 0
