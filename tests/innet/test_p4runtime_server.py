"""The P4Runtime server, driven by a raw gRPC client: arbitration, pipeline config, write/read, errors.

Every test runs against the in-memory FakeSwitch and, when the dataplane helper's
``innet.switch.SoftwareSwitch`` imports, against it too (skipped with the import error otherwise).
Expected values come from the test's own inputs (or from the switch's SwitchControl view), never from
the server's answers.
"""

from __future__ import annotations

import queue
import struct
import threading
import time

import grpc
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from innet.control import JobEntry, MulticastGroup
from innet.p4runtime import serve
from innet.p4runtime.bytestrings import decode_uint, encode_uint, to_canonical
from innet.p4runtime.errors import P4RuntimeError
from innet.p4runtime.protos import (
    code_pb2, p4info_pb2, p4runtime_pb2 as pb, p4runtime_pb2_grpc, status_pb2,
)
from innet.p4runtime.schema import load_p4info

from tests.innet.fake_switch import COUNTER_NAMES, FakeSwitch

pytestmark = pytest.mark.timeout(60)
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


@pytest.fixture(params=SWITCHES)
def rig(request):
    """(switch, server, primary client with election id 10)."""
    switch = request.param()
    server = serve(switch, 0)
    clients: list[Client] = []

    def connect(device_id: int = 1) -> Client:
        c = Client(server.address, device_id)
        clients.append(c)
        return c

    primary = connect()
    assert primary.arbitrate(10).arbitration.status.code == code_pb2.OK
    yield switch, server, primary, connect
    for c in clients:
        c.close()
    server.stop(grace=0)


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


# ----------------------------------------------------------------------------- bytestrings
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64).flatmap(lambda w: st.tuples(st.just(w), st.integers(0, 2**w - 1))),
       st.integers(0, 4))
def test_bytestrings_roundtrip_canonical_and_padded(width_value, pad):
    width, value = width_value
    canonical = encode_uint(value)
    assert len(canonical) == max(1, (value.bit_length() + 7) // 8)
    assert decode_uint(canonical, width, "x") == value
    assert decode_uint(b"\x00" * pad + canonical, width, "x") == value
    assert to_canonical(b"\x00" * pad + canonical) == canonical


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 63).flatmap(lambda w: st.tuples(st.just(w), st.integers(2**w, 2**64))))
def test_bytestrings_reject_values_wider_than_the_bitwidth(width_value):
    width, value = width_value
    with pytest.raises(P4RuntimeError) as info:
        decode_uint(value.to_bytes(9, "big"), width, "field")
    assert info.value.code_name == "OUT_OF_RANGE"


def test_bytestrings_reject_empty():
    with pytest.raises(P4RuntimeError) as info:
        decode_uint(b"", 8, "field")
    assert info.value.code_name == "OUT_OF_RANGE"


# ----------------------------------------------------------------------------- arbitration
@pytest.mark.parametrize("make_switch", SWITCHES)
def test_arbitration_primary_backup_and_handover(make_switch):
    server = serve(make_switch(), 0)
    a, b, c = (Client(server.address) for _ in range(3))
    try:
        upd = a.arbitrate(5).arbitration
        assert upd.status.code == code_pb2.OK and upd.election_id.low == 5 and upd.device_id == 1
        upd = b.arbitrate(7).arbitration                   # higher id takes over
        assert upd.status.code == code_pb2.OK and upd.election_id.low == 7
        upd = a.next().arbitration                         # the old primary is told
        assert upd.status.code == code_pb2.ALREADY_EXISTS and upd.election_id.low == 7
        upd = c.arbitrate(6).arbitration                   # lower than the highest: backup
        assert upd.status.code == code_pb2.ALREADY_EXISTS and upd.election_id.low == 7

        with pytest.raises(grpc.RpcError) as info:         # a backup may not write
            a.write(job_update(pb.Update.INSERT, 1))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        b.write(job_update(pb.Update.INSERT, 1))           # the primary may

        b.close()                                          # primary leaves: no primary any more
        for ctl in (a, c):
            upd = ctl.next().arbitration
            assert upd.status.code == code_pb2.NOT_FOUND and upd.election_id.low == 7
        with pytest.raises(grpc.RpcError) as info:
            c.write(job_update(pb.Update.INSERT, 2))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        upd = c.arbitrate(8).arbitration                   # re-arbitrate higher: primary again
        assert upd.status.code == code_pb2.OK and upd.election_id.low == 8
        assert a.next().arbitration.status.code == code_pb2.ALREADY_EXISTS
        c.write(job_update(pb.Update.INSERT, 2))
    finally:
        for ctl in (a, b, c):
            ctl.close()
        server.stop(grace=0)


