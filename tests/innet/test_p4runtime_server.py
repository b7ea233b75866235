"""The P4Runtime server as a service: capabilities and unsupported reads, a busy port, and the stock
proto module names after import innet.p4runtime.

Every test that takes ``rig`` runs against the in-memory FakeSwitch and innet.switch.SoftwareSwitch.
Expected values come from the test's own inputs (or from the switch's SwitchControl view), never from
the server's answers.
"""

from __future__ import annotations

import grpc
import pytest

from innet.p4runtime import serve
from innet.p4runtime.protos import p4runtime_pb2 as pb

from tests.innet.fake_switch import FakeSwitch
from tests.innet.p4runtime_client import RPC_TIMEOUT

pytestmark = pytest.mark.timeout(60)


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


def test_serve_reports_a_busy_port():
    with serve(FakeSwitch(), 0) as server, pytest.raises(OSError):
        serve(FakeSwitch(), server.port)


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
