"""The switch process: a UDP loop around ``SoftwareSwitch``, a test thread, JSON config, and the CLI main.

``twisternet switch --port P [--aggregators N] [--values 62] [--p4runtime-port G --p4runtime-token-file F]
[--config JSON]`` runs ``main(argv)``; P4Runtime calls must carry the token of the file (see
``innet.p4runtime.auth``), and binding ``--host`` to loopback or the job's own interface keeps others out.

Packets are drained from the socket into an internal queue; the queue depth behind a packet drives ECN
marking. Ports map to UDP addresses; a packet from an unknown address enters on
``UNKNOWN_PORT``.

The JSON/dict configuration (applied through the ``SwitchControl`` methods)::

    {"ports":  {"1": ["127.0.0.1", 40001], "9": ["127.0.0.1", 40009]},
     "groups": [{"group_id": 1, "ports": [1, 2]}],
     "jobs":   [{"job_id": 1, "fan_in": 2, "ps_port": 9, "mcast_group": 1, "level": 0}],
     "members": [[1, 1], [1, 2]],
     "ecn_threshold": 64}

``members`` lists the (job_id, port) pairs allowed to send the job's gradients (the source check, see
``innet.switch``); without the key, each job of the config gets the ports of its multicast group (the
ports its results go to are the ports its contributions may come from).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .lifeline import set_parent_death_signal, watch_parent, watch_stdin
from .fastpath import CDataplane, DataplaneUnavailable, choose_dataplane
from .control import AlreadyExists, InvalidArgument, JobEntry, MulticastGroup, SwitchControl
from .switch import DEFAULT_ECN_THRESHOLD, DEFAULT_STALE_TIMEOUT, UNKNOWN_PORT, SoftwareSwitch
from .transport import ROLE_SWITCH, LossConfig, UdpTransport
from .wire import DEFAULT_VALUE_COUNT
from .server_thread import ServerThread

__all__ = ["UNKNOWN_PORT", "apply_config", "SwitchServer", "SwitchThread", "main"]

log = logging.getLogger(__name__)

_CONFIG_KEYS = {"ports", "groups", "jobs", "members", "ecn_threshold"}


def apply_config(switch: SwitchControl, config: Mapping[str, Any]) -> None:
    """Apply a ports/groups/jobs/ecn_threshold config through the control API (insert, or modify if present)."""
    unknown = set(config) - _CONFIG_KEYS
    if unknown:
        raise InvalidArgument(f"unknown switch config key(s): {sorted(unknown)}")
    ports = config.get("ports", {})
    items = ports.items() if isinstance(ports, Mapping) else ((p["port"], (p["host"], p["udp_port"]))
                                                               for p in ports)
    for port, addr in items:
        try:
            port_no = int(port)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"config ports: bad port number {port!r}") from e
        switch.set_port(port_no, (addr[0], int(addr[1])))
    for g in config.get("groups", ()):
        try:
            group = MulticastGroup(int(g["group_id"]), tuple(int(p) for p in g["ports"]))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"config groups: bad entry {g!r}: {e}") from e
        try:
            switch.insert_mcast_group(group)
        except AlreadyExists:
            switch.modify_mcast_group(group)
    for j in config.get("jobs", ()):
        try:
            entry = JobEntry(int(j["job_id"]), int(j["fan_in"]), int(j["ps_port"]), int(j["mcast_group"]),
                             int(j.get("level", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"config jobs: bad entry {j!r}: {e}") from e
        try:
            switch.insert_job(entry)
        except AlreadyExists:
            switch.modify_job(entry)
    if "members" in config:
        try:
            members = [(int(j), int(p)) for j, p in config["members"]]
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"config members: expected [[job_id, port], ...]: {e}") from e
    else:
        groups = {g.group_id: g.ports for g in switch.read_mcast_groups()}
        members = [(int(j["job_id"]), p) for j in config.get("jobs", ())
                   for p in groups.get(int(j["mcast_group"]), ())]
    for job_id, port in members:
        try:
            switch.insert_member(job_id, port)
        except AlreadyExists:
            pass
    if "ecn_threshold" in config:
        switch.set_ecn_threshold(int(config["ecn_threshold"]))


class SwitchServer:
    """Runs a ``SoftwareSwitch`` on a UDP socket until ``stop()``; ``run()`` is the loop."""

    def __init__(self, switch: SoftwareSwitch, bind: tuple[str, int] = ("127.0.0.1", 0), *,
                 loss: LossConfig | None = None, line_rate: float | None = None,
                 queue_limit: int = 4096, batched: bool = True, batch_size: int = 512,
                 dataplane: str | None = None) -> None:
        """``batched`` (default) runs the batched dataplane (``SoftwareSwitch.process_batch``: up to
        ``batch_size`` datagrams per wake-up received into preallocated memory); False runs the
        per-packet reference ``process``. A ``line_rate`` always uses the per-packet loop (it models a
        slow port, speed is not the point there).

        ``dataplane`` (``auto``/``c``/``python``; None: the ``TWISTERNET_INNET_DATAPLANE`` environment
        variable, default ``auto``) picks the batched loop's engine: the compiled core
        (``innet.fastpath``: recvmmsg, the ATP pipeline in C, sendmmsg) or the Python batched dataplane.
        Loss injection (``loss``) needs the Python send path, so it always runs the Python engine.

        ``line_rate`` (packets/s, None = as fast as the loop runs) models the switch's port rate: the
        switch forwards at most that many packets per second, its queue builds behind them, ECN marks
        when the queue exceeds the threshold, and arrivals beyond ``queue_limit`` packets are
        tail-dropped (``tail_drops``), as on a hardware switch whose egress link is the bottleneck."""
        if line_rate is not None and not line_rate > 0:
            raise ValueError(f"line_rate must be > 0 packets/s, got {line_rate!r}")
        if queue_limit < 1:
            raise ValueError(f"queue_limit must be >= 1 packet, got {queue_limit!r}")
        engine = choose_dataplane(dataplane)
        self.switch = switch
        self.transport = UdpTransport(bind, role=ROLE_SWITCH, loss=loss)
        self._stop = threading.Event()
        self._queue: deque[tuple[bytes, tuple[str, int]]] = deque()
        self._addr_to_port: dict[tuple[str, int], int] = {}
        self._ports: dict[int, tuple[str, int]] = {}
        self._version = -1
        self.packets_in = 0
        #: packets held in the internal queue at most (a switch's buffer)
        self.max_queue = int(queue_limit)
        self.line_rate = line_rate
        self.tail_drops = 0
        self.batched = bool(batched) and line_rate is None
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self.batch_size = int(batch_size)
        if engine == "c" and self.transport.loss.active:
            log.debug("loss injection is on: the switch runs the Python dataplane")
            engine = "python"
        #: the engine of the batched loop: "c" or "python" (the per-packet loop is always Python)
        self.dataplane = engine if self.batched else "python"
        #: the compiled loop sends each destination's outputs as UDP GSO trains (see innet.fastpath)
        self.gso = True

    @property
    def address(self) -> tuple[str, int]:
        return self.transport.address

    def _refresh_ports(self) -> None:
        if self._version != self.switch.config_version:
            self._version = self.switch.config_version
            self._ports = self.switch.read_ports()
            self._addr_to_port = {a: p for p, a in self._ports.items()}

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Receive, process and forward until stopped; then close the socket."""
        if self.batched and self.dataplane == "c":
            self._run_compiled()
        elif self.batched:
            self._run_batched()
        else:
            self._run_per_packet()

    def _run_compiled(self) -> None:
        """The compiled loop: each wake-up, up to 64 batches of ``batch_size`` datagrams go through
        ``CDataplane.serve`` (recvmmsg, the ATP pipeline, sendmmsg, without the GIL); Python keeps the
        stale sweep and hands the core new tables when the control plane changes them."""
        sw = self.switch
        tr = self.transport
        sock = tr.sock
        fd = sock.fileno()
        core = CDataplane(sw)
        core.gso = self.gso
        batch = self.batch_size
        try:       # room for whole GSO trains of outputs in the send buffer
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        except OSError:  # pragma: no cover
            pass
        next_sweep = time.monotonic() + sw.stale_timeout / 2
        try:
            while not self._stop.is_set():
                ready, next_sweep = self._wait_readable(sock, next_sweep)
                if not ready:
                    continue
                for _ in range(64):
                    n = core.serve(fd, batch)
                    self.packets_in += n
                    if n < batch:
                        break
                tr.sent += core.sent
                tr.refused += core.refused
                core.sent = core.refused = 0
                if self.gso and not core.gso:
                    self.gso = False
                    log.info("the kernel refused UDP GSO; the switch sends one datagram per message")
        except Exception:  # pragma: no cover - logged, then the switch is "dead"
            log.exception("switch loop failed")
            raise
        finally:
            tr.close()

    def _wait_readable(self, sock: socket.socket, next_sweep: float) -> tuple[bool, float]:
        """Wait up to 50 ms for ``sock`` to be readable, reclaiming stale aggregators when the sweep is
        due; returns (readable, when the next sweep is due)."""
        r, _, _ = select.select([sock], [], [], 0.05)
        now = time.monotonic()
        if now >= next_sweep:
            self.switch.reclaim_stale(now)
            next_sweep = now + self.switch.stale_timeout / 2
        return bool(r), next_sweep

    def _run_batched(self) -> None:
        """The fast loop: drain up to ``batch_size`` datagrams into a preallocated array, run them
        through ``process_batch`` (queue depth = packets received behind each one), send the outputs."""
        sw = self.switch
        tr = self.transport
        sock = tr.sock
        width = sw.packet_size + 1              # one byte more: an oversize datagram shows as too long
        rows = np.zeros((self.batch_size, width), np.uint8)
        flat = memoryview(rows.reshape(-1))  # type: ignore[arg-type]  # numpy declares __buffer__ for >= 3.12 only
        views = [flat[i * width:(i + 1) * width] for i in range(self.batch_size)]
        recv = sock.recvfrom_into
        send = tr.send if tr.loss.active else None
        sendto = sock.sendto
        next_sweep = time.monotonic() + sw.stale_timeout / 2
        try:
            while not self._stop.is_set():
                ready, next_sweep = self._wait_readable(sock, next_sweep)
                if not ready:
                    continue
                self._refresh_ports()
                a2p = self._addr_to_port
                lengths: list[int] = []
                in_ports: list[int] = []
                for v in views:
                    try:
                        k, src = recv(v)
                    except (BlockingIOError, InterruptedError):
                        break
                    except ConnectionRefusedError:
                        tr.refused += 1
                        continue
                    lengths.append(k)
                    in_ports.append(a2p.get(src, UNKNOWN_PORT))
                n = len(lengths)
                if not n:
                    continue
                self.packets_in += n
                outs = sw.process_batch(rows, lengths, in_ports, time.monotonic(), range(n - 1, -1, -1))
                ports = self._ports
                for port, data in outs:
                    addr = ports.get(port)
                    if addr is None:
                        continue
                    if send is not None:
                        send(data, addr)
                        continue
                    try:
                        sendto(data, addr)
                        tr.sent += 1
                    except (BlockingIOError, ConnectionRefusedError):
                        pass
                    except OSError as e:
                        if e.errno not in (errno.ENOBUFS, errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH):
                            raise
        except Exception:  # pragma: no cover - logged, then the switch is "dead"
            log.exception("switch loop failed")
            raise
        finally:
            tr.close()

    def _run_per_packet(self) -> None:
        """The reference loop (and the rate-limited port model): one ``process`` call per packet."""
        sw = self.switch
        tr = self.transport
        q = self._queue
        next_sweep = time.monotonic() + sw.stale_timeout / 2
        rate = self.line_rate
        burst = 1.0 if rate is None else max(1.0, rate / 1000.0)   # at most a millisecond's worth at once
        tokens, last = burst, time.monotonic()
        try:
            while not self._stop.is_set():
                if not q:
                    r, _, _ = select.select([tr.sock], [], [], 0.05)
                    if not r:
                        now = time.monotonic()
                        if now >= next_sweep:
                            sw.reclaim_stale(now)
                            next_sweep = now + sw.stale_timeout / 2
                        continue
                if rate is None:
                    room = self.max_queue - len(q)   # drain the kernel queue so our depth is the real one,
                    if room > 0:                     # up to a bound (beyond it the kernel drops)
                        q.extend(tr.recv_batch(min(1024, room)))
                    budget = 256
                else:
                    batch = tr.recv_batch(1024)      # everything that arrived; beyond the buffer: tail drop
                    room = self.max_queue - len(q)
                    if len(batch) > room:
                        self.tail_drops += len(batch) - max(room, 0)
                        batch = batch[:max(room, 0)]
                    q.extend(batch)
                    now = time.monotonic()
                    tokens = min(burst, tokens + (now - last) * rate)
                    last = now
                    budget = min(256, int(tokens))
                    if budget == 0:
                        select.select([tr.sock], [], [], (1.0 - tokens) / rate)
                        continue
                    tokens -= min(budget, len(q))
                self._refresh_ports()
                now = time.monotonic()
                for _ in range(min(len(q), budget)):
                    data, src = q.popleft()
                    self.packets_in += 1
                    in_port = self._addr_to_port.get(src, UNKNOWN_PORT)
                    for port, out in sw.process(data, in_port, now, queue_depth=len(q)):
                        addr = self._ports.get(port)
                        if addr is not None:
                            tr.send(out, addr)
                if now >= next_sweep:
                    sw.reclaim_stale(now)
                    next_sweep = now + sw.stale_timeout / 2
        except Exception:  # pragma: no cover - logged, then the switch is "dead"
            log.exception("switch loop failed")
            raise
        finally:
            tr.close()


