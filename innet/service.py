"""High-level in-network allreduce: ``InnetJob.allreduce`` and helpers that start a switch and a PS.

Typical multi-process use (what ``AllReduce(..., via="innet")`` does)::

    job = InnetJob(job_id=1, rank=r, world=w, switch_addr=SW, ps_addr=PS)   # binds a UDP socket
    addrs = allgather(job.address)                                          # over the normal channel
    if r == 0:                                                              # configure switch + PS once
        svc = InnetService.launch(job_id=1, worker_addrs=addrs, switch_port=SW[1], ps_port=PS[1])
    barrier()
    total = job.allreduce(grad)                                             # float32 sum over the job

``InnetCluster`` does all of this inside one process (threads), for tests and demos.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, cast
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .control import SwitchControl
from .ps import PSJobConfig, PSThread
from .quantize import error_bound
from .switch_server import SwitchThread, apply_config
from .transport import LossConfig
from .wire import DEFAULT_VALUE_COUNT
from .worker import AtpWorker, WorkerStats

__all__ = ["InnetJob", "JobSpec", "InnetCluster", "InnetService", "switch_config", "innet_allreduce",
           "free_udp_port", "DEFAULT_SCALE"]

log = logging.getLogger(__name__)

DEFAULT_SCALE = 2.0**20
PS_PORT = 1_000_000          # switch port number of the PS; worker ports are job_id * 1000 + rank + 1


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A UDP port that was free a moment ago (for a switch or PS subprocess that needs a fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class InnetJob:
    """One rank's handle on an in-network allreduce job: ``allreduce(array) -> array`` (float32).

    All ranks must call ``allreduce`` in the same order with arrays of the same size. The result equals
    the exact sum within ``error_bound`` (see ``innet.quantize``); ``op="mean"`` divides by ``world``.
    """

    def __init__(self, job_id: int, rank: int, world: int, switch_addr: tuple[str, int] | None,
                 ps_addr: tuple[str, int], *, value_count: int = DEFAULT_VALUE_COUNT,
                 num_aggregators: int = 4096, scale: float = DEFAULT_SCALE, rack_size: int | None = None,
                 max_window: int = 128, loss: LossConfig | None = None, **worker_options: Any) -> None:
        self.worker = AtpWorker(job_id, rank, world, switch_addr, ps_addr, value_count=value_count,
                                num_aggregators=num_aggregators, scale=scale, rack_size=rack_size,
                                max_window=max_window, loss=loss, **worker_options)
        self.job_id, self.rank, self.world = job_id, rank, world
        self.scale = scale

    @property
    def address(self) -> tuple[str, int]:
        """This rank's UDP address (the switch maps a port to it)."""
        return self.worker.address

    @property
    def direct_address(self) -> tuple[str, int]:
        """The UDP address this rank sends from when it bypasses the switch (the PS registers it)."""
        return self.worker.direct_address

    @property
    def last_stats(self) -> WorkerStats | None:
        """Statistics of the last call (window, retransmits, fallback...)."""
        return self.worker.last_stats

    def allreduce(self, array: np.ndarray, op: str = "sum", *, timeout: float | None = None,
                  abort: Callable[[], None] | None = None) -> np.ndarray:
        """Reduce ``array`` elementwise over all ranks of the job; float32 out (float64 input is
        quantized from float64, other numbers as float32)."""
        if op not in ("sum", "mean"):
            raise ValueError(f"innet allreduce supports op='sum' or 'mean', got {op!r}")
        arr = np.asarray(array)
        if arr.dtype not in (np.float32, np.float64):   # float64 is quantized as is (innet.quantize)
            if not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
                raise TypeError(f"innet allreduce needs a real numeric array, got dtype {arr.dtype}")
            arr = arr.astype(np.float32)
        out, _ = self.worker.allreduce_sum(arr, timeout=timeout, abort=abort)
        if op == "mean":
            out = (out.astype(np.float64) / self.world).astype(np.float32)
        return out

    def error_bound(self, reference: np.ndarray) -> np.ndarray:
        """The documented per-element error bound of a result whose exact value is ``reference``."""
        return error_bound(reference, self.scale, self.world)

    def close(self) -> None:
        self.worker.close()

    def __enter__(self) -> InnetJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def innet_allreduce(job: InnetJob, array: np.ndarray, op: str = "sum") -> np.ndarray:
    """Functional form of ``job.allreduce(array, op)``."""
    return job.allreduce(array, op)


