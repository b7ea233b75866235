"""The emulated cluster itself: H "hosts" as network namespaces behind a shaped bridge.

Each host is a network namespace with one interface ``eth0`` (a veth pair to a Linux bridge that lives
in a namespace of its own), an address in ``10.77.0.0/24`` that exists only inside these namespaces, and
its own mount and UTS namespaces, so it has its own hostname (``host0``, ``host1``, ...) and its own
``/dev/shm`` (a tmpfs): host detection in twisternet and MPICH sees H separate machines and the ranks of
different hosts talk over the links. Both ends of every veth are shaped with ``tc tbf`` to ``rate``, so
each host's link carries ``rate`` each way, like a host's NIC on a switch. ``service_hosts`` adds hosts
that run no ranks (an in-network switch, a parameter server: hosts H..H+S-1, hostnames ``svc0``, ...),
their links shaped to ``service_rate`` (None: unshaped, so they are never the bottleneck).

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
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

from .inventory import TESTBED_NAME, list_testbeds, remove_testbed, sweep_stale
from .jobs import REPO, JobLauncher
from .processes import Job, kill_tree
from .results import JobResult, LinkCounters, ProcResult
from .system import PREFIX_ROOT, STATE_ROOT, TestbedError, sh, unavailable

__all__ = ["Testbed", "TestbedError", "Job", "JobResult", "ProcResult", "LinkCounters", "unavailable",
           "sweep_stale", "list_testbeds", "remove_testbed", "PREFIX_ROOT", "STATE_ROOT", "REPO"]

log = logging.getLogger(__name__)

#: The hosts' addresses are SUBNET.1, SUBNET.2, ... (a /24 that exists only inside the namespaces).
SUBNET = "10.77.0"

_remove = remove_testbed     # its name before the split (tests call it)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class Testbed(JobLauncher):
    """H hosts (network + mount + UTS namespaces) on a bridge, links shaped to ``rate`` with ``tc tbf``.

    ``rate`` is a tc rate ("1gbit", "100mbit") or None for unshaped veths; ``ranks_per_host`` (k) is the
    default number of ranks per host of the jobs it starts. ``service_hosts`` (S) more hosts, numbered
    H..H+S-1, get no ranks of the jobs and links shaped to ``service_rate`` (None: unshaped; or one rate
    per service host): where a switch or a PS runs (``tb.run``/``tb.popen`` take their numbers).
    ``keep=True`` makes a testbed that outlives this process (``twisternet testbed up``): it is not swept
    as stale and is removed by ``down``.
    """

    __test__ = False  # not a pytest class

    def __init__(self, hosts: int = 2, ranks_per_host: int = 1, rate: str | None = "1gbit", *,
                 burst: str = "256kb", latency: str = "50ms", shm_size: str = "2g", keep: bool = False,
                 prefix: str | None = None, service_hosts: int = 0,
                 service_rate: str | None | Sequence[str | None] = None) -> None:
        if hosts < 1 or hosts > 200:
            raise TestbedError(f"hosts must be in 1..200, got {hosts}")
        if service_hosts < 0 or hosts + service_hosts > 200:
            raise TestbedError(f"service_hosts must be in 0..{200 - hosts}, got {service_hosts}")
        if ranks_per_host < 1:
            raise TestbedError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
        self.hosts = hosts
        self.ranks_per_host = ranks_per_host
        self.rate = rate
        self.service_hosts = service_hosts
        rates = [service_rate] * service_hosts if service_rate is None or isinstance(service_rate, str) \
            else list(service_rate)
        if len(rates) != service_hosts:
            raise TestbedError(f"service_rate: {len(rates)} rates for {service_hosts} service hosts")
        self.service_rates: list[str | None] = rates
        self.burst, self.latency, self.shm_size = burst, latency, shm_size
        self.keep = keep
        self.prefix = prefix or f"{PREFIX_ROOT}-{'keep' if keep else os.getpid()}-{secrets.token_hex(3)}"
        if not TESTBED_NAME.match(self.prefix):
            raise TestbedError(f"not a testbed name: {self.prefix!r}")
        self.bridge_ns = f"{self.prefix}-br"
        everyone = hosts + service_hosts
        self.namespaces = [f"{self.prefix}-h{i}" for i in range(everyone)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(everyone)]
        self.hostnames = [f"host{i}" for i in range(hosts)] + [f"svc{j}" for j in range(service_hosts)]
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
        sh("mount", "--bind", str(self.state), str(self.state))
        sh("mount", "--make-private", str(self.state))
        self._write_state()
        sh("ip", "netns", "add", self.bridge_ns)
        b = ("ip", "-n", self.bridge_ns)
        sh(*b, "link", "set", "lo", "up")
        sh(*b, "link", "add", "br0", "type", "bridge")
        sh(*b, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            sh("ip", "netns", "add", ns)
            n = ("ip", "-n", ns)
            sh(*n, "link", "set", "lo", "up")
            sh(*n, "link", "add", "eth0", "type", "veth", "peer", "name", f"v{i}", "netns", self.bridge_ns)
            sh(*n, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            sh(*n, "link", "set", "eth0", "up")
            sh(*b, "link", "set", f"v{i}", "master", "br0")
            sh(*b, "link", "set", f"v{i}", "up")
            rate = self.link_rate(i)
            if rate:
                tbf = ["root", "tbf", "rate", rate, "burst", self.burst, "latency", self.latency]
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *tbf)
                sh("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "add", "dev", f"v{i}", *tbf)
            mnt, uts = self.state / f"h{i}.mnt", self.state / f"h{i}.uts"
            mnt.touch()
            uts.touch()
            script = (f"mount -t tmpfs -o size={self.shm_size},mode=1777 tmpfs /dev/shm && "
                      f"hostname {self.hostnames[i]}")
            sh("unshare", f"--mount={mnt}", f"--uts={uts}", "--propagation", "private", "sh", "-c", script)

    def _write_state(self) -> None:
        (self.state / "state.json").write_text(json.dumps({
            "prefix": self.prefix, "hosts": self.hosts, "ranks_per_host": self.ranks_per_host, "rate": self.rate,
            "service_hosts": self.service_hosts, "service_rate": self.service_rates,
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
                 keep=st["owner"] == "keep", prefix=prefix, service_hosts=st.get("service_hosts", 0),
                 service_rate=st.get("service_rate"))
        tb.tmp = Path(st["tmp"])
        tb._is_up = True
        return tb

    def close(self) -> None:
        """Stop the jobs and remove every namespace, veth, bridge, mount and temporary file; idempotent."""
        for job in list(self._jobs):
            job.stop()
        problems = remove_testbed(self.prefix, [*self.namespaces, self.bridge_ns])
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self._is_up = False
        if problems:
            raise TestbedError(f"testbed {self.prefix} not fully removed: " + "; ".join(problems))

    def _job_ended(self, job: Job) -> None:
        """``job`` stopped (its :meth:`Job.stop`): :meth:`close` has no more to stop there."""
        self._jobs.discard(job)

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
            kill_tree(p)
            out, err = p.communicate()
            raise TestbedError(f"{' '.join(argv)} on host{host} did not finish within {timeout:.0f} s:\n"
                               f"{out[-1500:]}\n{err[-1500:]}") from None
        r = subprocess.CompletedProcess(list(argv), p.returncode, out, err)
        if check and r.returncode != 0:
            raise TestbedError(f"{' '.join(argv)} on host{host} failed ({r.returncode}): {err[-2000:]}")
        return r

    def _check_host(self, host: int) -> None:
        if not 0 <= host < len(self.namespaces):
            raise TestbedError(f"no host {host}: the testbed has hosts 0..{len(self.namespaces) - 1}")

    @property
    def service_host_ids(self) -> list[int]:
        """The numbers of the service hosts (no ranks): H..H+S-1."""
        return list(range(self.hosts, self.hosts + self.service_hosts))

    def link_rate(self, host: int) -> str | None:
        """The rate ``host``'s link is shaped to (None: unshaped)."""
        return self.rate if host < self.hosts else self.service_rates[host - self.hosts]

    # -------------------------------------------------------------------------------- links
    def counters(self) -> dict[int, LinkCounters]:
        """Per host, the byte/packet counters of its ``eth0`` (from ``ip -s -j link``)."""
        out = {}
        for i, ns in enumerate(self.namespaces):
            r = sh("ip", "-n", ns, "-s", "-j", "link", "show", "dev", "eth0")
            st = json.loads(r.stdout)[0]["stats64"]
            out[i] = LinkCounters(st["rx"]["bytes"], st["tx"]["bytes"], st["rx"]["packets"], st["tx"]["packets"])
        return out

    def link_down(self, host: int) -> None:
        """Take ``host``'s link down (its ``eth0``): from now on nothing reaches it or leaves it."""
        self._check_host(host)
        sh("ip", "-n", self.namespaces[host], "link", "set", "eth0", "down")

    def link_up(self, host: int) -> None:
        """Bring ``host``'s link back up (its address and route come back with it)."""
        self._check_host(host)
        sh("ip", "-n", self.namespaces[host], "link", "set", "eth0", "up")

    def set_rate(self, rate: str) -> None:
        """Reshape every rank host's link to ``rate`` (both ends), e.g. "100mbit" (service hosts keep theirs)."""
        tbf = ["root", "tbf", "rate", rate, "burst", self.burst, "latency", self.latency]
        for i, ns in enumerate(self.namespaces[:self.hosts]):
            verb = "change" if self.rate else "add"
            sh("ip", "netns", "exec", ns, "tc", "qdisc", verb, "dev", "eth0", *tbf)
            sh("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", verb, "dev", f"v{i}", *tbf)
        self.rate = rate

    def status(self) -> dict[str, Any]:
        """What the testbed is: name, hosts (namespace, hostname, address, link state, counters), rate."""
        hosts = []
        for i, ns in enumerate(self.namespaces):
            r = sh("ip", "-n", ns, "-s", "-j", "link", "show", "dev", "eth0", check=False)
            info = json.loads(r.stdout)[0] if r.returncode == 0 and r.stdout.strip() else {}
            st = info.get("stats64", {})
            hosts.append({"host": i, "namespace": ns, "hostname": self.hostnames[i], "address": self.addresses[i],
                          "role": "ranks" if i < self.hosts else "service", "rate": self.link_rate(i),
                          "link": info.get("operstate", "missing"), "rx_bytes": st.get("rx", {}).get("bytes"),
                          "tx_bytes": st.get("tx", {}).get("bytes")})
        return {"name": self.prefix, "rate": self.rate, "ranks_per_host": self.ranks_per_host, "hosts": hosts}
