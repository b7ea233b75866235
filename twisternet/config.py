"""Configuration: one frozen dataclass, layered defaults < TOML file < TWISTERNET_* env < keyword args.

Unknown keys and invalid values raise :class:`ConfigError` naming the key, at whichever layer they appear.
Sizes accept plain integers or strings with a unit (``"4MiB"``, ``"1GB"``, ``"512k"``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from .errors import ConfigError
from .procfs import runnable_elsewhere

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

ENV_PREFIX = "TWISTERNET_"
#: Environment variable naming a TOML file to read (not itself a config key).
ENV_CONFIG_FILE = "TWISTERNET_CONFIG"
#: ``TWISTERNET_*`` variables that are not configuration keys: how a job was launched (read by
#: :mod:`twisternet.launch_env` and :mod:`twisternet.rendezvous`), where tools find their inputs
#: (the published coflow trace, :mod:`twisternet.coflow.trace`), and a choice made when the process
#: imports the codec (the compiled short-tuple records, :mod:`twisternet.smallrecords`).
ENV_LAUNCH_VARS = frozenset({"TWISTERNET_TOKEN_FILE", "TWISTERNET_TOKEN_DIR", "TWISTERNET_MASTER_PORT",
                             "TWISTERNET_K8S_SERVICE", "TWISTERNET_COFLOW_TRACE", "TWISTERNET_SMALLCODEC"})

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(key: str, value: Any) -> int:
    """Parse a byte size (int, or string with a unit); raises ConfigError naming ``key``."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a size in bytes, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(key, f"expected a size in bytes such as 1048576 or '1MiB', got {value!r}")