def test_arbitration_errors_terminate_the_stream():
    server = serve(FakeSwitch(), 0)
    a, b, d, n = Client(server.address), Client(server.address), Client(server.address, 9), \
        Client(server.address)
    try:
        assert a.arbitrate(3).arbitration.status.code == code_pb2.OK
        err = b.arbitrate(3)                                # same election id as a live controller
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        err = d.arbitrate(4)                                # unknown device
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.NOT_FOUND
        upd = n.arbitrate(None).arbitration                 # no election id: a backup forever
        assert upd.status.code == code_pb2.ALREADY_EXISTS and upd.election_id.low == 3
        assert a.arbitrate(3).arbitration.status.code == code_pb2.OK   # re-send: stays primary
        err = a.arbitrate(3, role="other")                  # changing role on a stream
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        for ctl in (a, b, d, n):
            ctl.close()
        server.stop(grace=0)


def test_packet_out_gets_a_stream_error(rig):
    _, _, primary, _ = rig
    req = pb.StreamMessageRequest()
    req.packet.payload = b"\x01\x02"
    primary.send(req)
    msg = primary.next()
    assert msg.WhichOneof("update") == "error"
    assert msg.error.canonical_code == code_pb2.UNIMPLEMENTED
    assert msg.error.packet_out.packet_out.payload == b"\x01\x02"


# ----------------------------------------------------------------------------- pipeline config
def test_get_pipeline_returns_the_loaded_p4info(rig):
    _, _, primary, _ = rig
    RT = pb.GetForwardingPipelineConfigRequest
    resp = primary.stub.GetForwardingPipelineConfig(
        RT(device_id=1, response_type=RT.P4INFO_AND_COOKIE), timeout=RPC_TIMEOUT)
    assert resp.config.p4info == P4INFO
    with pytest.raises(grpc.RpcError) as info:
        primary.stub.GetForwardingPipelineConfig(RT(device_id=2), timeout=RPC_TIMEOUT)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_set_pipeline_validates_commits_and_clears_state(rig):
    switch, _, primary, connect = rig
    primary.write(job_update(pb.Update.INSERT, 4), group_update(pb.Update.INSERT, 3, (1, 2)))
    broken = p4info_pb2.P4Info()
    broken.CopyFrom(P4INFO)
    del broken.tables[0]                                   # no job table
    with pytest.raises(grpc.RpcError) as info:
        primary.set_pipeline(broken)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "job_table" in info.value.details()
    assert [j.job_id for j in switch.read_jobs()] == [4]    # a rejected config changes nothing

    backup = connect()
    backup.arbitrate(1)
    with pytest.raises(grpc.RpcError) as info:
        backup.set_pipeline(P4INFO)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

    renumbered = p4info_pb2.P4Info()                       # same program, other ids (as p4c might)
    renumbered.CopyFrom(P4INFO)
    renumbered.tables[0].preamble.id = 0x02ABCDEF
    primary.set_pipeline(renumbered, cookie=77)
    assert switch.read_jobs() == [] and switch.read_mcast_groups() == []
    RT = pb.GetForwardingPipelineConfigRequest
    got = primary.stub.GetForwardingPipelineConfig(RT(device_id=1, response_type=RT.ALL),
                                                   timeout=RPC_TIMEOUT).config
    assert got.cookie.cookie == 77 and got.p4info.tables[0].preamble.id == 0x02ABCDEF
    assert got.p4_device_config == b"opaque-target-config"
    u = job_update(pb.Update.INSERT, 6)
    u.entity.table_entry.table_id = 0x02ABCDEF               # new ids are live
    primary.write(u)
    assert [j.job_id for j in switch.read_jobs()] == [6]


