"""twisternet for PyTorch: the "twisternet" ``torch.distributed`` backend and a DDP comm hook.

Importing this package registers the backend with ``torch.distributed.Backend.register_backend``, so::

    import twisternet.torch
    torch.distributed.init_process_group(backend="twisternet")     # under torchrun
    twisternet.torch.init_process_group()                          # any launcher tn.init() knows

``allreduce_hook`` is a ``DistributedDataParallel.register_comm_hook`` hook that averages gradient
buckets through twisternet while the model's process group stays gloo. See docs/torch.md.
"""

from .backend import VIA_ENV, init_process_group, register
from .group import BACKEND_NAME, ProcessGroupTwisternet
from .hook import allreduce_hook
from .tensors import TorchBackendError

register()

__all__ = ["BACKEND_NAME", "VIA_ENV", "ProcessGroupTwisternet", "TorchBackendError", "init_process_group",
           "register", "allreduce_hook"]
