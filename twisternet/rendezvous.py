"""Rendezvous under cluster launchers that start no twisternet master: torchrun, Slurm, Kubernetes.

Each of these launchers tells every process its rank, the world and where rank 0 runs
(:mod:`twisternet.launch_env`). Rank 0 then hosts the bootstrap master in a thread of its own process,
and every rank, rank 0 included, joins it over TCP exactly as under ``twisternet run``.

The job token, which every connection must prove it holds, comes from (first that applies):

1. ``TWISTERNET_TOKEN`` (or ``tn.init(token=...)``);
2. ``TWISTERNET_TOKEN_FILE``: a file holding the token, readable by its owner only;
3. ``TWISTERNET_TOKEN_DIR``: a directory every rank sees (a shared file system, a Kubernetes volume);
   rank 0 writes a fresh token to ``twisternet-<job id>.token`` there (mode 0600, atomically), the
   others wait for it. Rank 0 removes it when the job ends.

Without any of them, :func:`resolve_token` raises an error that says how to give one.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any, cast
from collections.abc import Callable, Mapping

from .config import Config
from .errors import AuthError, TwisternetError
from .launch_env import LaunchInfo
from .tokens import HOW_TO_MAKE_ONE, check_token, check_token_file, new_token

log = logging.getLogger(__name__)

#: Launchers whose rank 0 hosts the bootstrap master.
HOSTED = ("torchrun", "slurm", "kubernetes")
#: Seconds between looks for the token file rank 0 writes into TWISTERNET_TOKEN_DIR.
_TOKEN_POLL = 0.05

_HOW = ("give every rank the job token: set TWISTERNET_TOKEN to the same secret on every rank before "
        "the launcher starts, or TWISTERNET_TOKEN_FILE to a file holding it, or TWISTERNET_TOKEN_DIR to a "
        f"directory all ranks share, where rank 0 writes a fresh one ({HOW_TO_MAKE_ONE})")


def _read_token_file(path: Path) -> str:
    try:
        check_token_file(path)
        token = path.read_text().strip()
    except OSError as e:
        raise AuthError(f"cannot read the token file {path}: {e}") from None
    return check_token(token, f"token file {path}")


def _job_file(directory: Path, info: LaunchInfo) -> Path:
    job = info.job_id or (f"{info.master[0]}-{info.master[1]}" if info.master else "job")
    return directory / f"twisternet-{re.sub(r'[^A-Za-z0-9_.-]', '_', job)}.token"


def _write_token_dir(path: Path) -> str:
    token = new_token()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)          # atomic: readers see no file or the whole token
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return token


def _wait_token_dir(path: Path, deadline: float) -> str:
    while True:
        if path.exists():
            return _read_token_file(path)
        if time.monotonic() >= deadline:
            raise AuthError(f"rank 0 did not write the job token to {path} (TWISTERNET_TOKEN_DIR) in time: "
                            "is the directory shared by every host, and did rank 0 start?")
        time.sleep(_TOKEN_POLL)


def resolve_token(cfg: Config, info: LaunchInfo, environ: Mapping[str, str] | None = None) -> tuple[str, Path | None]:
    """The job token and, on rank 0 with ``TWISTERNET_TOKEN_DIR``, the file it wrote (to remove at the end)."""
    env = os.environ if environ is None else environ
    if cfg.token:
        return cfg.token, None
    if env.get("TWISTERNET_TOKEN_FILE"):
        return _read_token_file(Path(env["TWISTERNET_TOKEN_FILE"])), None
    if env.get("TWISTERNET_TOKEN_DIR"):
        directory = Path(env["TWISTERNET_TOKEN_DIR"])
        if not directory.is_dir():
            raise AuthError(f"TWISTERNET_TOKEN_DIR={directory} is not a directory")
        path = _job_file(directory, info)
        if info.rank == 0:
            return _write_token_dir(path), path
        return _wait_token_dir(path, time.monotonic() + cfg.connect_timeout), None
    raise AuthError(f"{info.launcher} started this job (rank {info.rank} of {info.world}) but no job token "
                    f"was given: {_HOW}")


def _bind_host(host: str) -> str:
    """The local address rank 0's master binds: the one ``host`` (the launcher's name for rank 0's
    host) resolves to, if this machine has it; else every interface."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return "0.0.0.0"
    for *_, sockaddr in infos:
        addr = cast(str, sockaddr[0])   # AF_INET: (host, port)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((addr, 0))
            return addr
        except OSError:
            continue
    return "0.0.0.0"