# ----------------------------------------------------------------------------- write / read
def test_job_table_round_trip(rig):
    switch, _, primary, _ = rig
    primary.write(job_update(pb.Update.INSERT, 3, fan_in=4, ps_port=9, mcast=2, level=1,
                             metadata=b"cookie"))
    assert list(switch.read_jobs()) == [JobEntry(job_id=3, fan_in=4, ps_port=9, mcast_group=2, level=1)]
    (entity,) = primary.read(table_read("job_table"))
    te = entity.table_entry
    assert te.table_id == TABLE["job_table"] and te.match[0].exact.value == b"\x03"
    params = {p.param_id: p.value for p in te.action.action.params}
    assert params == {_param_id("set_job", "fan_in"): b"\x04", _param_id("set_job", "ps_port"): b"\x09",
                      _param_id("set_job", "mcast_grp"): b"\x02", _param_id("set_job", "level"): b"\x01"}
    assert te.metadata == b"cookie"

    primary.write(job_update(pb.Update.MODIFY, 3, fan_in=32, ps_port=300, mcast=0x1234, level=0))
    assert list(switch.read_jobs()) == [JobEntry(3, 32, 300, 0x1234, 0)]
    primary.write(job_update(pb.Update.DELETE, 3))
    assert list(switch.read_jobs()) == []
    assert primary.read(table_read("job_table")) == []


def test_port_table_and_wildcard_table_read(rig):
    switch, _, primary, _ = rig
    primary.write(port_update(pb.Update.INSERT, 5, "127.0.0.2", 40001),
                  port_update(pb.Update.INSERT, 511, "127.0.0.3", 40002),
                  job_update(pb.Update.INSERT, 1))
    assert switch.read_ports() == {5: ("127.0.0.2", 40001), 511: ("127.0.0.3", 40002)}
    primary.write(port_update(pb.Update.MODIFY, 5, "127.0.0.4", 40003))
    assert switch.read_ports()[5] == ("127.0.0.4", 40003)
    entities = primary.read(table_read())                    # table_id 0: every table
    by_table = {}
    for e in entities:
        by_table.setdefault(e.table_entry.table_id, []).append(e.table_entry)
    assert len(by_table[TABLE["job_table"]]) == 1
    ports = {_p4int(t.match[0].exact.value): [_p4int(p.value) for p in t.action.action.params]
             for t in by_table[TABLE["port_table"]]}
    assert ports == {5: [0x7F000004, 40003], 511: [0x7F000003, 40002]}
    with pytest.raises(grpc.RpcError) as info:
        primary.write(port_update(pb.Update.INSERT, 5))
    assert [e.canonical_code for e in write_errors(info.value)] == [code_pb2.ALREADY_EXISTS]
    primary.write(port_update(pb.Update.DELETE, 511))
    assert set(switch.read_ports()) == {5}
    with pytest.raises(grpc.RpcError) as info:
        primary.write(port_update(pb.Update.MODIFY, 511))
    assert [e.canonical_code for e in write_errors(info.value)] == [code_pb2.NOT_FOUND]


def test_multicast_groups_round_trip(rig):
    switch, _, primary, _ = rig
    primary.write(group_update(pb.Update.INSERT, 7, (1, 2, 3)),
                  group_update(pb.Update.INSERT, 8, (4,), use_port_bytes=True))
    assert sorted(switch.read_mcast_groups(), key=lambda g: g.group_id) == \
        [MulticastGroup(7, (1, 2, 3)), MulticastGroup(8, (4,))]
    primary.write(group_update(pb.Update.MODIFY, 7, (5, 6)))
    read = pb.Entity()
    read.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 0
    got = {e.packet_replication_engine_entry.multicast_group_entry.multicast_group_id:
           [r.egress_port for r in e.packet_replication_engine_entry.multicast_group_entry.replicas]
           for e in primary.read(read)}
    assert got == {7: [5, 6], 8: [4]}
    primary.write(group_update(pb.Update.DELETE, 8))
    assert [g.group_id for g in switch.read_mcast_groups()] == [7]
    with pytest.raises(grpc.RpcError) as info:
        primary.write(group_update(pb.Update.INSERT, 0, (1,)),        # group 0 is invalid
                      group_update(pb.Update.INSERT, 9, (1, 1)),      # duplicate replica
                      group_update(pb.Update.DELETE, 8))              # already gone
    assert [e.canonical_code for e in write_errors(info.value)] == \
        [code_pb2.INVALID_ARGUMENT, code_pb2.INVALID_ARGUMENT, code_pb2.NOT_FOUND]