class SwitchThread(ServerThread):
    """A switch running in a daemon thread of this process (for tests and demos); a context manager."""

    def __init__(self, num_aggregators: int = 4096, value_count: int = DEFAULT_VALUE_COUNT, *,
                 config: Mapping[str, Any] | None = None, bind: tuple[str, int] = ("127.0.0.1", 0),
                 loss: LossConfig | None = None, ecn_threshold: int = DEFAULT_ECN_THRESHOLD,
                 stale_timeout: float = DEFAULT_STALE_TIMEOUT, line_rate: float | None = None,
                 queue_limit: int = 4096, batched: bool = True, dataplane: str | None = None) -> None:
        self.switch = SoftwareSwitch(num_aggregators, value_count, ecn_threshold=ecn_threshold,
                                     stale_timeout=stale_timeout)
        if config:
            apply_config(self.switch, config)
        self.server = SwitchServer(self.switch, bind, loss=loss, line_rate=line_rate, queue_limit=queue_limit,
                                   batched=batched, dataplane=dataplane)
        super().__init__(self.server, "atp-switch")


def start_lifelines(args: argparse.Namespace, stop: Callable[[], None]) -> None:
    """Tie this helper process to its parent (``innet.lifeline``) as the command line asks."""
    if args.parent_pid is not None:
        if args.parent_death_signal:
            set_parent_death_signal(signal.SIGTERM)
        watch_parent(args.parent_pid, stop)
    if args.lifeline:
        watch_stdin(stop)


