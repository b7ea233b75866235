"""The emulated cluster itself: H "hosts" as network namespaces behind a shaped bridge.

Each host is a network namespace with one interface ``eth0`` (a veth pair to a Linux bridge that lives
in a namespace of its own), an address in ``10.77.0.0/24`` that exists only inside these namespaces, and
its own mount and UTS namespaces, so it has its own hostname (``host0``, ``host1``, ...) and its own
``/dev/shm`` (a tmpfs): host detection in twisternet and MPICH sees H separate machines and the ranks of
different hosts talk over the links. Both ends of every veth are shaped with ``tc tbf`` to ``rate``, so
each host's link carries ``rate`` each way, like a host's NIC on a switch.

    with Testbed(hosts=2, ranks_per_host=2, rate="1gbit") as tb:
        tb.run(0, ["hostname"])                       # runs inside host 0
        res = tb.twisternet_job("script.py", ["arg"])  # master on host 0, k workers per host
        res = tb.mpich_job("script.py")                # mpiexec across the hosts (hydra, manual launch)
        tb.counters()                                  # bytes through each host's link

Everything is named with a per-run prefix ``tntb-<pid>-<random>`` (namespaces ``<prefix>-h<i>`` and
``<prefix>-br``, a state directory ``/run/twisternet-testbed/<prefix>``); a new testbed first removes the
leftovers of runs whose process is gone (:func:`sweep_stale`). :meth:`Testbed.close` (also on error or
KeyboardInterrupt, via the context manager) kills the processes it started and removes every namespace,
veth, bridge and mount. Needs root, iproute2 (``ip``, ``tc``), ``unshare`` and ``nsenter`` (util-linux);
:func:`unavailable` says why not. The command line is ``twisternet testbed up|run|status|down``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from collections.abc import Mapping, Sequence

from ..errors import TwisternetError

__all__ = ["Testbed", "TestbedError", "Job", "JobResult", "ProcResult", "LinkCounters", "unavailable",
           "sweep_stale", "list_testbeds", "PREFIX_ROOT", "STATE_ROOT"]

log = logging.getLogger(__name__)

#: Every name this module creates starts with this (namespaces) or lives under STATE_ROOT.
PREFIX_ROOT = "tntb"
STATE_ROOT = Path("/run/twisternet-testbed")
_NAME = re.compile(rf"^{PREFIX_ROOT}-(\d+|keep)-([0-9a-f]+)$")
_SUBNET = "10.77.0"
_CMD_TIMEOUT = 30.0
REPO = Path(__file__).resolve().parents[2]


class TestbedError(TwisternetError):
    """Building, using or removing the emulated cluster failed (the message names the command)."""

    __test__ = False


def _sh(*cmd: str, timeout: float = _CMD_TIMEOUT, check: bool = True, input: str | None = None
        ) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, input=input)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TestbedError(f"{' '.join(cmd)}: {e}") from None
    if check and r.returncode != 0:
        raise TestbedError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def unavailable() -> str | None:
    """None if this machine can build a testbed, else the reason (not root, no ip/tc, unshare refused)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root or in a privileged container)"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux"),
                      ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (install {pkg})"
    probe = f"{PREFIX_ROOT}-probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=_CMD_TIMEOUT)
    # what every host needs, tried in a throwaway mount/UTS namespace: a tmpfs /dev/shm and a hostname
    r = subprocess.run(["unshare", "-m", "-u", "--propagation", "private", "sh", "-c",
                        f"mount -t tmpfs -o size=1m tmpfs /dev/shm && hostname {PREFIX_ROOT}-probe"],
                       capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    if r.returncode != 0:
        return f"unshare refused a mount/UTS namespace with its own /dev/shm and hostname: {r.stderr.strip()}"
    return None


# ------------------------------------------------------------------------------------------ naming
def _owner_alive(owner: str) -> bool:
    if owner == "keep":
        return True
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_testbeds() -> dict[str, list[str]]:
    """Every testbed prefix present on this machine -> its namespace names."""
    out: dict[str, list[str]] = {}
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        prefix, _, _ = name.rpartition("-")
        if _NAME.match(prefix):
            out.setdefault(prefix, []).append(name)
    if STATE_ROOT.is_dir():
        for d in STATE_ROOT.iterdir():
            if _NAME.match(d.name):
                out.setdefault(d.name, [])
    return out


def _remove(prefix: str, namespaces: Sequence[str] = ()) -> list[str]:
    """Remove a testbed by prefix: its processes, namespaces, mounts and state. Returns what failed."""
    if not _NAME.match(prefix):
        raise TestbedError(f"not a testbed name: {prefix!r} (names look like {PREFIX_ROOT}-<pid>-<hex>)")
    problems: list[str] = []
    names = set(namespaces)
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    names.update(n.split()[0] for n in r.stdout.splitlines() if n.strip() and n.split()[0].startswith(prefix + "-"))
    for ns in sorted(names):                 # processes still inside (a killed run's jobs)
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=_CMD_TIMEOUT)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in sorted(names):
        r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, timeout=_CMD_TIMEOUT)
        if r.returncode != 0 and "No such file" not in r.stderr:
            problems.append(f"ip netns del {ns}: {r.stderr.strip()}")
    state = STATE_ROOT / prefix
    if state.exists():
        for f in sorted(state.glob("*.mnt")) + sorted(state.glob("*.uts")):
            subprocess.run(["umount", str(f)], capture_output=True, timeout=_CMD_TIMEOUT)
        subprocess.run(["umount", str(state)], capture_output=True, timeout=_CMD_TIMEOUT)
        shutil.rmtree(state, ignore_errors=True)
        if state.exists():
            problems.append(f"could not remove {state}")
    return problems