def test_duplicate_insert_reports_already_exists_per_update(rig):
    switch, _, primary, _ = rig
    primary.write(job_update(pb.Update.INSERT, 2))
    with pytest.raises(grpc.RpcError) as info:
        primary.write(job_update(pb.Update.INSERT, 9),                 # fine
                      job_update(pb.Update.INSERT, 2),                 # duplicate
                      job_update(pb.Update.MODIFY, 44))                # absent
    errors = write_errors(info.value)
    assert [e.canonical_code for e in errors] == \
        [code_pb2.OK, code_pb2.ALREADY_EXISTS, code_pb2.NOT_FOUND]
    assert errors[0].message == "" and "2" in errors[1].message
    assert sorted(j.job_id for j in switch.read_jobs()) == [2, 9]    # continue-on-error


def test_padded_and_out_of_range_bytestrings(rig):
    switch, _, primary, _ = rig
    primary.write(job_update(pb.Update.INSERT, b"\x00\x00\x05", fan_in=b"\x00\x02",
                             ps_port=b"\x00\x01\x02", mcast=b"\x00\x00\x00\x09", level=b"\x00"))
    assert list(switch.read_jobs()) == [JobEntry(5, 2, 0x102, 9, 0)]
    (entity,) = primary.read(table_read("job_table"))
    assert entity.table_entry.match[0].exact.value == b"\x05"          # answered canonically
    assert sorted(p.value for p in entity.table_entry.action.action.params) == \
        sorted([b"\x02", b"\x01\x02", b"\x09", b"\x00"])
    with pytest.raises(grpc.RpcError) as info:
        primary.write(job_update(pb.Update.INSERT, b"\x01\x05"),        # 261 > 8 bits
                      job_update(pb.Update.INSERT, 6, fan_in=64),       # 64 > 6 bits
                      job_update(pb.Update.INSERT, b""),                # empty
                      job_update(pb.Update.INSERT, 7, level=2))         # 2 > 1 bit
    assert [e.canonical_code for e in write_errors(info.value)] == [code_pb2.OUT_OF_RANGE] * 4
    assert [j.job_id for j in switch.read_jobs()] == [5]


def test_malformed_table_entries_are_invalid(rig):
    _, _, primary, _ = rig
    no_action = job_update(pb.Update.INSERT, 1)
    no_action.entity.table_entry.ClearField("action")
    wrong_action = job_update(pb.Update.INSERT, 1)
    wrong_action.entity.table_entry.action.action.action_id = ACTION["drop_packet"].preamble.id
    missing_param = job_update(pb.Update.INSERT, 1)
    del missing_param.entity.table_entry.action.action.params[-1]
    priority = job_update(pb.Update.INSERT, 1)
    priority.entity.table_entry.priority = 5
    unknown_table = job_update(pb.Update.INSERT, 1)
    unknown_table.entity.table_entry.table_id = 0x02000099
    default = job_update(pb.Update.MODIFY, 1)
    default.entity.table_entry.is_default_action = True
    with pytest.raises(grpc.RpcError) as info:
        primary.write(no_action, wrong_action, missing_param, priority, unknown_table, default)
    assert [e.canonical_code for e in write_errors(info.value)] == [
        code_pb2.INVALID_ARGUMENT, code_pb2.INVALID_ARGUMENT, code_pb2.INVALID_ARGUMENT,
        code_pb2.INVALID_ARGUMENT, code_pb2.NOT_FOUND, code_pb2.PERMISSION_DENIED]


def test_write_needs_the_primary_election_id(rig):
    switch, _, primary, _ = rig
    for eid in (None, 9, 11):
        with pytest.raises(grpc.RpcError) as info:
            primary.write(job_update(pb.Update.INSERT, 1), election_id=eid)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "grpc-status-details-bin" not in dict(info.value.trailing_metadata() or ())
    assert list(switch.read_jobs()) == []


def test_ecn_threshold_register(rig):
    switch, _, primary, _ = rig
    primary.write(register_update("ecn_threshold", b"\x00\x01\x00"))
    assert switch.ecn_threshold() == 256
    read = pb.Entity()
    read.register_entry.register_id = REGISTER["ecn_threshold"]
    (entity,) = primary.read(read)
    assert entity.register_entry.data.bitstring == b"\x01\x00"
    assert entity.register_entry.index.index == 0
    with pytest.raises(grpc.RpcError) as info:
        primary.write(register_update("ecn_threshold", (1 << 19).to_bytes(3, "big")),
                      register_update("ecn_threshold", b"\x05", index=1),
                      register_update("agg_bitmap", b"\x05"))
    assert [e.canonical_code for e in write_errors(info.value)] == \
        [code_pb2.OUT_OF_RANGE, code_pb2.OUT_OF_RANGE, code_pb2.UNIMPLEMENTED]
    assert switch.ecn_threshold() == 256


