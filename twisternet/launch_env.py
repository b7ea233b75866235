"""Which launcher started this process, read from its environment alone.

One function, :func:`detect`, turns the variables a launcher sets into a :class:`LaunchInfo`: the
launcher's name, this process's rank, the world size, the local rank and local world (ranks on this
host), the address of the bootstrap master every rank joins, and the job id the launcher gives. Nothing
here opens a socket or imports mpi4py: :func:`twisternet.init` decides from the result how to join.

Launchers, in the order they are recognised (the first that matches wins):

==============  ===========================================================================================
``twisternet``  ``twisternet run`` / ``twisternet worker``: ``TWISTERNET_MASTER`` (the master is already up)
``mpi``         ``mpirun``/``mpiexec``/``srun --mpi=pmi2|pmix``: PMI/PMIx/Open MPI/MVAPICH rank variables
``torchrun``    torch elastic's env:// contract: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
                (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID`` when torchrun sets them)
``slurm``       a job step started by ``srun`` without MPI: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``
                (else ``SLURM_NTASKS``), ``SLURM_LOCALID``, the first host of ``SLURM_STEP_NODELIST``
                (else ``SLURM_JOB_NODELIST``) as master, in Slurm's ``node[01-04,07]`` syntax
``kubernetes``  an indexed Job: ``JOB_COMPLETION_INDEX`` as the rank, ``TWISTERNET_WORLD`` as the world,
                the pod of index 0 as master: ``<job>-0.<service>`` where ``<job>`` is the pod's hostname
                without its index suffix and ``<service>`` is ``TWISTERNET_K8S_SERVICE`` (a headless
                Service whose name is the Job's ``subdomain``)
``none``        nothing of the above: a one-process job
==============  ===========================================================================================

The bootstrap master's port: ``TWISTERNET_MASTER_PORT`` when set. Otherwise, under torchrun, a free
port rank 0 picks and publishes in the torch elastic agent's store at ``MASTER_ADDR:MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE=True``, what torchrun sets), so no fixed port can be taken already; without
the agent's store, ``MASTER_PORT + 1`` (``MASTER_PORT`` itself belongs to torch's TCPStore, which a program
that also calls ``torch.distributed.init_process_group`` opens there); under Slurm ``20000 + SLURM_JOB_ID % 20000``, so
that two jobs sharing a first node do not collide; under Kubernetes :data:`DEFAULT_PORT`.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from collections.abc import Mapping

from .errors import LaunchEnvError

#: Port of the bootstrap master under Kubernetes when ``TWISTERNET_MASTER_PORT`` does not say.
DEFAULT_PORT = 29400

#: Variables an MPI launcher sets (rank / size / others); ``HYDRA_*`` are left out on purpose: users set
#: them in shell profiles to configure mpiexec, outside any job.
MPI_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
MPI_OTHER_VARS = ("PMI_FD", "PMI_PORT", "PMIX_NAMESPACE", "HYDI_CONTROL_FD", "MPI_LOCALRANKID")
#: Slurm's value of SLURM_STEP_ID in the batch script itself (SLURM_BATCH_SCRIPT), which is not a step of
#: tasks: a program run there directly is one process, whatever --ntasks says.
_SLURM_BATCH_STEPS = ("4294967294", "batch")


@dataclass(frozen=True)
class LaunchInfo:
    """What the environment says about this process's place in a job."""

    #: ``twisternet``, ``mpi``, ``torchrun``, ``slurm``, ``kubernetes`` or ``none``.
    launcher: str
    rank: int | None = None
    world: int | None = None
    #: Rank among the processes on this host, and how many there are (None when the launcher does not say).
    local_rank: int | None = None
    local_world: int | None = None
    #: The bootstrap master to join (HOST, PORT); for ``mpi`` and ``none`` there is none.
    master: tuple[str, int] | None = None
    #: An id of this job run given by the launcher (Slurm job id, torchrun run id, Kubernetes job name).
    job_id: str | None = None
    #: torch elastic's agent store (HOST, PORT): rank 0 publishes the master's port there (``master``'s
    #: port is then 0 until it does), under the key :attr:`store_key`.
    store: tuple[str, int] | None = None
    store_key: str = ""

    @property
    def hosts_master(self) -> bool:
        """Whether this process must host the bootstrap master (rank 0 of a launcher without one)."""
        return self.launcher in ("torchrun", "slurm", "kubernetes") and self.rank == 0


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    raw = env.get(name, "")
    try:
        value = int(raw)
    except ValueError:
        raise LaunchEnvError(name, f"must be an integer (set by the launcher), got {raw!r}") from None
    if value < minimum:
        raise LaunchEnvError(name, f"must be >= {minimum}, got {value}")
    return value


