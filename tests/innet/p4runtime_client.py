"""A raw gRPC P4Runtime client and entity builders for the P4Runtime server tests (test_p4runtime_*.py):
the switches they run against (the in-memory FakeSwitch and innet.switch.SoftwareSwitch) and the ids of
the loaded P4Info. Not a test module; the ``rig`` fixture is in conftest.py."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest

from innet.p4runtime.bytestrings import encode_uint
from innet.p4runtime.protos import code_pb2, p4runtime_pb2 as pb, p4runtime_pb2_grpc, status_pb2
from innet.p4runtime.schema import load_p4info

from tests.innet.fake_switch import FakeSwitch

RPC_TIMEOUT = 5.0

from innet.switch import SoftwareSwitch


def _make_fake():
    return FakeSwitch(num_aggregators=16, value_count=4)


def _make_software():
    return SoftwareSwitch(num_aggregators=16, value_count=4)


SWITCHES = [pytest.param(_make_fake, id="fake"), pytest.param(_make_software, id="software")]

P4INFO = load_p4info()


def _ids():
    t = {o.preamble.alias: o.preamble.id for o in P4INFO.tables}
    a = {o.preamble.alias: o for o in P4INFO.actions}
    c = {o.preamble.alias: o.preamble.id for o in P4INFO.counters}
    r = {o.preamble.alias: o.preamble.id for o in P4INFO.registers}
    return t, a, c, r


TABLE, ACTION, COUNTER, REGISTER = _ids()


def _param_id(action: str, name: str) -> int:
    return next(p.id for p in ACTION[action].params if p.name == name)


class Client:
    """A minimal P4Runtime client: one StreamChannel plus unary calls, everything with timeouts."""

    def __init__(self, address: str, device_id: int = 1) -> None:
        self.device_id = device_id
        self.channel = grpc.insecure_channel(address)
        self.stub = p4runtime_pb2_grpc.P4RuntimeStub(self.channel)
        self._out: queue.Queue = queue.Queue()
        self.inbox: queue.Queue = queue.Queue()
        self.election_id: int | None = None
        self.role = ""
        self._stream = self.stub.StreamChannel(iter(self._out.get, None))
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for msg in self._stream:
                self.inbox.put(msg)
        except grpc.RpcError as err:
            self.inbox.put(err)

    def arbitrate(self, election_id: int | None, device_id: int | None = None, role: str = ""):
        req = pb.StreamMessageRequest()
        req.arbitration.device_id = self.device_id if device_id is None else device_id
        if role:
            req.arbitration.role.name = role
        if election_id is not None:
            req.arbitration.election_id.high = election_id >> 64
            req.arbitration.election_id.low = election_id & ((1 << 64) - 1)
        self.election_id = election_id
        self.role = role
        self._out.put(req)
        return self.next()

    def next(self, timeout: float = RPC_TIMEOUT):
        return self.inbox.get(timeout=timeout)

    def send(self, req: pb.StreamMessageRequest) -> None:
        self._out.put(req)

    def write(self, *updates: pb.Update, election_id: int | None = -1):
        req = pb.WriteRequest(device_id=self.device_id, role=self.role)
        eid = self.election_id if election_id == -1 else election_id
        if eid is not None:
            req.election_id.high = eid >> 64
            req.election_id.low = eid & ((1 << 64) - 1)
        req.updates.extend(updates)
        return self.stub.Write(req, timeout=RPC_TIMEOUT)

    def read(self, *entities: pb.Entity) -> list[pb.Entity]:
        req = pb.ReadRequest(device_id=self.device_id)
        req.entities.extend(entities)
        return [e for resp in self.stub.Read(req, timeout=RPC_TIMEOUT) for e in resp.entities]

    def set_pipeline(self, p4info, action=pb.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT,
                     cookie: int | None = None):
        req = pb.SetForwardingPipelineConfigRequest(device_id=self.device_id, action=action)
        if self.election_id is not None:
            req.election_id.low = self.election_id
        if p4info is not None:
            req.config.p4info.CopyFrom(p4info)
            req.config.p4_device_config = b"opaque-target-config"
            if cookie is not None:
                req.config.cookie.cookie = cookie
        return self.stub.SetForwardingPipelineConfig(req, timeout=RPC_TIMEOUT)

    def close(self) -> None:
        self._out.put(None)
        self._thread.join(timeout=RPC_TIMEOUT)
        self.channel.close()


# ----------------------------------------------------------------------------- entity builders
def job_update(utype, job_id: bytes | int, fan_in=3, ps_port=7, mcast=5, level=0, metadata=b""):
    u = pb.Update(type=utype)
    te = u.entity.table_entry
    te.table_id = TABLE["job_table"]
    mf = te.match.add()
    mf.field_id = 1
    mf.exact.value = job_id if isinstance(job_id, bytes) else encode_uint(job_id)
    if utype != pb.Update.DELETE:
        te.action.action.action_id = ACTION["set_job"].preamble.id
        for name, value in (("fan_in", fan_in), ("ps_port", ps_port), ("mcast_grp", mcast),
                            ("level", level)):
            p = te.action.action.params.add()
            p.param_id = _param_id("set_job", name)
            p.value = value if isinstance(value, bytes) else encode_uint(value)
    if metadata:
        te.metadata = metadata
    return u


def member_update(utype, job_id: int, port: int):
    """A member_table entry: ``port`` may send gradients of ``job_id``."""
    u = pb.Update(type=utype)
    te = u.entity.table_entry
    te.table_id = TABLE["member_table"]
    mf = te.match.add()
    mf.field_id = 1
    mf.exact.value = encode_uint(job_id << 24 | port)
    if utype != pb.Update.DELETE:
        te.action.action.action_id = ACTION["allow_member"].preamble.id
    return u


def port_update(utype, port: int, ipv4: str = "127.0.0.2", udp_port: int = 40000):
    u = pb.Update(type=utype)
    te = u.entity.table_entry
    te.table_id = TABLE["port_table"]
    mf = te.match.add()
    mf.field_id = 1
    mf.exact.value = encode_uint(port)
    if utype != pb.Update.DELETE:
        te.action.action.action_id = ACTION["set_port_addr"].preamble.id
        a, b, c, d = (int(x) for x in ipv4.split("."))
        for name, value in (("ipv4", (a << 24) | (b << 16) | (c << 8) | d), ("udp_port", udp_port)):
            p = te.action.action.params.add()
            p.param_id = _param_id("set_port_addr", name)
            p.value = encode_uint(value)
    return u


def group_update(utype, group_id: int, ports=(), use_port_bytes=False):
    u = pb.Update(type=utype)
    mg = u.entity.packet_replication_engine_entry.multicast_group_entry
    mg.multicast_group_id = group_id
    for port in ports:
        r = mg.replicas.add()
        if use_port_bytes:
            r.port = encode_uint(port)
        else:
            r.egress_port = port
    return u


def register_update(alias: str, value: bytes, index: int | None = 0):
    u = pb.Update(type=pb.Update.MODIFY)
    re_ = u.entity.register_entry
    re_.register_id = REGISTER[alias]
    if index is not None:
        re_.index.index = index
    re_.data.bitstring = value
    return u


def table_read(alias: str | None = None) -> pb.Entity:
    e = pb.Entity()
    e.table_entry.table_id = TABLE[alias] if alias else 0
    return e


def write_errors(err: grpc.RpcError) -> list[pb.Error]:
    """The per-update p4.v1.Error list of a failed Write, from grpc-status-details-bin."""
    assert err.code() == grpc.StatusCode.UNKNOWN
    raw = dict(err.trailing_metadata())["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(raw)
    assert status.code == code_pb2.UNKNOWN
    out = []
    for detail in status.details:
        e = pb.Error()
        assert detail.Unpack(e)
        out.append(e)
    return out


def _p4int(data: bytes) -> int:
    return int.from_bytes(data, "big")

