"""A P4Runtime controller that registers in-network jobs on a running ATP switch.

``twisternet run --innet`` starts one software switch beside the job with its P4Runtime server on; the
first rank of every ``AllReduce(via="innet")`` then uses :class:`P4RuntimeController` to place its job
on that switch the way a controller would place it on a hardware ATP switch: it reads the job and port
tables, picks a free job id and free switch port numbers, and writes the workers' and the PS's port
entries, the ``member_table`` entries of its workers' ports (the switch accepts the job's gradients from
those only), the job's multicast group and its ``job_table`` entry; when the operation closes it deletes
them again.

Every call opens a StreamChannel, becomes primary with an election id taken from the clock (a later
controller always outranks an earlier one, so a controller that died does not lock the switch), does its
reads and writes, and closes the stream. All RPCs carry timeouts; failures raise :class:`ControllerError`
with the switch's own P4Runtime error text.

Needs the ``innet`` extra (grpcio, p4runtime).
"""

from __future__ import annotations

import itertools
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from collections.abc import Iterable, Sequence

import grpc

from .p4runtime.auth import authenticated_channel
from .p4runtime.bytestrings import decode_uint, encode_uint
from .p4runtime.protos import code_pb2, p4runtime_pb2 as pb, p4runtime_pb2_grpc, status_pb2
from .p4runtime.schema import load_p4info, packet_values
from .wire import MAX_FAN_IN

__all__ = ["ControllerError", "JobPlacement", "P4RuntimeController"]

_RPC_TIMEOUT = 10.0
_election_counter = itertools.count()