def switch_config(job_id: int, worker_addrs: Sequence[tuple[str, int]], ps_addr: tuple[str, int],
                  *, ecn_threshold: int | None = None) -> dict:
    """The single-switch config dict (ports, group, job) of a job whose workers all sit on one ToR."""
    world = len(worker_addrs)
    ports = {str(job_id * 1000 + r + 1): [a[0], int(a[1])] for r, a in enumerate(worker_addrs)}
    ports[str(PS_PORT)] = [ps_addr[0], int(ps_addr[1])]
    cfg: dict = {"ports": ports,
                 "groups": [{"group_id": job_id, "ports": [job_id * 1000 + r + 1 for r in range(world)]}],
                 "jobs": [{"job_id": job_id, "fan_in": world, "ps_port": PS_PORT, "mcast_group": job_id,
                           "level": 0}],
                 "members": [[job_id, job_id * 1000 + r + 1] for r in range(world)]}
    if ecn_threshold is not None:
        cfg["ecn_threshold"] = ecn_threshold
    return cfg


def _merge_configs(configs: Sequence[Mapping[str, Any]]) -> dict:
    out: dict = {"ports": {}, "groups": [], "jobs": [], "members": []}
    for c in configs:
        out["ports"].update(c.get("ports", {}))
        out["groups"].extend(c.get("groups", ()))
        out["jobs"].extend(c.get("jobs", ()))
        out["members"].extend(c.get("members", ()))
        if "ecn_threshold" in c:
            out["ecn_threshold"] = c["ecn_threshold"]
    return out