def test_counters_read(rig):
    switch, _, primary, _ = rig
    expected = switch.counters()
    if isinstance(switch, FakeSwitch):
        for i, name in enumerate(COUNTER_NAMES):
            switch.bump(name, 10 + i)
            expected[name] += 10 + i
    everything = primary.read(pb.Entity(counter_entry=pb.CounterEntry()))
    alias_by_id = {v: k for k, v in COUNTER.items()}
    got = {alias_by_id[e.counter_entry.counter_id]: e.counter_entry.data.packet_count
           for e in everything}
    assert got == expected
    one = pb.Entity(counter_entry=pb.CounterEntry(counter_id=COUNTER["collisions"]))
    one.counter_entry.index.index = 0
    (entity,) = primary.read(one)
    assert entity.counter_entry.data.packet_count == expected["collisions"]
    one.counter_entry.index.index = 1
    with pytest.raises(grpc.RpcError) as info:
        primary.read(one)
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_aggregator_registers_return_planted_state():
    switch = FakeSwitch(num_aggregators=16, value_count=4)
    switch.plant(5, job_seq=(7 << 24) | 99, bitmap=0b1011, counter=3, ecn=True, timestamp=12.5,
                 values=[1, -2, 2**31 - 1, -(2**31)])
    with serve(switch, 0) as server:
        client = Client(server.address)
        try:
            def reg(alias, index=None):
                e = pb.Entity()
                e.register_entry.register_id = REGISTER[alias]
                if index is not None:
                    e.register_entry.index.index = index
                return [(x.register_entry.index.index, _p4int(x.register_entry.data.bitstring))
                        for x in client.read(e)]

            assert reg("agg_job_seq", 5) == [(5, (7 << 24) | 99)]
            assert reg("agg_bitmap", 5) == [(5, 0b1011)]
            assert reg("agg_counter", 5) == [(5, 3)]
            assert reg("agg_ecn", 5) == [(5, 1)]
            assert reg("agg_timestamp", 5) == [(5, 12_500_000)]
            lanes = reg("agg_values")                       # wildcard: 16 slots x 4 lanes
            assert len(lanes) == 64 and [i for i, _ in lanes] == list(range(64))
            assert [v for i, v in lanes if 20 <= i < 24] == \
                [1, 2**32 - 2, 2**31 - 1, 2**31]             # two's complement bit<32>
            assert all(v == 0 for i, v in lanes if not 20 <= i < 24)
            assert len(reg("agg_bitmap")) == 16             # the live switch size, not the P4Info's
            for alias, index in (("agg_bitmap", 16), ("agg_values", 64)):
                with pytest.raises(grpc.RpcError) as info:
                    reg(alias, index)
                assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
        finally:
            client.close()


def _gradient(job_id: int, seq: int, bitmap0: int, agg_index: int, values, fan_in0: int) -> bytes:
    """An ATP gradient packet built from the wire layout documented in innet/wire.py."""
    flags_word = (fan_in0 % 32) << 11 | (1 << 6)            # fan_in1 = 1, no flag bits
    head = struct.pack("!IIHHI", bitmap0, 1, flags_word, agg_index, (job_id << 24) | seq)
    return head + np.asarray(values, ">i4").tobytes()


