"""ATP-style in-network aggregation: wire format, software switch, worker and parameter-server stack.

The pieces: ``wire`` (the packet), ``switch`` (the dataplane, implementing ``control.SwitchControl``),
``switch_server`` (the UDP switch process), ``worker`` and ``ps`` (the end hosts), ``quantize``,
``transport`` (UDP with loss injection), ``service`` (``InnetJob.allreduce`` and launch helpers),
``lifeline`` (helpers end with their parent), ``tokens`` (the switch's P4Runtime token) and
``controller`` / ``p4runtime`` (the control plane). Security model: docs/innet-security.md.
"""

from .control import (AggregatorState, AlreadyExists, ControlError, InvalidArgument, JobEntry,
                      MulticastGroup, NotFound, ResourceExhausted, SwitchControl)
from .ps import ParameterServer, PSJobConfig, PSJobStats, PSThread
from .quantize import Quantizer, error_bound
from .service import (DEFAULT_SCALE, InnetCluster, InnetJob, InnetService, JobSpec, free_udp_port,
                      innet_allreduce, start_switch, switch_config, SwitchProcess)
from .switch import COUNTER_NAMES, SoftwareSwitch
from .switch_server import SwitchServer, SwitchThread, apply_config
from .transport import LossConfig, UdpTransport
from .wire import DEFAULT_VALUE_COUNT, Packet, WireError, decode, decode_batch, encode
from .worker import AtpWorker, WorkerStats

__all__ = [
    "AggregatorState", "AlreadyExists", "ControlError", "InvalidArgument", "JobEntry", "MulticastGroup",
    "NotFound", "ResourceExhausted", "SwitchControl",
    "ParameterServer", "PSJobConfig", "PSJobStats", "PSThread", "Quantizer", "error_bound",
    "DEFAULT_SCALE", "InnetCluster", "InnetJob", "InnetService", "JobSpec", "free_udp_port",
    "innet_allreduce", "start_switch", "switch_config", "SwitchProcess", "COUNTER_NAMES", "SoftwareSwitch",
    "SwitchServer", "SwitchThread",
    "apply_config", "LossConfig", "UdpTransport", "DEFAULT_VALUE_COUNT", "Packet", "WireError", "decode",
    "decode_batch", "encode", "AtpWorker", "WorkerStats",
]
