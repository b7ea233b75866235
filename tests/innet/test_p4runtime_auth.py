"""The P4Runtime server's token check: every call without the token is UNAUTHENTICATED; controllers
with it work; the switch process gets the token on stdin, never on its command line or environment."""

from __future__ import annotations

import queue
from pathlib import Path

import grpc
import pytest

from innet.control import JobEntry, MulticastGroup
from innet.controller import ControllerError, P4RuntimeController
from innet.p4runtime import serve
from innet.p4runtime.auth import METADATA_KEY, authenticated_channel, p4runtime_token
from innet.p4runtime.protos import p4runtime_pb2 as pb, p4runtime_pb2_grpc
from innet.switch import SoftwareSwitch

pytestmark = pytest.mark.timeout(120)
TOKEN = p4runtime_token(b"job token of the test")


def _calls(stub):
    """One call of every kind the service has (unary, server-streaming, bidirectional stream)."""
    def read():
        req = pb.ReadRequest(device_id=1)
        req.entities.add().register_entry.register_id = 0
        return list(stub.Read(req, timeout=10))

    def write():
        u = pb.Update(type=pb.Update.INSERT)
        u.entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 9
        req = pb.WriteRequest(device_id=1, updates=[u])
        req.election_id.low = 1
        return stub.Write(req, timeout=10)

    def stream():
        q: queue.Queue = queue.Queue()
        req = pb.StreamMessageRequest()
        req.arbitration.device_id = 1
        req.arbitration.election_id.low = 1 << 60
        q.put(req)
        responses = stub.StreamChannel(iter(q.get, None), timeout=10)
        try:
            return next(responses)
        finally:
            q.put(None)
            responses.cancel()

    return {
        "Capabilities": lambda: stub.Capabilities(pb.CapabilitiesRequest(), timeout=10),
        "GetForwardingPipelineConfig": lambda: stub.GetForwardingPipelineConfig(
            pb.GetForwardingPipelineConfigRequest(device_id=1), timeout=10),
        "Read": read, "Write": write, "StreamChannel": stream,
    }


@pytest.fixture
def guarded():
    switch = SoftwareSwitch(num_aggregators=16, value_count=4)
    switch.insert_job(JobEntry(5, 2, 3, 5))
    switch.insert_mcast_group(MulticastGroup(5, (1, 2)))
    server = serve(switch, 0, token=TOKEN)
    try:
        yield switch, server
    finally:
        server.stop(grace=0)


@pytest.mark.parametrize("token", [None, "wrong", TOKEN[:-1], " "], ids=["none", "wrong", "prefix", "blank"])
def test_every_call_without_the_token_is_unauthenticated(guarded, token) -> None:
    switch, server = guarded
    with authenticated_channel(server.address, token) as channel:
        for name, call in _calls(p4runtime_pb2_grpc.P4RuntimeStub(channel)).items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    # nothing was read or changed, and nobody became primary
    assert list(switch.read_mcast_groups()) == [MulticastGroup(5, (1, 2))]
    assert not any(server.service.arbitrator.is_primary(i) for i in range(1, 20))


def test_calls_with_the_token_work(guarded) -> None:
    switch, server = guarded
    with authenticated_channel(server.address, TOKEN) as channel:
        calls = _calls(p4runtime_pb2_grpc.P4RuntimeStub(channel))
        assert calls["Capabilities"]().p4runtime_api_version
        assert calls["StreamChannel"]().arbitration.device_id == 1
        calls["Read"]()
    ctl = P4RuntimeController(server.address, timeout=5.0, token=TOKEN)
    assert ctl.job_ids() == {5}
    placement = ctl.place_job(ctl.free_job_id(), [("127.0.0.1", 40001)], ("127.0.0.1", 40002))
    assert placement.job_id in ctl.job_ids()
    with pytest.raises(ControllerError, match="token"):
        P4RuntimeController(server.address, timeout=5.0).job_ids()


def test_token_is_derived_from_the_job_token() -> None:
    assert p4runtime_token(b"a") == p4runtime_token(b"a") != p4runtime_token(b"b")
    assert len(p4runtime_token(b"a")) == 64 and METADATA_KEY == "authorization"
    with pytest.raises(ValueError):
        p4runtime_token(b"")


def test_switch_process_gets_the_token_on_stdin_only(monkeypatch) -> None:
    from innet.service import start_switch
    monkeypatch.setenv("TWISTERNET_TOKEN", "the job token")
    sw = start_switch(p4runtime_token=TOKEN)
    try:
        pid = sw.proc.pid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert TOKEN.encode() not in cmdline and TOKEN.encode() not in environ
        assert b"TWISTERNET_TOKEN" not in environ and b"the job token" not in environ
        addr = f"{sw.p4runtime_addr[0]}:{sw.p4runtime_addr[1]}"
        assert P4RuntimeController(addr, timeout=10.0, token=TOKEN).job_ids() == set()
        with pytest.raises(ControllerError, match="token"):
            P4RuntimeController(addr, timeout=10.0).job_ids()
        assert sw.p4runtime_addr[0] == "127.0.0.1"          # bound to loopback, as asked
    finally:
        sw.close()
    assert sw.proc.returncode is not None
