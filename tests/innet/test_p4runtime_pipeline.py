"""P4Runtime pipeline config: Get returns the loaded P4Info, Set validates, commits and clears state,
and serve() refuses a foreign P4Info.

Every test that takes ``rig`` runs against the in-memory FakeSwitch and innet.switch.SoftwareSwitch.
Expected values come from the test's own inputs (or from the switch's SwitchControl view), never from
the server's answers.
"""

from __future__ import annotations

import grpc
import pytest

from innet.p4runtime import serve
from innet.p4runtime.protos import p4info_pb2, p4runtime_pb2 as pb
from innet.p4runtime.schema import packet_values, with_packet_values

from tests.innet.fake_switch import FakeSwitch
from tests.innet.p4runtime_client import (P4INFO, RPC_TIMEOUT, group_update, job_update)

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- pipeline config
def test_get_pipeline_returns_the_loaded_p4info(rig):
    switch, _, primary, _ = rig
    RT = pb.GetForwardingPipelineConfigRequest
    resp = primary.stub.GetForwardingPipelineConfig(
        RT(device_id=1, response_type=RT.P4INFO_AND_COOKIE), timeout=RPC_TIMEOUT)
    # the loaded P4Info, its agg_values sized for this switch's packet width (the rig's: 4 values)
    assert switch.value_count == 4 and packet_values(P4INFO) == 62
    assert resp.config.p4info == with_packet_values(P4INFO, switch.value_count)
    assert packet_values(resp.config.p4info) == 4
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


def test_serve_rejects_a_foreign_p4info(tmp_path):
    bad = tmp_path / "other.p4info.txtpb"
    bad.write_text('pkg_info { name: "other" }\ntables { preamble { id: 33554433 name: "t" } }\n')
    with pytest.raises(ValueError, match="job_table"):
        serve(FakeSwitch(), 0, p4info_path=bad)