@dataclass(frozen=True)
class Config:
    """Every tunable of a twisternet process. Build it with :func:`load_config`, not directly."""

    # --- buffers and flow control -------------------------------------------------------------
    #: Size of one pool buffer; small records are packed into buffers of this size, and the wire
    #: carries frames of at most this many payload bytes.
    buffer_size: int = 1 << 20
    #: Receive credit a receiver grants each (peer, edge): this many buffers' worth of bytes may be in
    #: flight before the sender must wait. A single larger message may always travel alone.
    buffer_count: int = 32
    #: Buffers in each process's pool (packing of small records, receive of small messages).
    pool_buffers: int = 64
    #: Records an operation may hold undelivered at a destination before it stops accepting
    #: (back pressure then reaches the senders through withheld credit).
    receive_pending_limit: int = 100_000
    #: Bytes of results (numpy arrays, bytes, strings, also inside (source, value) pairs) a streaming
    #: operation may hold undelivered per destination in a process before it stops accepting, so a slow
    #: consumer of large records bounds the receiver's memory by bytes, not by record count. At
    #: least one record is always accepted.
    receive_pending_bytes: int = 64 << 20
    #: Seconds a waiting caller keeps polling the engine (when it is free) before it sleeps: waking a
    #: sleeping process costs ~150 µs on a VM, more than a short busy poll (MPI does the same).
    spin_time: float = 0.0002
    #: Microseconds a thread waiting for a reply (``wait_until``, blocked sends) busy-polls the channel
    #: itself before it sleeps in the channel's poll. -1 (auto): ``spin_time`` when the job's ranks on
    #: this machine (every namespace and container of one kernel: ``topology.ranks_on_this_kernel``)
    #: and the threads of other programs that want a core at start-up (the median of a few
    #: readings of the running count, not the load average, which remembers the last minute) fit the
    #: cores this process may use (then a poll finds the reply sooner than a sleeping process is
    #: woken), else 0: on an oversubscribed job or machine a spinning rank takes the core from the
    #: very rank whose reply it waits for (measured: 2 ranks on a 2-core machine at load 30 had twice
    #: the latency with 200 us of polling than without). The MPI channel also polls back to back for
    #: this long after its last activity before it sleeps (auto: 1000 us there, its long-standing window,
    #: under the same rule: 0 when the ranks on its host outnumber the cores or the machine is busy).
    busy_poll_us: int = -1
    #: Seconds a partly filled buffer may wait for more records before it is sent (batching small
    #: records); ``flush()`` and any blocking wait send at once.
    flush_delay: float = 0.0005
    #: Messages larger than this are sent zero-copy as their own channel message.
    zero_copy_threshold: int = 256 << 10
    #: Bytes of batch data (gather, keyed gather, partition) kept in memory before spilling to disk.
    memory_limit: int = 256 << 20
    #: Directory for spill files (default: the system temp directory).
    spill_dir: str | None = None
    #: Arrow table pieces smaller than this that a batch destination received are concatenated into
    #: record batches of about this many bytes before ``result_batches`` / ``result_table`` deliver
    #: them (0: as received), so many small sends still reach the reader as a few large batches.
    table_batch_bytes: int = 4 << 20
    #: When a Context starts, have glibc keep freed memory for reuse (``twisternet.malloc.tune``: mmap
    #: threshold 32 MB, trim threshold 64 MB) unless the environment already tunes malloc. Decoded
    #: records come and go in bursts; returning their memory to the system after each burst made every
    #: page fault in again (p2p at 64-128 KB: 1.6-2.0 GB/s against 4.5-5.3 with it). False: leave
    #: glibc's defaults (a process then gives freed heap back sooner, at that cost).
    malloc_tuning: bool = True
    #: When a Context starts, remove the /dev/shm segments and the spill directories (in ``spill_dir``)
    #: that this user's twisternet processes left behind when they were killed (see twisternet.leftovers).
    sweep_stale: bool = True

    # --- timing ---------------------------------------------------------------------------------
    #: Default timeout (seconds) for blocking operations: a batch result, a blocked send.
    timeout: float = 300.0
    #: Seconds to establish the full mesh / reach the bootstrap master.
    connect_timeout: float = 60.0
    #: Seconds a connection may take to pass the token challenge before it is dropped.
    handshake_timeout: float = 5.0
    #: Seconds of silence (no data, no heartbeat) after which a peer is declared lost. Must exceed the
    #: longest time a process may hold the GIL without letting its threads run (e.g. copying GiBs).
    peer_timeout: float = 15.0
    #: Seconds between heartbeats on idle connections.
    heartbeat_interval: float = 1.0

    # --- progress and channel -------------------------------------------------------------------
    #: "thread" (a background progress thread) or "manual" (the program calls ``ctx.progress()``).
    progress: str = "thread"
    #: "auto" (MPI under mpirun, else TCP), "tcp", "mpi", or "local" (threads in one process).
    channel: str = "auto"
    #: Use TCP sockets even between peers on one host (default: Unix-domain sockets there).
    force_tcp: bool = False
    #: MPI channel, ranks on one host: messages from ``buffer_size`` up to 64 MB go through
    #: shared-memory slots the receiver grants (copied in by the sender, the bigger ones by both sides
    #: at once; see channels.shm_slots) instead of MPI's rendezvous. The slots a rank offers take at
    #: most ``memory_limit`` bytes of /dev/shm, two per sending peer.
    mpi_shared_memory: bool = True
    #: MPI channel: an exception no handler caught (on the main thread) ends the whole job with
    #: ``MPI_Abort`` after its traceback is printed, instead of leaving the other ranks waiting for this
    #: one until their operation timeout (and ``mpiexec`` waiting for them).
    mpi_abort_on_error: bool = True
    #: Socket send/receive buffer sizes requested from the kernel (0 = kernel default).
    socket_buffer: int = 4 << 20
    #: Address the TCP listener binds (default: the address this host uses to reach the bootstrap
    #: master, so the data port listens on that interface alone; "0.0.0.0" listens on all of them).
    #: Peers connect to the advertised address.
    bind_host: str | None = None
    #: Address advertised to peers for TCP (default: the address used to reach the master).
    advertise_host: str | None = None

    # --- security and codec ---------------------------------------------------------------------
    #: Job token (hex or text) that every connection must prove it holds.
    token: str | None = field(default=None, repr=False)
    #: Whether values that msgpack cannot carry travel as cloudpickle (only between authenticated peers).
    allow_pickle: bool = True

    # --- launch (set by the launcher / worker CLI) ----------------------------------------------
    #: Bootstrap master address HOST:PORT.
    master: str | None = None
    #: Rank requested by the launcher (None: the master assigns one).
    rank: int | None = None
    #: Number of workers in the job.
    world: int | None = None

    #: Logging level for the ``twisternet`` loggers ("" leaves logging alone).
    log_level: str = ""

    # --- coflow scheduling (docs/design.md section 6; twisternet.coflow.live) -------------------------
    #: Order pending sends by coflow priority: "none" (off: plain per-stream order, no cost), or a
    #: registered policy name ("fifo", "fair", "sebf", "deadline", "dag", ...).
    coflow_policy: str = "none"
    #: Capacity of each rank's port in bytes/s, as the policies see it (rates and deadlines use it).
    coflow_rank_capacity: int = 125_000_000
    #: Seconds between schedule recomputations (it is also recomputed on every registration change).
    coflow_interval: float = 0.1
    #: With scheduling on: bytes handed to the channel per peer and not yet written to the socket;
    #: beyond it, sends wait in the Context's queues where a more urgent coflow can overtake them.
    coflow_inflight: int = 1 << 20
    #: With scheduling on: records up to this size are sliced into pool buffers (so others can
    #: overtake between slices) instead of going out zero-copy as one message.
    coflow_slice_limit: int = 16 << 20
    #: With scheduling on: pace each flow to the rate the policy gives it (token bucket).
    coflow_pacing: bool = False
    #: With scheduling on: report coflows to the job's coordinator (bootstrap master / rank 0) and use the
    #: job-wide order it pushes; without it (or when it goes silent) each rank orders locally.
    coflow_coordinator: bool = True

    # --- in-network aggregation (docs/design.md section 8; AllReduce(via="innet")) ---------------------
    #: Address the ATP worker sockets (and a switch/PS this job starts) bind and advertise.
    innet_host: str = "127.0.0.1"
    #: UDP HOST:PORT of a running ATP switch to use instead of starting one per operation ("" = start
    #: one); set by ``twisternet run --innet``. Needs ``innet_p4runtime`` too.
    innet_switch: str = ""
    #: P4Runtime HOST:PORT of that switch: the operation places its job there as a controller would.
    innet_p4runtime: str = ""
    #: Control HOST:PORT of a standing parameter server (``twisternet ps --control-port``) for the jobs
    #: placed on that switch ("" = the first rank starts a PS on its own host). Needs ``innet_switch``.
    innet_ps: str = ""
    #: Values per ATP packet (ATP: 62 int32 = 264-byte packets). A software switch this job starts can
    #: take wider fragments (up to 16000 values), which cut the per-packet work (docs/innet-performance.md).
    innet_values: int = 62
    #: Engine of the software switch's batched dataplane that a via="innet" operation starts: "auto"
    #: (the compiled core when built, else Python), "c" (an error if it is not built) or "python"
    #: (innet.fastpath). A standalone switch (``twisternet switch``) reads --dataplane or
    #: TWISTERNET_INNET_DATAPLANE.
    innet_dataplane: str = "auto"
    #: Datagram I/O of this job's ATP workers: "auto" (the compiled recvmmsg/sendmmsg helper when built,
    #: else Python loops), "c" (an error if it is not built) or "python" (innet.hostio; a PS or switch
    #: the job starts always uses "auto").
    innet_hostio: str = "auto"
    #: Packet path of a PS this job starts: "auto" (the compiled core innet/_pscore.c when built, else
    #: Python), "c" (an error if it is not built) or "python" (innet.pscore). A standalone PS
    #: (``twisternet ps``) reads --core or TWISTERNET_INNET_PS_CORE.
    innet_ps_core: str = "auto"

    def __post_init__(self) -> None:
        _validate(self)

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied and validated (unknown keys raise ConfigError)."""
        return _build({**dataclasses.asdict(self), **changes}, source="replace()")

    @property
    def token_bytes(self) -> bytes | None:
        """The token as bytes, as used for HMAC."""
        return None if self.token is None else self.token.encode()


_FIELDS = {f.name: f for f in fields(Config)}
_SIZE_KEYS = {"buffer_size", "zero_copy_threshold", "memory_limit", "table_batch_bytes", "socket_buffer",
              "coflow_inflight", "coflow_slice_limit", "receive_pending_bytes"}
_BUILTIN_COFLOW_POLICIES = ("none", "fifo", "fair", "sebf", "deadline", "dag")
_CHOICES = {"progress": ("thread", "manual"), "channel": ("auto", "tcp", "mpi", "local")}


# Complexity accepted: one check per key, in the order of the Config fields.
def _validate(c: Config) -> None:  # noqa: C901
    def positive(key: str, minimum: float = 1) -> None:
        v = getattr(c, key)
        if v < minimum:
            raise ConfigError(key, f"must be >= {minimum}, got {v!r}")

    positive("buffer_size", 64)
    positive("buffer_count")
    positive("pool_buffers", 2)
    positive("receive_pending_limit")
    positive("receive_pending_bytes", 1)
    positive("zero_copy_threshold", 0)
    positive("memory_limit", 1024)
    if not -1 <= c.busy_poll_us <= 1_000_000:
        raise ConfigError("busy_poll_us", f"must be -1 (auto) or between 0 and 1000000, got {c.busy_poll_us!r}")
    positive("table_batch_bytes", 0)
    if not 0 <= c.spin_time <= 1:
        raise ConfigError("spin_time", f"must be between 0 and 1 second, got {c.spin_time!r}")
    if not 0 <= c.flush_delay <= 1:
        raise ConfigError("flush_delay", f"must be between 0 and 1 second, got {c.flush_delay!r}")
    positive("socket_buffer", 0)
    for k in ("timeout", "connect_timeout", "handshake_timeout", "peer_timeout", "heartbeat_interval"):
        if not c.__getattribute__(k) > 0:
            raise ConfigError(k, f"must be > 0 seconds, got {getattr(c, k)!r}")
    if c.heartbeat_interval >= c.peer_timeout:
        raise ConfigError("heartbeat_interval", "must be smaller than peer_timeout")
    for k, choices in _CHOICES.items():
        if getattr(c, k) not in choices:
            raise ConfigError(k, f"must be one of {', '.join(choices)}; got {getattr(c, k)!r}")
    if c.world is not None and c.world < 1:
        raise ConfigError("world", f"must be >= 1, got {c.world}")
    if c.rank is not None and (c.rank < 0 or (c.world is not None and c.rank >= c.world)):
        raise ConfigError("rank", f"must be in [0, world), got {c.rank}")
    def host_port(key: str, what: str) -> None:
        value = getattr(c, key)
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(key, f"must be {what}, got {value!r}")

    if c.master is not None:
        host_port("master", "HOST:PORT")
    for k in ("innet_switch", "innet_p4runtime", "innet_ps"):
        if getattr(c, k):
            host_port(k, "HOST:PORT or empty")
    if bool(c.innet_switch) != bool(c.innet_p4runtime):
        raise ConfigError("innet_switch" if not c.innet_switch else "innet_p4runtime",
                          "innet_switch and innet_p4runtime go together (a shared switch is placed on "
                          "through its P4Runtime server)")
    if c.innet_ps and not c.innet_switch:
        raise ConfigError("innet_ps", "a standing PS serves jobs placed on a shared switch: set innet_switch "
                                      "and innet_p4runtime too")
    if not c.innet_host:
        raise ConfigError("innet_host", "must not be empty")
    if not 1 <= c.innet_values <= 16000:
        raise ConfigError("innet_values", f"must be in 1..16000 values per packet, got {c.innet_values}")
    if c.innet_dataplane not in ("auto", "c", "python"):
        raise ConfigError("innet_dataplane", f"must be auto, c or python, got {c.innet_dataplane!r}")
    if c.innet_hostio not in ("auto", "c", "python"):
        raise ConfigError("innet_hostio", f"must be auto, c or python, got {c.innet_hostio!r}")
    if c.innet_ps_core not in ("auto", "c", "python"):
        raise ConfigError("innet_ps_core", f"must be auto, c or python, got {c.innet_ps_core!r}")
    if c.token is not None:
        from .tokens import HOW_TO_MAKE_ONE, token_problem
        problem = token_problem(c.token)
        if problem is not None:
            raise ConfigError("token", f"too weak: {problem}; {HOW_TO_MAKE_ONE}")
    if c.coflow_policy not in _BUILTIN_COFLOW_POLICIES:
        from .coflow.scheduler import policy_names  # lazily: user-registered policies are allowed too
        if c.coflow_policy not in policy_names():
            raise ConfigError("coflow_policy", f"must be 'none' or a coflow policy "
                              f"({', '.join(policy_names())}); got {c.coflow_policy!r}")
    positive("coflow_rank_capacity")
    positive("coflow_inflight", 1)
    positive("coflow_slice_limit", 0)
    if not 0 < c.coflow_interval <= 60:
        raise ConfigError("coflow_interval", f"must be in (0, 60] seconds, got {c.coflow_interval!r}")


def _coerce(key: str, value: Any, source: str) -> Any:
    """Convert ``value`` (from TOML, env text or kwargs) to the type of field ``key``."""
    if key not in _FIELDS:
        close = [k for k in _FIELDS if k.startswith(key[:4])]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(key, f"unknown key from {source}{hint}")
    if key in _SIZE_KEYS:
        return parse_size(key, value)
    default = _FIELDS[key].default
    if value is None:
        if default is None:
            return None
        raise ConfigError(key, f"may not be None (from {source})")
    kind: type[Any] | None = type(default) if default is not None else None
    if key in ("rank", "world"):
        kind = int
    elif key in ("spill_dir", "advertise_host", "token", "master", "bind_host"):
        kind = str
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind is str:
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigError(key, f"expected {kind.__name__ if kind else 'a value'}, got {value!r} (from {source})")


def _build(values: Mapping[str, Any], source: str) -> Config:
    return Config(**{k: _coerce(k, v, source) for k, v in values.items()})


def load_config(path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None,
                **overrides: Any) -> Config:
    """Build a Config from defaults < TOML file < ``TWISTERNET_*`` environment < ``overrides``.

    ``path`` defaults to ``$TWISTERNET_CONFIG``. A TOML file may put keys at top level or under a
    ``[twisternet]`` table. ``None`` in ``overrides`` means "not given" and is skipped.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if path is None:
        path = env.get(ENV_CONFIG_FILE) or None
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError("config file", f"{p} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("config file", f"{p} is not valid TOML: {e}") from None
        table = data.get("twisternet", data)
        if not isinstance(table, dict):
            raise ConfigError("twisternet", f"{p}: [twisternet] must be a table")
        for k, v in table.items():
            values[k] = _coerce(k, v, f"file {p}")
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE or name in ENV_LAUNCH_VARS:
            continue
        key = name[len(ENV_PREFIX):].lower()
        values[key] = _coerce(key, text, f"environment variable {name}")
    for k, v in overrides.items():
        if v is None and k in _FIELDS:
            continue
        values[k] = _coerce(k, v, "keyword argument")
    return Config(**values)


def to_env(config: Config) -> dict[str, str]:
    """The ``TWISTERNET_*`` variables that reproduce the non-default values of ``config``."""
    out: dict[str, str] = {}
    for f in fields(Config):
        v = getattr(config, f.name)
        if v != f.default and v is not None:
            out[ENV_PREFIX + f.name.upper()] = str(v)
    return out


def busy_poll_seconds(config: Config, world: int, others: float | None = None, *,
                      auto: float | None = None) -> float:
    """How long a waiting thread busy-polls (see ``busy_poll_us``): the explicit value, or with -1
    ``auto`` (default: ``spin_time``) if ``world`` ranks (those on this host) and ``others`` (threads
    of other programs that want a core now, see :func:`twisternet.procfs.runnable_elsewhere`; read if None) fit the
    cores this process may run on, else 0."""
    if config.busy_poll_us >= 0:
        return config.busy_poll_us * 1e-6
    window = config.spin_time if auto is None else auto
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if others is None:
        others = runnable_elsewhere()
    return window if world + others <= cores else 0.0
