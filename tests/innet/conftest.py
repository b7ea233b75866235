"""Fixtures of the innet tests: ``rig`` is a P4Runtime server over each switch of
``tests.innet.p4runtime_client.SWITCHES`` with a primary client already arbitrated."""

from __future__ import annotations

import pytest

from innet.p4runtime import serve
from innet.p4runtime.protos import code_pb2
from tests.innet.p4runtime_client import SWITCHES, Client


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