class ControllerError(RuntimeError):
    """The switch refused or did not answer a control request."""

    def __init__(self, message: str, codes: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.codes = tuple(codes)   # google.rpc codes of the failed updates (empty when not a Write error)


@dataclass(frozen=True)
class JobPlacement:
    """Where a job sits on the switch: its id, its workers' switch ports (by rank) and its PS port."""

    job_id: int
    worker_ports: tuple[int, ...]
    ps_port: int


def _write_errors(err: grpc.RpcError) -> list[pb.Error]:
    for key, value in err.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            out = []
            for detail in status.details:
                e = pb.Error()
                detail.Unpack(e)
                out.append(e)
            return out
    return []


def _ip_to_int(host: str) -> int:
    return int.from_bytes(socket.inet_aton(socket.gethostbyname(host)), "big")


class P4RuntimeController:
    """Job placement on one ATP switch through its P4Runtime server at ``address`` ("host:port")."""

    def __init__(self, address: str, device_id: int = 1, timeout: float = _RPC_TIMEOUT,
                 token: str | None = None) -> None:
        """``token``: the switch's P4Runtime token (``innet.p4runtime.auth.p4runtime_token`` of the job
        token), sent with every call."""
        self.address = address
        self.token = token
        self.device_id = device_id
        self.timeout = timeout
        info = load_p4info()
        tables = {t.preamble.alias: t for t in info.tables}
        actions = {a.preamble.alias: a for a in info.actions}
        self._job_table = tables["job_table"]
        self._port_table = tables["port_table"]
        self._set_job = actions["set_job"]
        self._set_port = actions["set_port_addr"]
        self._member_table = tables["member_table"]
        self._allow_member = actions["allow_member"]
        self._port_bits = self._port_table.match_fields[0].bitwidth
        self._job_bits = self._job_table.match_fields[0].bitwidth
        self._fan_in_bits = next(p.bitwidth for p in self._set_job.params if p.name == "fan_in")

    # ------------------------------------------------------------------ session
    class _Session:
        def __init__(self, ctl: P4RuntimeController) -> None:
            self.ctl = ctl
            self.channel = authenticated_channel(ctl.address, ctl.token)
            self.stub = p4runtime_pb2_grpc.P4RuntimeStub(self.channel)
            self._out: queue.Queue = queue.Queue()
            self._in: queue.Queue = queue.Queue()
            # higher than any earlier controller's: nanoseconds since the epoch, plus a tie-breaker
            self.election_id = (time.time_ns() << 8) | (next(_election_counter) & 0xFF)
            self._stream = self.stub.StreamChannel(iter(self._out.get, None))
            self._pump = threading.Thread(target=self._read, daemon=True, name="p4rt-controller")
            self._pump.start()

        def _read(self) -> None:
            try:
                for msg in self._stream:
                    self._in.put(msg)
            except grpc.RpcError as err:
                self._in.put(err)

        def become_primary(self) -> None:
            req = pb.StreamMessageRequest()
            req.arbitration.device_id = self.ctl.device_id
            req.arbitration.election_id.high = self.election_id >> 64
            req.arbitration.election_id.low = self.election_id & ((1 << 64) - 1)
            self._out.put(req)
            deadline = time.monotonic() + self.ctl.timeout
            while True:
                try:
                    msg = self._in.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    raise ControllerError(f"P4Runtime switch at {self.ctl.address} did not answer the "
                                          f"arbitration within {self.ctl.timeout:.0f} s") from None
                if isinstance(msg, grpc.RpcError):
                    raise ControllerError(f"P4Runtime switch at {self.ctl.address}: {msg.details() or msg}")
                if msg.HasField("arbitration") and msg.arbitration.status.code == code_pb2.OK:
                    return
                if msg.HasField("arbitration"):
                    raise ControllerError(f"P4Runtime switch at {self.ctl.address} did not make this "
                                          f"controller primary: {msg.arbitration.status.message}")

        def write(self, updates: Iterable[pb.Update]) -> None:
            req = pb.WriteRequest(device_id=self.ctl.device_id)
            req.election_id.high = self.election_id >> 64
            req.election_id.low = self.election_id & ((1 << 64) - 1)
            req.updates.extend(updates)
            try:
                self.stub.Write(req, timeout=self.ctl.timeout)
            except grpc.RpcError as err:
                errors = _write_errors(err)
                failed = [(u, e) for u, e in zip(req.updates, errors) if e.canonical_code != code_pb2.OK]
                text = "; ".join(e.message for _, e in failed) or (err.details() or str(err))
                raise ControllerError(f"P4Runtime write to {self.ctl.address} failed: {text}",
                                      [e.canonical_code for _, e in failed]) from None

        def read_keys(self, table) -> set[int]:
            req = pb.ReadRequest(device_id=self.ctl.device_id)
            req.entities.add().table_entry.table_id = table.preamble.id
            keys: set[int] = set()
            try:
                for resp in self.stub.Read(req, timeout=self.ctl.timeout):
                    for ent in resp.entities:
                        field = ent.table_entry.match[0].exact.value
                        keys.add(decode_uint(field, table.match_fields[0].bitwidth, table.preamble.alias))
            except grpc.RpcError as err:
                raise ControllerError(f"P4Runtime read from {self.ctl.address} failed: "
                                      f"{err.details() or err}") from None
            return keys

        def close(self) -> None:
            self._out.put(None)
            self._pump.join(timeout=self.ctl.timeout)
            self.channel.close()

    def _session(self) -> P4RuntimeController._Session:
        s = self._Session(self)
        try:
            s.become_primary()
        except BaseException:
            s.close()
            raise
        return s

    # ------------------------------------------------------------------ updates
    def _table_update(self, utype: int, table, key: int, action=None, params: dict | None = None) -> pb.Update:
        u = pb.Update(type=utype)
        te = u.entity.table_entry
        te.table_id = table.preamble.id
        mf = te.match.add()
        mf.field_id = table.match_fields[0].id
        mf.exact.value = encode_uint(key)
        if action is not None:
            te.action.action.action_id = action.preamble.id
            by_name = {p.name: p.id for p in action.params}
            for name, value in (params or {}).items():
                p = te.action.action.params.add()
                p.param_id = by_name[name]
                p.value = encode_uint(value)
        return u

    def _group_update(self, utype: int, group_id: int, ports: Sequence[int] = ()) -> pb.Update:
        u = pb.Update(type=utype)
        mg = u.entity.packet_replication_engine_entry.multicast_group_entry
        mg.multicast_group_id = group_id
        for port in ports:
            mg.replicas.add().egress_port = port
        return u

    # ------------------------------------------------------------------ API
    def free_job_id(self, exclude: Iterable[int] = ()) -> int:
        """A random job id (1..2^bits-1) without a ``job_table`` entry, and not in ``exclude``.

        Random, not the lowest free one, so that a job's id says nothing to another tenant (the switch
        trusts addresses, not ids, but there is no reason to make ids predictable)."""
        s = self._session()
        try:
            used = s.read_keys(self._job_table) | set(exclude)
        finally:
            s.close()
        free = [j for j in range(1, 1 << self._job_bits) if j not in used]
        if free:
            return free[secrets.randbelow(len(free))]
        raise ControllerError(f"switch at {self.address} has no free job id (all "
                              f"{(1 << self._job_bits) - 1} in use)")

    def packet_values(self) -> int:
        """The switch's packet width (int32 values per packet), read from the P4Info it serves
        (``agg_values`` cells per aggregator slot: 62 on ATP's hardware program, ``--values`` on a
        software switch). Every worker and PS of a job placed here must use it."""
        RT = pb.GetForwardingPipelineConfigRequest
        channel = authenticated_channel(self.address, self.token)
        try:
            resp = p4runtime_pb2_grpc.P4RuntimeStub(channel).GetForwardingPipelineConfig(
                RT(device_id=self.device_id, response_type=RT.P4INFO_AND_COOKIE), timeout=self.timeout)
        except grpc.RpcError as err:
            raise ControllerError(f"P4Runtime switch at {self.address} did not give its pipeline: "
                                  f"{err.details() or err}") from None
        finally:
            channel.close()
        try:
            return packet_values(resp.config.p4info)
        except ValueError as err:
            raise ControllerError(f"P4Runtime switch at {self.address}: {err}") from None

    def job_ids(self) -> set[int]:
        """The job ids that have a ``job_table`` entry on the switch."""
        s = self._session()
        try:
            return s.read_keys(self._job_table)
        finally:
            s.close()

    def place_job(self, job_id: int, workers: Sequence[tuple[str, int]], ps_addr: tuple[str, int],
                  exclude_ports: Iterable[int] = ()) -> JobPlacement:
        """Write the port entries, multicast group and job entry of a single-rack job; returns its ports.

        ``workers[r]`` is rank r's UDP address. Port numbers are the lowest free ones; an id or port
        taken by a concurrent controller makes the write fail with :class:`ControllerError`, after
        which nothing of this job stays on the switch.
        """
        world = len(workers)
        most = min(MAX_FAN_IN, (1 << self._fan_in_bits) - 1)
        if not 1 <= world <= most:
            raise ControllerError(f"a single-rack switch job takes 1..{most} workers (the bitmap has "
                                  f"{MAX_FAN_IN} bits), got {world}")
        s = self._session()
        try:
            used = s.read_keys(self._port_table) | set(exclude_ports)
            free = [p for p in range(1, 1 << self._port_bits) if p not in used]
            if len(free) < world + 1:
                raise ControllerError(f"switch at {self.address} has {len(free)} free ports, the job "
                                      f"needs {world + 1}")
            placement = JobPlacement(job_id, tuple(free[:world]), free[world])
            ins = pb.Update.INSERT
            port_updates = [self._table_update(ins, self._port_table, port, self._set_port,
                                               {"ipv4": _ip_to_int(addr[0]), "udp_port": int(addr[1])})
                            for port, addr in zip((*placement.worker_ports, placement.ps_port),
                                                  (*workers, ps_addr))]
            group = self._group_update(ins, job_id, placement.worker_ports)
            # the source check: only these ports may send the job's gradients (its ACKs: only ps_port)
            members = [self._table_update(ins, self._member_table, job_id << 24 | port, self._allow_member, {})
                       for port in placement.worker_ports]
            job = self._table_update(ins, self._job_table, job_id, self._set_job,
                                     {"fan_in": world, "ps_port": placement.ps_port, "mcast_grp": job_id,
                                      "level": 0})
            written: list[pb.Update] = []
            try:
                for u in (*port_updates, *members, group, job):  # one by one: what landed can be undone
                    s.write([u])
                    written.append(u)
            except ControllerError:
                self._undo(s, written)
                raise
            return placement
        finally:
            s.close()

    def remove_job(self, placement: JobPlacement) -> None:
        """Delete a placed job's job entry, multicast group and port entries (missing ones are ignored)."""
        s = self._session()
        try:
            dl = pb.Update.DELETE
            updates = [self._table_update(dl, self._job_table, placement.job_id),
                       self._group_update(dl, placement.job_id)]
            updates += [self._table_update(dl, self._member_table, placement.job_id << 24 | p)
                        for p in placement.worker_ports]
            updates += [self._table_update(dl, self._port_table, p)
                        for p in (*placement.worker_ports, placement.ps_port)]
            problems = []
            for u in updates:
                try:
                    s.write([u])
                except ControllerError as err:
                    if err.codes != (code_pb2.NOT_FOUND,):
                        problems.append(str(err))
            if problems:
                raise ControllerError("; ".join(problems))
        finally:
            s.close()

    def _undo(self, s: P4RuntimeController._Session, written: Sequence[pb.Update]) -> None:
        for u in reversed(written):
            d = pb.Update()
            d.CopyFrom(u)
            d.type = pb.Update.DELETE
            if d.entity.HasField("table_entry"):
                d.entity.table_entry.ClearField("action")
            else:
                d.entity.packet_replication_engine_entry.multicast_group_entry.ClearField("replicas")
            try:
                s.write([d])
            except ControllerError:
                pass