def sweep_stale() -> list[str]:
    """Remove the testbeds of processes that are gone (killed runs); returns their prefixes."""
    swept = []
    for prefix, namespaces in list_testbeds().items():
        m = _NAME.match(prefix)
        if m and not _owner_alive(m.group(1)):
            log.info("removing the leftovers of testbed %s (its process is gone)", prefix)
            _remove(prefix, namespaces)
            swept.append(prefix)
    return swept


# ------------------------------------------------------------------------------------------ results
@dataclass
class LinkCounters:
    """Bytes and packets through a host's ``eth0`` (as the host sees them) since it was made."""

    rx_bytes: int
    tx_bytes: int
    rx_packets: int
    tx_packets: int


@dataclass
class ProcResult:
    """One process of a job: where it ran, how it ended, what it printed."""

    host: int
    role: str                   # "master", "worker", "mpiexec", "proxy"
    index: int                  # the worker's number on its host (0..k-1); 0 for others
    returncode: int | None      # as Popen's: -9 if the job had to kill it (then ended is None)
    stdout: str
    stderr: str
    ended: float | None = None  # time.monotonic() when it exited (None: killed by the job's stop)

    @property
    def label(self) -> str:
        return f"{self.role} {self.index} on host{self.host}"


@dataclass
class JobResult:
    """All processes of a job; ``timed_out`` if the job was stopped at its deadline."""

    procs: list[ProcResult]
    seconds: float
    timed_out: bool = False
    counters_before: dict[int, LinkCounters] = field(default_factory=dict)
    counters_after: dict[int, LinkCounters] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(p.returncode == 0 for p in self.procs)

    @property
    def workers(self) -> list[ProcResult]:
        return [p for p in self.procs if p.role in ("worker", "mpiexec")]

    @property
    def stdout(self) -> str:
        """Every process's stdout, in host order."""
        return "".join(p.stdout for p in self.procs)

    @property
    def stderr(self) -> str:
        return "".join(p.stderr for p in self.procs)

    def link_bytes(self) -> dict[int, int]:
        """Bytes each host's link carried during the job (both directions)."""
        out = {}
        for h, after in self.counters_after.items():
            before = self.counters_before.get(h, LinkCounters(0, 0, 0, 0))
            out[h] = (after.rx_bytes - before.rx_bytes) + (after.tx_bytes - before.tx_bytes)
        return out

    def describe(self, tail: int = 1500) -> str:
        """A readable account of every process (exit status and the tail of its output)."""
        parts = [f"job {'timed out' if self.timed_out else 'ended'} after {self.seconds:.1f} s"]
        for p in self.procs:
            parts.append(f"--- {p.label}: exit {p.returncode}\n[stdout] {p.stdout[-tail:]}\n"
                         f"[stderr] {p.stderr[-tail:]}")
        return "\n".join(parts)

    def check(self) -> JobResult:
        """Raise TestbedError with :meth:`describe` unless every process exited 0."""
        if not self.ok:
            raise TestbedError(self.describe())
        return self


