"""The P4Runtime server's Write and Read of the job, port and multicast tables: round trips, wildcard
reads, duplicate inserts, bytestrings, malformed entries and the primary's election id.

Every test that takes ``rig`` runs against the in-memory FakeSwitch and innet.switch.SoftwareSwitch.
Expected values come from the test's own inputs (or from the switch's SwitchControl view), never from
the server's answers.
"""

from __future__ import annotations

import grpc
import pytest

from innet.control import JobEntry, MulticastGroup
from innet.p4runtime.protos import code_pb2, p4runtime_pb2 as pb

from tests.innet.p4runtime_client import (ACTION, TABLE, _p4int, _param_id, group_update, job_update,
                                          port_update, table_read, write_errors)

pytestmark = pytest.mark.timeout(60)


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
