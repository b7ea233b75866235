"""P4Runtime master arbitration: primary and backup, handover, stream errors, roles with independent
primaries, and a primary that vanishes without closing.

Every test that takes ``rig`` runs against the in-memory FakeSwitch and innet.switch.SoftwareSwitch.
Expected values come from the test's own inputs (or from the switch's SwitchControl view), never from
the server's answers.
"""

from __future__ import annotations

import grpc
import pytest

from innet.p4runtime import serve
from innet.p4runtime.protos import code_pb2, p4runtime_pb2 as pb

from tests.innet.fake_switch import FakeSwitch
from tests.innet.p4runtime_client import (SWITCHES, Client, job_update)

pytestmark = pytest.mark.timeout(60)


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
