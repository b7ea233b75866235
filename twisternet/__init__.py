"""twisternet: dataflow collectives (reduce, gather, partition, broadcast; streaming and batch, keyed or
not) between processes, over TCP or MPI, with in-network aggregation and coflow scheduling.

Start with :func:`init`; the operations live in the ``collectives`` package.
"""

from .channel import Channel, register_channel
from .codec import Codec, KeyCodec
from .config import Config, load_config
from .context import Context, SendHandle
from .errors import (AuthError, BackPressureTimeout, ClosedError, CodecError, ConfigError, OperationTimeout,
                     PeerLostError, ProtocolError, TwisternetError)
from .functional import all_gather, all_reduce, barrier, broadcast, gather, reduce
from .runtime import init
from .task_plan import TaskPlan

__version__ = "0.1.0"

__all__ = [
    "init", "all_reduce", "broadcast", "reduce", "all_gather", "gather", "barrier",
    "Context", "SendHandle", "Config", "load_config", "TaskPlan", "Codec", "KeyCodec", "Channel",
    "register_channel", "TwisternetError", "ConfigError", "CodecError", "ProtocolError", "AuthError",
    "PeerLostError", "OperationTimeout", "BackPressureTimeout", "ClosedError", "__version__",
]
