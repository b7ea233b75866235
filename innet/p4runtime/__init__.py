"""P4Runtime control plane of the ATP switch: a gRPC server over any ``innet.control.SwitchControl``.

``serve(switch, port)`` exposes the switch to P4Runtime controllers (p4runtime-shell, ONOS, raw gRPC)
with the ATP P4Info in ``innet/p4/atp.p4info.txtpb``; ``bindings`` lists which P4 object maps to which
control call. Example, with p4runtime-shell in its own environment::

    server = serve(switch, 9559, token=token)    # in the switch process (--p4runtime-port)

    sys.path.insert(0, "<repo>/innet/p4runtime")  # in the controller: every call carries the token
    import shell_token; shell_token.install(token)
    import p4runtime_sh.shell as sh
    sh.setup(device_id=1, grpc_addr="127.0.0.1:9559", election_id=(0, 1))
    te = sh.TableEntry("job_table")(action="set_job")
    te.match["job_id"] = "3"
    te.action["fan_in"] = "4"; te.action["ps_port"] = "9"
    te.action["mcast_grp"] = "2"; te.action["level"] = "0"
    te.insert()
    sh.MulticastGroupEntry(2).add(1).add(5).insert()
    sh.teardown()

Calls without the token are refused with UNAUTHENTICATED (``auth``; docs/innet-security.md).
Importing this package also makes the stock ``p4.v1.p4runtime_pb2`` modules usable under protobuf >= 4
(see ``protos``).
"""

from .bindings import COUNTERS, REGISTERS, TABLES
from .errors import P4RuntimeError
from .schema import DEFAULT_P4INFO_PATH, AtpSchema, load_p4info
from .server import P4RuntimeService, Server, serve

__all__ = [
    "serve", "Server", "P4RuntimeService", "P4RuntimeError", "AtpSchema", "load_p4info",
    "DEFAULT_P4INFO_PATH", "TABLES", "COUNTERS", "REGISTERS",
]
