"""Starting jobs on the testbed: twisternet master/worker jobs, MPICH jobs across the hosts, and any
processes (a mixin of :class:`~twisternet.testbed.cluster.Testbed`)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from collections.abc import Mapping, Sequence

from .processes import Job, OutputCollector, kill_tree
from .results import JobResult
from .system import TestbedError

if TYPE_CHECKING:
    from .cluster import Testbed

#: The repository root: first on the jobs' PYTHONPATH, their working directory.
REPO = Path(__file__).resolve().parents[2]


class JobLauncher:
    """Testbed part: the jobs it starts (state: the testbed's ``_jobs``, the jobs still running)."""

    # Declared here for the type checker; Testbed.__init__ makes them.
    hosts: int
    ranks_per_host: int
    addresses: list[str]
    tmp: Path | None
    _jobs: set[Job]

    if TYPE_CHECKING:
        def popen(self, host: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                  cwd: str | os.PathLike[str] | None = None, stdin: Any = subprocess.DEVNULL
                  ) -> subprocess.Popen[Any]: ...

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
        master_argv = [py, "-m", "twisternet", "master", "--world", str(world), "--host", self.addresses[master_host],
                       "--port", "0", "--token-file", str(token_file)]
        master = OutputCollector(self.popen(master_host, master_argv, env=job_env, cwd=REPO), master_host, "master", 0)
        workers: list[OutputCollector] = []
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
                workers.append(OutputCollector(self.popen(host, [*argv, str(script), *args], env=job_env, cwd=REPO),
                                               host, "worker", n % k))
        except BaseException:
            for c in [master, *workers]:
                kill_tree(c.proc)
            raise
        job = Job(cast("Testbed", self), workers, [master])
        self._jobs.add(job)
        return job

    def twisternet_job(self, script: str | os.PathLike[str], args: Sequence[str] = (), *,
                       timeout: float = 120.0, **kw: Any) -> JobResult:
        """Run a twisternet master/worker job to completion (see :meth:`start_twisternet_job`)."""
        return self.start_twisternet_job(script, args, **kw).wait(timeout)

    def start_processes(self, commands: Sequence[tuple[int, Sequence[str]]], *,
                        env: Mapping[str, str] | None = None) -> Job:
        """Start each ``(host, argv)`` in its host as one job (for peers with their own rendezvous, e.g.
        torch.distributed: rank i's argv names host 0's address)."""
        job_env = self.job_env(env)
        started: list[OutputCollector] = []
        per_host: dict[int, int] = {}
        try:
            for host, argv in commands:
                index = per_host.get(host, 0)
                per_host[host] = index + 1
                started.append(OutputCollector(self.popen(host, argv, env=job_env, cwd=REPO), host, "worker", index))
        except BaseException:
            for c in started:
                kill_tree(c.proc)
            raise
        job = Job(cast("Testbed", self), started)
        self._jobs.add(job)
        return job

    def start_innet_switch(self, host: int, token: str, *, values: int = 62, port: int = 9100,
                           p4runtime_port: int = 9101, ecn_threshold: int | None = None,
                           python: str | None = None) -> tuple[Job, dict[str, str]]:
        """An ATP software switch with its P4Runtime server (``twisternet switch``) on ``host`` (a
        service host, as a shared switch of a cluster), bound to that host's address, ``values`` wide,
        its P4Runtime token derived from the job token ``token`` (a 0600 file, never the command line);
        ``ecn_threshold``: the switch's (``twisternet switch --ecn-threshold``; None: its default).

        Returns the running job (stopped with the testbed) and the environment that points a
        twisternet job at it (``TWISTERNET_INNET_SWITCH`` / ``TWISTERNET_INNET_P4RUNTIME``); start the
        job with the same ``token``."""
        from innet.tokens import p4runtime_token
        assert self.tmp is not None, "the testbed is not up"
        token_file = Path(tempfile.mkstemp(prefix="p4rt-token-", dir=self.tmp)[1])
        token_file.write_text(p4runtime_token(token.encode()) + "\n")
        os.chmod(token_file, 0o600)
        address = self.addresses[host]
        argv = [python or sys.executable, "-m", "twisternet", "switch", "--host", address, "--port", str(port),
                "--values", str(values), "--p4runtime-port", str(p4runtime_port),
                "--p4runtime-token-file", str(token_file)]
        if ecn_threshold is not None:
            argv += ["--ecn-threshold", str(ecn_threshold)]
        job = self.start_processes([(host, argv)])
        collector = job.main[0]
        try:
            m, pos = collector.wait_for_line(re.compile(r"listening on udp (\S+):(\d+)"), 60)
            g, _ = collector.wait_for_line(re.compile(r"^p4runtime on (\S+):(\d+)"), 60, pos)
        except BaseException:
            job.stop()
            raise
        return job, {"TWISTERNET_INNET_SWITCH": f"{m.group(1)}:{m.group(2)}",
                     "TWISTERNET_INNET_P4RUNTIME": f"{g.group(1)}:{g.group(2)}"}

    def start_innet_ps(self, host: int, token: str, *, values: int = 62, port: int = 9200,
                       control_port: int = 9201, python: str | None = None) -> tuple[Job, dict[str, str]]:
        """A standing ATP parameter server (``twisternet ps`` with its control server) on ``host``, for
        the jobs placed on a shared switch (see :meth:`start_innet_switch`); returns the running job and
        the environment that points a twisternet job at it (``TWISTERNET_INNET_PS``)."""
        from innet.tokens import p4runtime_token
        assert self.tmp is not None, "the testbed is not up"
        token_file = Path(tempfile.mkstemp(prefix="ps-token-", dir=self.tmp)[1])
        token_file.write_text(p4runtime_token(token.encode()) + "\n")
        os.chmod(token_file, 0o600)
        argv = [python or sys.executable, "-m", "twisternet", "ps", "--host", self.addresses[host], "--port",
                str(port), "--values", str(values), "--control-port", str(control_port),
                "--control-token-file", str(token_file)]
        job = self.start_processes([(host, argv)])
        try:
            m, _ = job.main[0].wait_for_line(re.compile(r"^ps control on (\S+):(\d+)"), 60)
        except BaseException:
            job.stop()
            raise
        return job, {"TWISTERNET_INNET_PS": f"{m.group(1)}:{m.group(2)}"}

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
        cmd = [self.mpiexec(), "-launcher", "manual", "-iface", "eth0", "-hosts", ",".join(self.addresses[:self.hosts]),
               "-n", str(k * self.hosts), "-ppn", str(k), *self.mpich_env(netmod),
               "-genv", "PYTHONPATH", job_env["PYTHONPATH"], *mpiexec_args, *argv]
        hydra = OutputCollector(self.popen(0, cmd, env=job_env, cwd=REPO), 0, "mpiexec", 0)
        proxies: list[OutputCollector] = []
        try:
            pattern = re.compile(r"^HYDRA_LAUNCH: (.*)$")
            pos = 0
            for _ in range(self.hosts):
                m, pos = hydra.wait_for_line(pattern, 60, pos)
                launch = m.group(1).split()
                pid = launch.index("--proxy-id")
                host = int(launch[pid + 1])
                proxies.append(OutputCollector(self.popen(host, launch, env=job_env, cwd=REPO), host, "proxy", 0))
        except BaseException:
            for c in [hydra, *proxies]:
                kill_tree(c.proc)
            raise
        job = Job(cast("Testbed", self), [hydra], proxies)
        self._jobs.add(job)
        return job

    def mpich_job(self, argv: Sequence[str], *, timeout: float = 120.0, **kw: Any) -> JobResult:
        """Run an MPICH job across the hosts to completion (see :meth:`start_mpich_job`)."""
        return self.start_mpich_job(argv, **kw).wait(timeout)