def helper_env() -> dict[str, str]:
    """The environment of a helper process (switch, PS): ours without any ``TWISTERNET_*`` variable
    (the job token, the master's address: a helper needs none of them), with this package importable."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TWISTERNET_")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start_cli(module: str, args: Sequence[str], timeout: float = 20.0, secret: str | None = None
               ) -> tuple[subprocess.Popen, tuple[str, int]]:
    """Start ``module.main(args)`` as a helper tied to this process (``innet.lifeline``): it gets a
    fresh interpreter (exec, never a fork of this possibly gRPC-using process), a scrubbed environment,
    ``secret`` as the first line of its stdin, and exits when this process dies."""
    # "-c" rather than "-m": the package __init__ already imports the module, which makes runpy warn
    code = f"import sys; from {module} import main; sys.exit(main(sys.argv[1:]))"
    lifeline = ["--lifeline", "--parent-pid", str(os.getpid())]
    if threading.current_thread() is threading.main_thread():
        lifeline.append("--parent-death-signal")   # PDEATHSIG follows the forking thread
    # Popen with these arguments (no preexec_fn, cwd, new session or close_fds; our descriptors are
    # non-inheritable anyway, PEP 446) uses posix_spawn: no fork, so no fork handlers of a gRPC this
    # process may have loaded run in the child (they abort it when gRPC threads are busy)
    proc = subprocess.Popen([sys.executable, "-c", code, *args, *lifeline], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=None, env=helper_env(), text=True,
                            close_fds=False)
    if secret is not None and proc.stdin is not None:
        proc.stdin.write(secret + "\n")
        proc.stdin.flush()
    line = _readline(proc, timeout)
    if line is None or "listening on udp" not in line:
        stop_process(proc)
        raise RuntimeError(f"{module} did not start: {line!r} (exit code {proc.poll()})")
    host, port = line.rsplit(" ", 1)[1].strip().rsplit(":", 1)
    return proc, (host, int(port))


def _readline(proc: subprocess.Popen, timeout: float) -> str | None:
    """The next line of a child's stdout, or None if none came within ``timeout`` seconds."""
    holder: list[str] = []
    out = cast(IO[str], proc.stdout)   # started with stdout=PIPE, text=True
    t = threading.Thread(target=lambda: holder.append(out.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return holder[0] if holder else None


def stop_process(proc: subprocess.Popen) -> None:
    """Terminate a helper process (kill it if it lingers 5 s) and close its pipes."""
    if proc.stdin:
        try:
            proc.stdin.close()           # the lifeline: the helper stops on its own at EOF
        except OSError:
            pass
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stdout:
        proc.stdout.close()


def start_ps(job_id: int, world: int, switch_addr: tuple[str, int], *, host: str = "127.0.0.1", port: int = 0,
             value_count: int = DEFAULT_VALUE_COUNT, scale: float = DEFAULT_SCALE,
             keep: int = 4096, workers: Sequence[tuple[str, int]] = (), core: str | None = None
             ) -> tuple[subprocess.Popen, tuple[str, int]]:
    """Start a parameter server for one job as a subprocess; returns it and its UDP address.

    ``workers[r]`` is rank r's direct address (``InnetJob.direct_address``): without it the PS accepts
    the job's packets from the switch only (no fallback). ``core``: its packet path (``auto``, ``c``,
    ``python``; the job's ``innet_ps_core``); None: ``auto`` (a helper's environment carries no
    ``TWISTERNET_*`` setting)."""
    cfg = {"jobs": [{"job_id": job_id, "world": world, "scale": scale,
                     "switch": [switch_addr[0], int(switch_addr[1])], "keep": keep,
                     "workers": [[a[0], int(a[1])] for a in workers]}]}
    return _start_cli("innet.ps", ["--host", host, "--port", str(port), "--values", str(value_count),
                                   "--config", json.dumps(cfg), *(["--core", core] if core else [])])


@dataclass
class SwitchProcess:
    """A shared software switch running as a subprocess, with its P4Runtime server (``start_switch``)."""

    proc: subprocess.Popen
    udp_addr: tuple[str, int]
    p4runtime_addr: tuple[str, int]

    def close(self) -> None:
        stop_process(self.proc)


def start_switch(host: str = "127.0.0.1", *, port: int = 0, p4runtime_port: int = 0,
                 num_aggregators: int = 4096, value_count: int = DEFAULT_VALUE_COUNT,
                 timeout: float = 20.0, p4runtime_token: str | None = None) -> SwitchProcess:
    """Start an empty switch (no jobs) whose P4Runtime server lets controllers add them
    (``innet.controller.P4RuntimeController``); what ``twisternet run --innet`` runs beside a job.

    ``p4runtime_token`` (``innet.p4runtime.auth.p4runtime_token`` of the job token) must then come with
    every P4Runtime call; it reaches the switch through its stdin, never its command line or environment.
    None serves P4Runtime without authentication."""
    auth = ["--p4runtime-token-file", "-"] if p4runtime_token is not None else ["--p4runtime-insecure"]
    proc, udp = _start_cli("innet.switch_server", ["--host", host, "--port", str(port), "--aggregators",
                                                   str(num_aggregators), "--values", str(value_count),
                                                   "--p4runtime-port", str(p4runtime_port), *auth], timeout,
                           secret=p4runtime_token)
    line = _readline(proc, timeout)
    if line is None or not line.startswith("p4runtime on "):
        proc.kill()
        raise RuntimeError(f"the switch's P4Runtime server did not start: {line!r}")
    g_host, g_port = line.split(" ", 2)[2].strip().rsplit(":", 1)
    return SwitchProcess(proc, udp, (g_host, int(g_port)))


@dataclass
class InnetService:
    """A switch and a PS running as subprocesses (``innet.switch_server.main`` / ``innet.ps.main``)."""

    switch_proc: subprocess.Popen
    ps_proc: subprocess.Popen
    switch_addr: tuple[str, int]
    ps_addr: tuple[str, int]

    @classmethod
    def launch(cls, job_id: int, worker_addrs: Sequence[tuple[str, int]], *, switch_port: int,
               ps_port: int, host: str = "127.0.0.1", value_count: int = DEFAULT_VALUE_COUNT,
               num_aggregators: int = 4096, scale: float = DEFAULT_SCALE, keep: int = 4096,
               p4runtime_port: int | None = None, p4runtime_token: str | None = None,
               direct_addrs: Sequence[tuple[str, int]] = (), ecn_threshold: int | None = None,
               dataplane: str | None = None, ps_core: str | None = None) -> InnetService:
        """Start PS and switch subprocesses for one single-rack job on fixed ports (see ``free_udp_port``).

        ``worker_addrs`` are the ranks' switch-facing addresses (``InnetJob.address``), ``direct_addrs``
        their PS-facing ones (``InnetJob.direct_address``; empty: no fallback to the PS). ``dataplane``
        and ``ps_core`` (``auto``, ``c``, ``python``; the job's ``innet_dataplane`` and ``innet_ps_core``)
        pick the switch's dataplane and the PS's packet path; None: ``auto``."""
        ps_proc, ps_addr = start_ps(job_id, len(worker_addrs), (host, switch_port), host=host, port=ps_port,
                                    value_count=value_count, scale=scale, keep=keep, workers=direct_addrs,
                                    core=ps_core)
        sw_args = ["--host", host, "--port", str(switch_port), "--aggregators", str(num_aggregators),
                   "--values", str(value_count), *(["--dataplane", dataplane] if dataplane else []),
                   *(["--ecn-threshold", str(ecn_threshold)] if ecn_threshold is not None else []),
                   "--config", json.dumps(switch_config(job_id, worker_addrs, ps_addr))]
        if p4runtime_port is not None:
            sw_args += ["--p4runtime-port", str(p4runtime_port)]
            sw_args += (["--p4runtime-token-file", "-"] if p4runtime_token is not None
                        else ["--p4runtime-insecure"])
        try:
            sw_proc, sw_addr = _start_cli("innet.switch_server", sw_args, secret=p4runtime_token)
        except Exception:
            stop_process(ps_proc)
            raise
        return cls(sw_proc, ps_proc, sw_addr, ps_addr)

    def kill_switch(self) -> None:
        """Kill the switch process (fate-sharing tests)."""
        self.switch_proc.kill()
        self.switch_proc.wait(10)

    def close(self) -> None:
        for p in (self.switch_proc, self.ps_proc):
            stop_process(p)


@dataclass(frozen=True)
class JobSpec:
    """A job of an ``InnetCluster``: id, number of workers, quantization scale, worker options."""

    job_id: int
    world: int
    scale: float = DEFAULT_SCALE
    max_window: int = 128
    options: tuple[tuple[str, Any], ...] = ()


class InnetCluster:
    """An in-process switch (thread) + PS (thread) + every job's workers, configured and ready.

    ``cluster.allreduce(job_id, arrays)`` runs one allreduce with one thread per rank and returns the
    per-rank results. ``switch_loss`` / ``ps_loss`` / ``worker_loss`` inject packet loss.
    """

    def __init__(self, jobs: Sequence[JobSpec], *, num_aggregators: int = 4096,
                 value_count: int = DEFAULT_VALUE_COUNT, loss: LossConfig | None = None,
                 ecn_threshold: int = 64, stale_timeout: float = 2.0, line_rate: float | None = None,
                 queue_limit: int = 4096) -> None:
        self.value_count = value_count
        self.num_aggregators = num_aggregators
        ps_loss = sw_loss = None
        if loss is not None:
            ps_loss = LossConfig(0, 0, loss.parameter, loss.seed + 1)
            sw_loss = LossConfig(0, loss.aggregate, loss.parameter, loss.seed + 2)
        self.ps = PSThread(value_count=value_count, loss=ps_loss).start()
        self.switch = SwitchThread(num_aggregators, value_count, loss=sw_loss, ecn_threshold=ecn_threshold,
                                   stale_timeout=stale_timeout, line_rate=line_rate,
                                   queue_limit=queue_limit).start()
        self.jobs: dict[int, list[InnetJob]] = {}
        self.specs = {s.job_id: s for s in jobs}
        configs = []
        for spec in jobs:
            wl = LossConfig(loss.gradient, 0, 0, loss.seed + 100 * spec.job_id) if loss else None
            handles = [InnetJob(spec.job_id, r, spec.world, self.switch.address, self.ps.address,
                                value_count=value_count, num_aggregators=num_aggregators, scale=spec.scale,
                                max_window=spec.max_window, loss=wl, **dict(spec.options))
                       for r in range(spec.world)]
            self.jobs[spec.job_id] = handles
            configs.append(switch_config(spec.job_id, [h.address for h in handles], self.ps.address))
            self.ps.server.add_job(PSJobConfig(spec.job_id, spec.world, spec.scale, self.switch.address,
                                               keep=max(4096, 4 * spec.max_window),
                                               workers=tuple(h.direct_address for h in handles)))
        apply_config(self.switch.switch, _merge_configs(configs))

    @property
    def control(self) -> SwitchControl:
        """The switch's control API."""
        return self.switch.switch

    def kill_switch(self) -> None:
        """Stop the switch thread and close its socket, as if the switch died."""
        self.switch.stop()

    def allreduce(self, job_id: int, arrays: Sequence[np.ndarray], op: str = "sum",
                  timeout: float = 120.0) -> list[np.ndarray]:
        """Run ``allreduce`` on every rank of ``job_id`` concurrently; re-raises a rank's error."""
        handles = self.jobs[job_id]
        if len(arrays) != len(handles):
            raise ValueError(f"job {job_id} has {len(handles)} ranks, got {len(arrays)} arrays")
        results: list[Any] = [None] * len(handles)

        def run(r: int) -> None:
            try:
                results[r] = handles[r].allreduce(arrays[r], op)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                results[r] = e

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(handles))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"innet allreduce of job {job_id} did not finish in {timeout} s")
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    def close(self) -> None:
        self.switch.stop()
        self.ps.stop()
        for hs in self.jobs.values():
            for h in hs:
                h.close()

    def __enter__(self) -> InnetCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