def test_software_switch_aggregator_state_over_p4runtime():
    switch = _make_software()
    with serve(switch, 0) as server:
        client = Client(server.address)
        try:
            assert client.arbitrate(1).arbitration.status.code == code_pb2.OK
            client.write(job_update(pb.Update.INSERT, 3, fan_in=2, ps_port=1, mcast=1, level=0),
                         port_update(pb.Update.INSERT, 1, "127.0.0.1", 40000))
            out = switch.process(_gradient(3, 17, 0b01, 6, [5, -6, 7, 8], 2), 2, time.monotonic())
            assert out == [] and switch.counters()["rejected"] == 1     # port 2 is no member yet
            client.write(member_update(pb.Update.INSERT, 3, 2))
            assert list(switch.read_members()) == [(3, 2)]
            e = pb.Entity()
            e.table_entry.table_id = TABLE["member_table"]
            assert [decode_uint(x.table_entry.match[0].exact.value, 32, "member")
                    for x in client.read(e)] == [3 << 24 | 2]
            out = switch.process(_gradient(3, 17, 0b01, 6, [5, -6, 7, 8], 2), 2, time.monotonic())
            assert out == []                                 # absorbed, waiting for the 2nd worker
            e = pb.Entity()
            e.register_entry.register_id = REGISTER["agg_values"]
            got = [_p4int(x.register_entry.data.bitstring) for x in client.read(e)][24:28]
            assert got == [5, 2**32 - 6, 7, 8]
            for alias, want in (("agg_job_seq", (3 << 24) | 17), ("agg_bitmap", 1), ("agg_counter", 1)):
                e = pb.Entity()
                e.register_entry.register_id = REGISTER[alias]
                e.register_entry.index.index = 6
                (x,) = client.read(e)
                assert _p4int(x.register_entry.data.bitstring) == want, alias
            counters = {c.counter_entry.counter_id: c.counter_entry.data.packet_count
                        for c in client.read(pb.Entity(counter_entry=pb.CounterEntry()))}
            assert counters[COUNTER["aggregated"]] == 1
        finally:
            client.close()


def test_capabilities_and_unsupported_reads(rig):
    _, _, primary, _ = rig
    version = primary.stub.Capabilities(pb.CapabilitiesRequest(), timeout=RPC_TIMEOUT)
    assert version.p4runtime_api_version.count(".") == 2
    with pytest.raises(grpc.RpcError) as info:
        primary.read(pb.Entity(meter_entry=pb.MeterEntry(meter_id=1)))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as info:
        primary.read(pb.Entity(table_entry=pb.TableEntry(table_id=0x02000099)))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_serve_rejects_a_foreign_p4info(tmp_path):
    bad = tmp_path / "other.p4info.txtpb"
    bad.write_text('pkg_info { name: "other" }\ntables { preamble { id: 33554433 name: "t" } }\n')
    with pytest.raises(ValueError, match="job_table"):
        serve(FakeSwitch(), 0, p4info_path=bad)


def test_roles_have_independent_primaries():
    switch = FakeSwitch()
    server = serve(switch, 0)
    default, monitor = Client(server.address), Client(server.address)
    try:
        assert default.arbitrate(9).arbitration.status.code == code_pb2.OK
        upd = monitor.arbitrate(1, role="monitor").arbitration   # lower id, but another role
        assert upd.status.code == code_pb2.OK and upd.role.name == "monitor"
        monitor.write(job_update(pb.Update.INSERT, 1))
        default.write(job_update(pb.Update.INSERT, 2))
        assert sorted(j.job_id for j in switch.read_jobs()) == [1, 2]
        monitor.role = "nobody"
        with pytest.raises(grpc.RpcError) as info:
            monitor.write(job_update(pb.Update.INSERT, 3))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        default.close()
        monitor.close()
        server.stop(grace=0)


def test_serve_reports_a_busy_port():
    with serve(FakeSwitch(), 0) as server, pytest.raises(OSError):
        serve(FakeSwitch(), server.port)


def test_a_primary_that_vanishes_without_closing_is_noticed():
    server = serve(FakeSwitch(), 0)
    backup, primary = Client(server.address), Client(server.address)
    try:
        backup.arbitrate(1)
        assert primary.arbitrate(2).arbitration.status.code == code_pb2.OK
        assert backup.next().arbitration.status.code == code_pb2.ALREADY_EXISTS
        primary.channel.close()                      # no half-close: the connection just goes away
        assert backup.next().arbitration.status.code == code_pb2.NOT_FOUND
    finally:
        backup.close()
        server.stop(grace=0)


def test_p4runtime_protos_import_in_a_fresh_interpreter():
    """After ``import innet.p4runtime`` the stock module names work, whatever protobuf runtime is installed."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import innet.p4runtime\n"
            "from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc\n"
            "from p4.config.v1 import p4info_pb2\n"
            "print(p4runtime_pb2.Error(canonical_code=6).SerializeToString().hex(),"
            " p4info_pb2.P4Ids.TABLE, p4runtime_pb2_grpc.P4RuntimeStub.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0806", "2", "P4RuntimeStub"]