def _opt_int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int | None:
    return _int(env, name, minimum=minimum) if env.get(name) else None


def _port(env: Mapping[str, str], default: int) -> int:
    port = _opt_int(env, "TWISTERNET_MASTER_PORT", minimum=1)
    port = default if port is None else port
    if not 0 < port < 65536:
        raise LaunchEnvError("TWISTERNET_MASTER_PORT", f"must be a TCP port (1-65535), got {port}")
    return port


def _check_rank(launcher: str, rank: int, world: int, rank_var: str) -> None:
    if rank >= world:
        raise LaunchEnvError(rank_var, f"{launcher} says rank {rank} but a world of {world} (rank must be < world)")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compact host list: ``"node[01-03,07],gpu1"`` -> node01 node02 node03 node07 gpu1.

    Ranges keep their zero padding; several bracket groups in one name expand as a product
    (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2), as Slurm's hostlist does.
    """
    hosts: list[str] = []
    for item in _split_top(nodelist.strip()):
        if item:
            hosts.extend(_expand_one(item))
    if not hosts:
        raise LaunchEnvError("SLURM_JOB_NODELIST", f"names no host: {nodelist!r}")
    return hosts


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchEnvError("SLURM_JOB_NODELIST", f"unbalanced ']' in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise LaunchEnvError("SLURM_JOB_NODELIST", f"unbalanced '[' in {text!r}")
    parts.append(text[start:])
    return parts


_BRACKET = re.compile(r"\[([^\]]*)\]")


def _expand_one(name: str) -> list[str]:
    m = _BRACKET.search(name)
    if m is None:
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    out: list[str] = []
    for piece in m.group(1).split(","):
        piece = piece.strip()
        if "-" in piece:
            lo, hi = piece.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise LaunchEnvError("SLURM_JOB_NODELIST", f"bad range {piece!r} in {name!r}")
            width = len(lo)
            numbers = [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        elif piece.isdigit():
            numbers = [piece]
        else:
            raise LaunchEnvError("SLURM_JOB_NODELIST", f"bad host number {piece!r} in {name!r}")
        for number in numbers:
            out.extend(_expand_one(head + number + tail))
    return out


def under_mpi_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI launcher (hydra/PMI, PMIx, Open MPI, MVAPICH) started this process; never imports
    mpi4py, which would initialise MPI."""
    env = os.environ if environ is None else environ
    return any(env.get(v) for v in (*MPI_RANK_VARS, *MPI_SIZE_VARS, *MPI_OTHER_VARS))