class _Collector:
    """Reads a process's stdout/stderr into strings in threads (so pipes never fill up)."""

    def __init__(self, proc: subprocess.Popen, host: int, role: str, index: int) -> None:
        self.proc, self.host, self.role, self.index = proc, host, role, index
        self.out: list[str] = []
        self.err: list[str] = []
        self.lines: list[str] = []                  # stdout lines, for waiters (see wait_for_line)
        self.cond = threading.Condition()
        self.ended: float | None = None
        self.killed = False
        self.threads = [threading.Thread(target=self._pump, args=(proc.stdout, self.out), daemon=True),
                        threading.Thread(target=self._pump, args=(proc.stderr, self.err), daemon=True)]
        for t in self.threads:
            t.start()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()

    def _pump(self, stream: IO[str] | None, into: list[str]) -> None:
        if stream is None:
            return
        for line in iter(stream.readline, ""):
            with self.cond:
                into.append(line)
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for_line(self, pattern: re.Pattern[str], timeout: float, start: int = 0) -> tuple[re.Match[str], int]:
        """The first output line (stdout or stderr) at index >= ``start`` matching ``pattern``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            i = start
            while True:
                while i < len(self.lines):
                    m = pattern.search(self.lines[i])
                    i += 1
                    if m:
                        return m, i
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and all(not t.is_alive() for t in self.threads)):
                    raise TestbedError(f"{self.role} on host{self.host} printed no line matching "
                                       f"{pattern.pattern!r} within {timeout:.0f} s (exit {self.proc.poll()}):\n"
                                       + "".join(self.lines)[-3000:])
                self.cond.wait(min(left, 0.5))

    def result(self) -> ProcResult:
        for t in self.threads:
            t.join(10)
        with self.cond:
            return ProcResult(self.host, self.role, self.index, self.proc.returncode, "".join(self.out),
                              "".join(self.err), None if self.killed else self.ended)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (every job process is started in its own group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        log.warning("process %d did not die after SIGKILL", proc.pid)


class Job:
    """Processes started across the testbed as one job; :meth:`wait` collects a :class:`JobResult`."""

    def __init__(self, testbed: Testbed, main: Sequence[_Collector], helpers: Sequence[_Collector] = ()) -> None:
        self.testbed = testbed
        self.main = list(main)          # the job ends when these end
        self.helpers = list(helpers)    # stopped when the main ones ended (a master, MPI proxies)
        self.started = time.monotonic()
        self.before = testbed.counters()

    @property
    def collectors(self) -> list[_Collector]:
        """Every process of the job, helpers (master / mpiexec's proxies) first."""
        return self.helpers + self.main

    def wait(self, timeout: float) -> JobResult:
        """Wait up to ``timeout`` s for the main processes; then stop everything and report."""
        deadline = self.started + timeout
        timed_out = False
        for c in self.main:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        seconds = time.monotonic() - self.started
        after = self.testbed.counters()
        for c in self.helpers:          # a master ends by itself once its workers are gone
            try:
                c.proc.wait(max(0.5, min(5.0, deadline + 5 - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        return JobResult([c.result() for c in self.collectors], seconds, timed_out, self.before, after)

    def stop(self) -> None:
        """Kill every process of the job that still runs (their ``ended`` stays None: they did not exit)."""
        for c in self.main + self.helpers:
            if c.proc.poll() is None:
                _kill_tree(c.proc)
                # poll() can miss an exit that another thread is reaping right then: only a SIGKILL is ours
                c.killed = c.proc.returncode == -signal.SIGKILL
        self.testbed._jobs.discard(self)


# ------------------------------------------------------------------------------------------ testbed
def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class Testbed:
    """H hosts (network + mount + UTS namespaces) on a bridge, links shaped to ``rate`` with ``tc tbf``.

    ``rate`` is a tc rate ("1gbit", "100mbit") or None for unshaped veths; ``ranks_per_host`` (k) is the
    default number of ranks per host of the jobs it starts. ``keep=True`` makes a testbed that outlives
    this process (``twisternet testbed up``): it is not swept as stale and is removed by ``down``.
    """

    __test__ = False  # not a pytest class

    def __init__(self, hosts: int = 2, ranks_per_host: int = 1, rate: str | None = "1gbit", *,
                 burst: str = "256kb", latency: str = "50ms", shm_size: str = "2g", keep: bool = False,
                 prefix: str | None = None) -> None:
        if hosts < 1 or hosts > 200:
            raise TestbedError(f"hosts must be in 1..200, got {hosts}")
        if ranks_per_host < 1:
            raise TestbedError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
        self.hosts = hosts
        self.ranks_per_host = ranks_per_host
        self.rate = rate
        self.burst, self.latency, self.shm_size = burst, latency, shm_size
        self.keep = keep
        self.prefix = prefix or f"{PREFIX_ROOT}-{'keep' if keep else os.getpid()}-{secrets.token_hex(3)}"
        if not _NAME.match(self.prefix):
            raise TestbedError(f"not a testbed name: {self.prefix!r}")
        self.bridge_ns = f"{self.prefix}-br"
        self.namespaces = [f"{self.prefix}-h{i}" for i in range(hosts)]
        self.addresses = [f"{_SUBNET}.{i + 1}" for i in range(hosts)]
        self.hostnames = [f"host{i}" for i in range(hosts)]
        self.state = STATE_ROOT / self.prefix
        self._jobs: set[Job] = set()
        self._is_up = False
        self.tmp: Path | None = None

    # -------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> Testbed:
        # A SIGTERM (timeout(1), a CI runner) should clean up like Ctrl-C does: while the testbed is up, the
        # default action (die at once) becomes SystemExit in the main thread, so close() runs.
        self._previous_sigterm: Any = None
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self.up()
        except BaseException:
            self._restore_sigterm()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def up(self) -> Testbed:
        """Build the hosts, bridge and shaped links (removing stale testbeds first); idempotent."""
        if self._is_up:
            return self
        why = unavailable()
        if why:
            raise TestbedError(f"cannot build a testbed here: {why}")
        sweep_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self._is_up = True
        log.info("testbed %s: %d hosts at %s", self.prefix, self.hosts, self.rate or "unshaped")
        return self

    def _build(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        os.chmod(self.tmp, 0o755)
        self.state.mkdir(parents=True, exist_ok=True)
        # The namespace files are bind mounts; their directory must be a private mount (as /run/netns is).
        _sh("mount", "--bind", str(self.state), str(self.state))
        _sh("mount", "--make-private", str(self.state))
        self._write_state()
        _sh("ip", "netns", "add", self.bridge_ns)
        b = ("ip", "-n", self.bridge_ns)
        _sh(*b, "link", "set", "lo", "up")
        _sh(*b, "link", "add", "br0", "type", "bridge")
        _sh(*b, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            _sh("ip", "netns", "add", ns)
            n = ("ip", "-n", ns)
            _sh(*n, "link", "set", "lo", "up")
            _sh(*n, "link", "add", "eth0", "type", "veth", "peer", "name", f"v{i}", "netns", self.bridge_ns)
            _sh(*n, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _sh(*n, "link", "set", "eth0", "up")
            _sh(*b, "link", "set", f"v{i}", "master", "br0")
            _sh(*b, "link", "set", f"v{i}", "up")
            if self.rate:
                tbf = ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *tbf)
                _sh("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "add", "dev", f"v{i}", *tbf)
            mnt, uts = self.state / f"h{i}.mnt", self.state / f"h{i}.uts"
            mnt.touch()
            uts.touch()
            script = (f"mount -t tmpfs -o size={self.shm_size},mode=1777 tmpfs /dev/shm && "
                      f"hostname {self.hostnames[i]}")
            _sh("unshare", f"--mount={mnt}", f"--uts={uts}", "--propagation", "private", "sh", "-c", script)

    def _write_state(self) -> None:
        (self.state / "state.json").write_text(json.dumps({
            "prefix": self.prefix, "hosts": self.hosts, "ranks_per_host": self.ranks_per_host, "rate": self.rate,
            "burst": self.burst, "latency": self.latency, "owner": "keep" if self.keep else os.getpid(),
            "tmp": str(self.tmp)}))

    @classmethod
    def attach(cls, prefix: str) -> Testbed:
        """The testbed ``prefix`` made by another process (``twisternet testbed up``), to run things in."""
        try:
            st = json.loads((STATE_ROOT / prefix / "state.json").read_text())
        except (OSError, ValueError) as e:
            raise TestbedError(f"no testbed {prefix!r} here ({e})") from None
        tb = cls(st["hosts"], st["ranks_per_host"], st["rate"], burst=st["burst"], latency=st["latency"],
                 keep=st["owner"] == "keep", prefix=prefix)
        tb.tmp = Path(st["tmp"])
        tb._is_up = True
        return tb

    def close(self) -> None:
        """Stop the jobs and remove every namespace, veth, bridge, mount and temporary file; idempotent."""
        for job in list(self._jobs):
            job.stop()
        problems = _remove(self.prefix, [*self.namespaces, self.bridge_ns])
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self._is_up = False
        if problems:
            raise TestbedError(f"testbed {self.prefix} not fully removed: " + "; ".join(problems))

    def detach(self) -> None:
        """Forget the testbed without removing it (the CLI's ``up`` leaves it for ``run``/``down``)."""
        self._is_up = False
        self._jobs.clear()

    # -------------------------------------------------------------------------------- running things
    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside ``host``: its network, its hostname and its own /dev/shm."""
        self._check_host(host)
        return ["nsenter", f"--net=/run/netns/{self.namespaces[host]}", f"--mount={self.state}/h{host}.mnt",
                f"--uts={self.state}/h{host}.uts", "--", *argv]

    def popen(self, host: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None, stdin: Any = subprocess.DEVNULL) -> subprocess.Popen:
        """Start ``argv`` in ``host`` (own process group, text pipes for stdout/stderr)."""
        return subprocess.Popen(self.command(host, argv), env=dict(env) if env is not None else None,
                                cwd=cwd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    def run(self, host: int, argv: Sequence[str], *, timeout: float = 60.0, env: Mapping[str, str] | None = None,
            cwd: str | os.PathLike[str] | None = None, check: bool = False) -> subprocess.CompletedProcess:
        """Run ``argv`` in ``host`` to completion (killed after ``timeout``); returns the CompletedProcess."""
        p = self.popen(host, argv, env=env, cwd=cwd)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(p)
            out, err = p.communicate()
            raise TestbedError(f"{' '.join(argv)} on host{host} did not finish within {timeout:.0f} s:\n"
                               f"{out[-1500:]}\n{err[-1500:]}") from None
        r = subprocess.CompletedProcess(list(argv), p.returncode, out, err)
        if check and r.returncode != 0:
            raise TestbedError(f"{' '.join(argv)} on host{host} failed ({r.returncode}): {err[-2000:]}")
        return r

    def _check_host(self, host: int) -> None:
        if not 0 <= host < self.hosts:
            raise TestbedError(f"no host {host}: the testbed has hosts 0..{self.hosts - 1}")

    # -------------------------------------------------------------------------------- links
    def counters(self) -> dict[int, LinkCounters]:
        """Per host, the byte/packet counters of its ``eth0`` (from ``ip -s -j link``)."""
        out = {}
        for i, ns in enumerate(self.namespaces):
            r = _sh("ip", "-n", ns, "-s", "-j", "link", "show", "dev", "eth0")
            st = json.loads(r.stdout)[0]["stats64"]
            out[i] = LinkCounters(st["rx"]["bytes"], st["tx"]["bytes"], st["rx"]["packets"], st["tx"]["packets"])
        return out

    def link_down(self, host: int) -> None:
        """Take ``host``'s link down (its ``eth0``): from now on nothing reaches it or leaves it."""
        self._check_host(host)
        _sh("ip", "-n", self.namespaces[host], "link", "set", "eth0", "down")

    def link_up(self, host: int) -> None:
        """Bring ``host``'s link back up (its address and route come back with it)."""
        self._check_host(host)
        _sh("ip", "-n", self.namespaces[host], "link", "set", "eth0", "up")

    def set_rate(self, rate: str) -> None:
        """Reshape every link to ``rate`` (both ends), e.g. "100mbit"."""
        tbf = ["root", "tbf", "rate", rate, "burst", self.burst, "latency", self.latency]
        for i, ns in enumerate(self.namespaces):
            verb = "change" if self.rate else "add"
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", "eth0", *tbf)
            _sh("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", verb, "dev", f"v{i}", *tbf)
        self.rate = rate

    def status(self) -> dict[str, Any]:
        """What the testbed is: name, hosts (namespace, hostname, address, link state, counters), rate."""
        hosts = []
        for i, ns in enumerate(self.namespaces):
            r = _sh("ip", "-n", ns, "-s", "-j", "link", "show", "dev", "eth0", check=False)
            info = json.loads(r.stdout)[0] if r.returncode == 0 and r.stdout.strip() else {}
            st = info.get("stats64", {})
            hosts.append({"host": i, "namespace": ns, "hostname": self.hostnames[i], "address": self.addresses[i],
                          "link": info.get("operstate", "missing"), "rx_bytes": st.get("rx", {}).get("bytes"),
                          "tx_bytes": st.get("tx", {}).get("bytes")})
        return {"name": self.prefix, "rate": self.rate, "ranks_per_host": self.ranks_per_host, "hosts": hosts}

    # -------------------------------------------------------------------------------- jobs
    def job_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Our environment without TWISTERNET_* settings, the repository first on PYTHONPATH, unbuffered."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TWISTERNET_")}
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra or {})
        return env

    def placement(self, ranks_per_host: int | None = None) -> list[int]:
        """Host of each worker in start order: host-major (k on host 0, then k on host 1, ...)."""
        k = ranks_per_host or self.ranks_per_host
        return [h for h in range(self.hosts) for _ in range(k)]

    def start_twisternet_job(self, script: str | os.PathLike[str], args: Sequence[str] = (), *,
                             ranks_per_host: int | None = None, env: Mapping[str, str] | None = None,
                             master_host: int = 0, contiguous_ranks: bool = False,
                             interleaved_ranks: bool = False,
                             token: str | None = None, worker_tokens: Mapping[int, str] | None = None,
                             master_address: str | None = None, python: str | None = None) -> Job:
        """``twisternet master`` on ``master_host`` and k ``twisternet worker`` processes per host.

        The master numbers the ranks (host-contiguous, see twisternet.topology: what a user gets), unless
        ``contiguous_ranks`` (host h's workers request ranks h*k..h*k+k-1 themselves) or
        ``interleaved_ranks`` (local worker j of host h requests rank j*H + h: consecutive ranks on
        different hosts, the numbering by connection order the master used to give). ``worker_tokens``
        ({worker index: token}) and ``master_address`` are for tests of bad input (a wrong token, an
        unreachable master).
        """
        py = python or sys.executable
        k = ranks_per_host or self.ranks_per_host
        world = k * self.hosts
        assert self.tmp is not None, "the testbed is not up"
        token = token or secrets.token_hex(16)
        token_file = Path(tempfile.mkstemp(prefix="token-", dir=self.tmp)[1])
        token_file.write_text(token + "\n")
        os.chmod(token_file, 0o600)
        job_env = self.job_env(env)
        master = _Collector(self.popen(master_host, [py, "-m", "twisternet", "master", "--world", str(world),
                                                     "--host", self.addresses[master_host], "--port", "0",
                                                     "--token-file", str(token_file)],
                                       env=job_env, cwd=REPO), master_host, "master", 0)
        workers: list[_Collector] = []
        try:
            m, _ = master.wait_for_line(re.compile(r"listening on (\S+):(\d+)"), 60)
            address = master_address or f"{m.group(1)}:{m.group(2)}"
            for n, host in enumerate(self.placement(k)):
                tf = token_file
                if worker_tokens and n in worker_tokens:
                    tf = Path(tempfile.mkstemp(prefix="token-", dir=self.tmp)[1])
                    tf.write_text(worker_tokens[n] + "\n")
                argv = [py, "-m", "twisternet", "worker", "--master", address, "--token-file", str(tf),
                        "--world", str(world)]
                if contiguous_ranks:
                    argv += ["--rank", str(n)]
                elif interleaved_ranks:
                    argv += ["--rank", str((n % k) * self.hosts + n // k)]
                workers.append(_Collector(self.popen(host, [*argv, str(script), *args], env=job_env, cwd=REPO),
                                          host, "worker", n % k))
        except BaseException:
            for c in [master, *workers]:
                _kill_tree(c.proc)
            raise
        job = Job(self, workers, [master])
        self._jobs.add(job)
        return job

    def twisternet_job(self, script: str | os.PathLike[str], args: Sequence[str] = (), *, timeout: float = 120.0,
                       **kw: Any) -> JobResult:
        """Run a twisternet master/worker job to completion (see :meth:`start_twisternet_job`)."""
        return self.start_twisternet_job(script, args, **kw).wait(timeout)

    def start_processes(self, commands: Sequence[tuple[int, Sequence[str]]], *,
                        env: Mapping[str, str] | None = None) -> Job:
        """Start each ``(host, argv)`` in its host as one job (for peers with their own rendezvous, e.g.
        torch.distributed: rank i's argv names host 0's address)."""
        job_env = self.job_env(env)
        started: list[_Collector] = []
        per_host: dict[int, int] = {}
        try:
            for host, argv in commands:
                index = per_host.get(host, 0)
                per_host[host] = index + 1
                started.append(_Collector(self.popen(host, argv, env=job_env, cwd=REPO), host, "worker", index))
        except BaseException:
            for c in started:
                _kill_tree(c.proc)
            raise
        job = Job(self, started)
        self._jobs.add(job)
        return job

    def mpiexec(self) -> str:
        """The mpich wheel's ``mpiexec`` next to this interpreter, else one on PATH."""
        here = Path(sys.executable).parent / "mpiexec"
        found = str(here) if here.exists() else shutil.which("mpiexec")
        if not found:
            raise TestbedError("no mpiexec (install the mpi extra: pip install '.[mpi]')")
        return found

    def mpich_env(self, netmod: str = "ofi") -> list[str]:
        """``-genv`` arguments that keep MPICH's data on the links: TCP over eth0 (never cma or shm).

        "ofi" (libfabric's tcp provider, the faster here) or "ucx" (UCX_TLS=self,tcp); "default" adds
        nothing, and then the wheel's UCX moves data between the namespaces with cma (process_vm_readv:
        the pid namespace is shared), around the links.
        """
        if netmod == "ofi":
            pairs = [("MPIR_CVAR_CH4_NETMOD", "ofi"), ("FI_PROVIDER", "tcp"), ("FI_TCP_IFACE", "eth0")]
        elif netmod == "ucx":
            pairs = [("UCX_TLS", "self,tcp"), ("UCX_NET_DEVICES", "eth0")]
        elif netmod == "default":   # the wheel's own choice: UCX, which may use cma and bypass the links
            pairs = []
        else:
            raise TestbedError(f"netmod must be 'ofi', 'ucx' or 'default', got {netmod!r}")
        return [a for k, v in pairs for a in ("-genv", k, v)]

    def start_mpich_job(self, argv: Sequence[str], *, ranks_per_host: int | None = None,
                        env: Mapping[str, str] | None = None, netmod: str = "ofi",
                        mpiexec_args: Sequence[str] = ()) -> Job:
        """``mpiexec -launcher manual`` on host 0 with k ranks per host; each hydra proxy started in its host.

        ``argv`` is the program each rank runs (e.g. ``[python, script.py, ...]``).
        """
        k = ranks_per_host or self.ranks_per_host
        job_env = self.job_env(env)
        cmd = [self.mpiexec(), "-launcher", "manual", "-iface", "eth0", "-hosts", ",".join(self.addresses),
               "-n", str(k * self.hosts), "-ppn", str(k), *self.mpich_env(netmod),
               "-genv", "PYTHONPATH", job_env["PYTHONPATH"], *mpiexec_args, *argv]
        hydra = _Collector(self.popen(0, cmd, env=job_env, cwd=REPO), 0, "mpiexec", 0)
        proxies: list[_Collector] = []
        try:
            pattern = re.compile(r"^HYDRA_LAUNCH: (.*)$")
            pos = 0
            for _ in range(self.hosts):
                m, pos = hydra.wait_for_line(pattern, 60, pos)
                launch = m.group(1).split()
                pid = launch.index("--proxy-id")
                host = int(launch[pid + 1])
                proxies.append(_Collector(self.popen(host, launch, env=job_env, cwd=REPO), host, "proxy", 0))
        except BaseException:
            for c in [hydra, *proxies]:
                _kill_tree(c.proc)
            raise
        job = Job(self, [hydra], proxies)
        self._jobs.add(job)
        return job

    def mpich_job(self, argv: Sequence[str], *, timeout: float = 120.0, **kw: Any) -> JobResult:
        """Run an MPICH job across the hosts to completion (see :meth:`start_mpich_job`)."""
        return self.start_mpich_job(argv, **kw).wait(timeout)