def _load_config(text: str) -> dict:
    if os.path.exists(text):
        with open(text, encoding="utf-8") as f:
            return json.load(f)
    return json.loads(text)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI of ``twisternet switch``: serve the ATP dataplane on UDP until SIGINT/SIGTERM."""
    ap = argparse.ArgumentParser(prog="twisternet switch", description="ATP software switch (UDP)")
    ap.add_argument("--port", type=int, default=0, help="UDP port to listen on (0 = any free port)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--aggregators", type=int, default=4096, help="number of aggregators (default 4096)")
    ap.add_argument("--values", type=int, default=DEFAULT_VALUE_COUNT,
                    help=f"values per packet (default {DEFAULT_VALUE_COUNT})")
    ap.add_argument("--p4runtime-port", type=int, default=None, help="serve P4Runtime (gRPC) on this port")
    ap.add_argument("--config", default=None, help="JSON config (a file path or an inline JSON object)")
    ap.add_argument("--ecn-threshold", type=int, default=DEFAULT_ECN_THRESHOLD)
    ap.add_argument("--stale-timeout", type=float, default=DEFAULT_STALE_TIMEOUT)
    ap.add_argument("--line-rate", type=float, default=None,
                    help="packets/s the switch forwards at most (models a rate-limited port; default: no limit)")
    ap.add_argument("--queue-limit", type=int, default=4096, help="switch buffer in packets (default 4096)")
    ap.add_argument("--per-packet", action="store_true",
                    help="run the per-packet reference dataplane instead of the batched one")
    ap.add_argument("--dataplane", choices=("auto", "c", "python"), default=None,
                    help="engine of the batched dataplane: the compiled core (c), Python, or c when built "
                         "(auto; default: $TWISTERNET_INNET_DATAPLANE, else auto)")
    ap.add_argument("--p4runtime-token-file", default=None, metavar="PATH",
                    help="file whose first line is the P4Runtime token every call must carry "
                         "('-': the first line of stdin)")
    ap.add_argument("--p4runtime-insecure", action="store_true",
                    help="serve P4Runtime without a token (any local client can then control the switch)")
    ap.add_argument("--lifeline", action="store_true",
                    help="exit when stdin reaches end of file (the parent closed the pipe or died)")
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this parent process is gone")
    ap.add_argument("--parent-death-signal", action="store_true",
                    help="also ask the kernel for SIGTERM when the parent dies (PR_SET_PDEATHSIG)")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = None
    if args.p4runtime_port is not None:
        if args.p4runtime_token_file is None and not args.p4runtime_insecure:
            ap.error("--p4runtime-port needs --p4runtime-token-file (or, knowingly, --p4runtime-insecure)")
        if args.p4runtime_token_file == "-":
            token = sys.stdin.readline().strip()
        elif args.p4runtime_token_file is not None:
            from .tokens import read_token_file
            try:
                token = read_token_file(args.p4runtime_token_file)
            except (OSError, ValueError) as e:
                ap.error(f"--p4runtime-token-file: {e}")
        if args.p4runtime_token_file is not None and not token:
            ap.error("--p4runtime-token-file: empty token")
    try:
        switch = SoftwareSwitch(args.aggregators, args.values, ecn_threshold=args.ecn_threshold,
                                stale_timeout=args.stale_timeout)
        if args.config:
            apply_config(switch, _load_config(args.config))
    except (InvalidArgument, ValueError, OSError) as e:
        ap.error(str(e))
    try:
        server = SwitchServer(switch, (args.host, args.port), line_rate=args.line_rate,
                              queue_limit=args.queue_limit, batched=not args.per_packet,
                              dataplane=args.dataplane)
    except (ValueError, DataplaneUnavailable) as e:
        ap.error(str(e))
    grpc_server = None
    if args.p4runtime_port is not None:
        from .p4runtime import serve  # lazy: grpc is an optional dependency
        try:
            grpc_server = serve(switch, args.p4runtime_port, host=args.host, token=token)
        except (OSError, ValueError) as e:
            server.transport.close()
            ap.error(f"--p4runtime-port: {e}")
        log.info("P4Runtime on %s:%d", args.host, grpc_server.port)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    start_lifelines(args, server.stop)
    host, port = server.address
    sys.stdout.write(f"atp switch listening on udp {host}:{port}\n")
    if grpc_server is not None:
        sys.stdout.write(f"p4runtime on {grpc_server.host}:{grpc_server.port}\n")
    sys.stdout.flush()
    log.info("switch on %s:%d with %d aggregators x %d values", host, port, args.aggregators, args.values)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if grpc_server is not None:
            grpc_server.stop(0)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