def mpi_launch_info(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(rank, world)`` as the MPI launcher's environment announces them, or None if it does not say."""
    env = os.environ if environ is None else environ
    rank = next((env[v] for v in MPI_RANK_VARS if env.get(v)), None)
    size = next((env[v] for v in MPI_SIZE_VARS[:3] if env.get(v)), None)
    if rank is None or size is None or not (rank.isdigit() and size.isdigit()):
        return None
    return int(rank), int(size)


def _mpi(env: Mapping[str, str]) -> LaunchInfo | None:
    if not under_mpi_launcher(env):
        return None
    rank = next((v for v in MPI_RANK_VARS if env.get(v)), None)
    size = next((v for v in MPI_SIZE_VARS[:3] if env.get(v)), None)
    local = next((v for v in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")
                  if env.get(v)), None)
    local_n = next((v for v in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
                    if env.get(v)), None)
    return LaunchInfo("mpi",
                      rank=_int(env, rank) if rank else None,
                      world=_int(env, size, minimum=1) if size else None,
                      local_rank=_int(env, local) if local else None,
                      local_world=_int(env, local_n, minimum=1) if local_n else None)


def _torchrun(env: Mapping[str, str]) -> LaunchInfo | None:
    if not (env.get("RANK") and env.get("WORLD_SIZE")):
        return None
    if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
        raise LaunchEnvError(missing[0], "RANK and WORLD_SIZE are set (torch's env:// contract) but "
                          f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: start the "
                          "job with torchrun, or set MASTER_ADDR and MASTER_PORT to rank 0's host and port")
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE", minimum=1)
    _check_rank("torchrun", rank, world, "RANK")
    store_port = _int(env, "MASTER_PORT", minimum=1)
    run_id = env.get("TORCHELASTIC_RUN_ID") or None
    published = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not env.get("TWISTERNET_MASTER_PORT")
    return LaunchInfo("torchrun", rank=rank, world=world,
                      local_rank=_opt_int(env, "LOCAL_RANK"),
                      local_world=_opt_int(env, "LOCAL_WORLD_SIZE", minimum=1),
                      master=(env["MASTER_ADDR"], 0 if published else _port(env, store_port + 1)),
                      job_id=run_id,
                      store=(env["MASTER_ADDR"], store_port) if published else None,
                      store_key=(f"twisternet/{run_id or 'job'}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
                                 "/master_port") if published else "")


def _slurm(env: Mapping[str, str]) -> LaunchInfo | None:
    if not env.get("SLURM_PROCID"):
        return None
    in_step = bool(env.get("SLURM_STEP_NUM_TASKS")) and env.get("SLURM_STEP_ID") not in _SLURM_BATCH_STEPS
    if not in_step:
        ntasks = _opt_int(env, "SLURM_NTASKS", minimum=1) or 1
        if ntasks > 1:
            raise LaunchEnvError("SLURM_NTASKS", f"this Slurm allocation has {ntasks} tasks, but this process is "
                              "the batch script itself, not one of them: start the program with "
                              f"`srun python job.py` (it then runs as {ntasks} ranks)")
        return None
    world = _int(env, "SLURM_STEP_NUM_TASKS", minimum=1)
    rank = _int(env, "SLURM_PROCID")
    _check_rank("Slurm", rank, world, "SLURM_PROCID")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchEnvError("SLURM_JOB_NODELIST", "srun set SLURM_PROCID but no node list: cannot tell where "
                          "rank 0 (the bootstrap master) runs; set TWISTERNET_MASTER=HOST:PORT")
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    default_port = 20000 + (int(job_id) % 20000 if job_id and job_id.isdigit() else 0)
    local_world = None
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node_id = _opt_int(env, "SLURM_NODEID")
    if tasks_per_node and node_id is not None:
        counts = _expand_counts(tasks_per_node)
        if node_id < len(counts):
            local_world = counts[node_id]
    return LaunchInfo("slurm", rank=rank, world=world, local_rank=_opt_int(env, "SLURM_LOCALID"),
                      local_world=local_world, master=(expand_nodelist(nodelist)[0], _port(env, default_port)),
                      job_id=job_id)


def _expand_counts(spec: str) -> list[int]:
    """Slurm's tasks-per-node list: ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return []
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def _kubernetes(env: Mapping[str, str]) -> LaunchInfo | None:
    if not env.get("JOB_COMPLETION_INDEX"):
        return None
    rank = _int(env, "JOB_COMPLETION_INDEX")
    if not env.get("TWISTERNET_WORLD"):
        raise LaunchEnvError("TWISTERNET_WORLD", "this is a pod of a Kubernetes indexed Job (JOB_COMPLETION_INDEX "
                          f"={rank}) but the job's size is unknown: set TWISTERNET_WORLD to the Job's "
                          "completions in the pod template")
    world = _int(env, "TWISTERNET_WORLD", minimum=1)
    _check_rank("Kubernetes", rank, world, "JOB_COMPLETION_INDEX")
    service = env.get("TWISTERNET_K8S_SERVICE")
    if not service:
        raise LaunchEnvError("TWISTERNET_K8S_SERVICE", "set it to the headless Service that the Job's pods use "
                          "as subdomain, so that rank 0 is reachable as <job>-0.<service>")
    hostname = env.get("HOSTNAME") or socket.gethostname()
    suffix = f"-{rank}"
    if not hostname.endswith(suffix):
        raise LaunchEnvError("HOSTNAME", f"pod hostname {hostname!r} does not end in -{rank} "
                          "(JOB_COMPLETION_INDEX): is the Job's completionMode Indexed?")
    job = hostname[: -len(suffix)]
    return LaunchInfo("kubernetes", rank=rank, world=world, master=(f"{job}-0.{service}", _port(env, DEFAULT_PORT)),
                      job_id=job)


def detect(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """The launcher this process runs under (see the module docstring for the order and the variables).

    Raises :class:`~twisternet.errors.LaunchEnvError` naming the variable when a launcher's variables are
    incomplete or contradict each other, rather than falling back to a one-process job.
    """
    env = os.environ if environ is None else environ
    master = env.get("TWISTERNET_MASTER")
    if master:
        return LaunchInfo("twisternet", rank=_opt_int(env, "TWISTERNET_RANK"),
                          world=_opt_int(env, "TWISTERNET_WORLD", minimum=1))
    for probe in (_mpi, _torchrun, _slurm, _kubernetes):
        info = probe(env)
        if info is not None:
            return info
    return LaunchInfo("none")


def announced_world(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """``(variable, n)`` for the first launcher variable of the environment that announces a world of n > 1.

    :func:`twisternet.init` checks this against the world it ends up in: a job that would silently run as
    one process while its launcher started several is an error.
    """
    env = os.environ if environ is None else environ
    for var in ("TWISTERNET_WORLD", *MPI_SIZE_VARS[:3], "WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        raw = env.get(var, "")
        if raw.isdigit() and int(raw) > 1:
            return var, int(raw)
    return None
