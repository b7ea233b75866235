"""Bootstrap: a master process gathers every worker's listen addresses into one table, then watches them.

``master`` serves the job (``roster`` while it assembles, ``service_host`` once it runs); a worker
calls :func:`join` and keeps the returned :class:`MasterSession`; ``wire`` is the framing of a master
link and ``addresses`` the host and address helpers both sides use.
"""

from __future__ import annotations

from .addresses import (
           host_id,
           local_address_for,
           parse_address,
           rank_places,
           route_to_master,
)
from .join import join
from .admission import MAX_PENDING_HANDSHAKES
from .master import SERVICES_ENTRY, Master, install_job_services
from .session import MasterSession
from .wire import MAX_MESSAGE, FrameReader, encode_message
from .wire import FrameReader as _FrameReader  # noqa: F401  (the name the tests know)

__all__ = ["MAX_MESSAGE", "MAX_PENDING_HANDSHAKES", "SERVICES_ENTRY", "FrameReader", "Master", "MasterSession",
           "encode_message", "host_id", "install_job_services", "join", "local_address_for", "parse_address",
           "rank_places", "route_to_master"]