def _open_store(info: LaunchInfo, timeout: float) -> Any:
    """A client of torch elastic's agent store (None if torch cannot be imported)."""
    assert info.store is not None
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore
    except ImportError:
        log.warning("torchrun's agent store is there but torch cannot be imported: the bootstrap master "
                    "falls back to MASTER_PORT + 1")
        return None
    host, port = info.store
    try:
        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/DistStoreError; say what it was
        raise TwisternetError(f"rank {info.rank}: cannot reach torchrun's agent store at {host}:{port} "
                              f"({e}); set TWISTERNET_MASTER_PORT to a free port, the same on every rank") from None


def _published_port(store: Any, info: LaunchInfo, timeout: float) -> int:
    """The bootstrap port rank 0 published in the agent store (waits up to ``timeout``)."""
    assert info.store is not None
    try:
        raw = store.get(info.store_key)
    except Exception as e:  # noqa: BLE001 - a store timeout: rank 0 never published
        raise TwisternetError(f"rank {info.rank}: rank 0 did not publish the bootstrap port in torchrun's "
                              f"agent store at {info.store[0]}:{info.store[1]} within {timeout:g} s ({e}); "
                              "is rank 0 running twisternet too?") from None
    try:
        port = int(raw)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise TwisternetError(f"rank {info.rank}: torchrun's agent store holds {raw!r} under "
                              f"{info.store_key}, not a port")
    return port


def prepare(cfg: Config, info: LaunchInfo) -> tuple[Config, Callable[[], None] | None]:
    """Config for joining a job ``info`` describes, starting the master on rank 0.

    Returns the config to build the TCP channel with (master, rank, world, token set) and a function to
    call when this process's Context has closed (rank 0: let the master see everyone leave, then stop it;
    remove the token file it wrote), or None.
    """
    if info.launcher not in HOSTED:
        return cfg, None
    assert info.master is not None and info.rank is not None and info.world is not None
    if cfg.channel not in ("auto", "tcp"):
        raise TwisternetError(f"{info.launcher} started this job as {info.world} processes, which twisternet "
                              f"joins over TCP; channel={cfg.channel!r} cannot (use channel='auto' or 'tcp', "
                              "or start the job with mpiexec for the MPI channel)")
    token, token_path = resolve_token(cfg, info)
    host, port = info.master
    store = _open_store(info, cfg.connect_timeout) if info.store is not None else None
    if store is None and port == 0:
        # torch is not importable after all: the documented fallback, the same on every rank
        assert info.store is not None
        port = info.store[1] + 1
    master: Any = None
    if info.hosts_master:
        from .bootstrap import Master, install_job_services
        try:
            master = Master(info.world, token.encode(), _bind_host(host), port,
                            handshake_timeout=cfg.handshake_timeout, peer_timeout=cfg.peer_timeout,
                            heartbeat_interval=cfg.heartbeat_interval, join_timeout=cfg.connect_timeout)
        except OSError as e:
            raise TwisternetError(f"rank 0 could not open the bootstrap master on port {port} ({e}); set "
                                  "TWISTERNET_MASTER_PORT to a free port, the same on every rank") from None
        install_job_services(master)
        master.start()
        log.info("rank 0 hosts the bootstrap master on %s:%d for %d ranks (%s)", *master.address, info.world,
                 info.launcher)
        port = master.address[1]
        if store is not None:
            store.set(info.store_key, str(port))
    elif store is not None:
        port = _published_port(store, info, cfg.connect_timeout)
    joined = cfg.replace(channel="tcp", master=f"{host}:{port}", rank=info.rank, world=info.world, token=token)

    def finish() -> None:
        if master is not None and master.wait(cfg.peer_timeout) is None:
            master.stop()
        if token_path is not None:
            token_path.unlink(missing_ok=True)

    return joined, finish if (master is not None or token_path is not None) else None
