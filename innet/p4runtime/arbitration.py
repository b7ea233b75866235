"""Client arbitration (P4Runtime spec, "Client Arbitration and Controller Replication").

One primary per (device, role): the live controller whose election id equals the highest id the server
has ever seen for that role. Controllers without an election id are permanent backups. Every change of
primary (or a primary leaving) is announced to all controllers of the role with a MasterArbitrationUpdate
whose status is OK for the primary, ALREADY_EXISTS for backups while a primary exists, NOT_FOUND when
there is none. Stream-terminating errors are raised as P4RuntimeError.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from collections.abc import Callable

from .errors import P4RuntimeError, invalid_argument, not_found, permission_denied
from .protos import code_pb2, p4runtime_pb2

logger = logging.getLogger(__name__)

Send = Callable[[p4runtime_pb2.StreamMessageResponse], None]


def election_id_of(msg) -> int | None:
    """The 128-bit election id of a message with an ``election_id`` field, None when unset."""
    if not msg.HasField("election_id"):
        return None
    return (msg.election_id.high << 64) | msg.election_id.low


@dataclass
class _Controller:
    stream_id: int
    role: str
    election_id: int | None
    send: Send


@dataclass
class _Role:
    controllers: dict[int, _Controller] = field(default_factory=dict)
    highest: int | None = None        # highest election id ever seen for this role
    primary: int | None = None        # stream id of the primary


class Arbitrator:
    """Tracks controllers per role on one device and decides who may write."""

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self._lock = threading.RLock()
        self._roles: dict[str, _Role] = {"": _Role()}
        self._by_stream: dict[int, _Controller] = {}

    def update(self, stream_id: int, msg: p4runtime_pb2.MasterArbitrationUpdate, send: Send) -> None:
        """Apply a MasterArbitrationUpdate received on ``stream_id``; answers go out through ``send``."""
        role_name = msg.role.name if msg.HasField("role") else ""
        eid = election_id_of(msg)
        with self._lock:
            known = self._by_stream.get(stream_id)
            if known is None:
                if msg.device_id != self.device_id:
                    raise not_found(f"unknown device_id {msg.device_id} (this switch is device "
                                    f"{self.device_id})")
            else:
                if msg.device_id != self.device_id:
                    raise P4RuntimeError(code_pb2.FAILED_PRECONDITION,
                                         "device_id differs from the one of this stream")
                if role_name != known.role:
                    raise P4RuntimeError(code_pb2.FAILED_PRECONDITION,
                                         "role differs from the one of this stream; open a new stream")
            if msg.HasField("role") and msg.role.HasField("config"):
                raise invalid_argument("role.config is not supported: roles have full pipeline access")
            role = self._roles.setdefault(role_name, _Role())
            if eid is not None and any(c.election_id == eid and c.stream_id != stream_id
                                       for c in role.controllers.values()):
                raise invalid_argument(f"election_id {eid} is already used by another controller")
            if known is None:
                known = _Controller(stream_id, role_name, eid, send)
                self._by_stream[stream_id] = known
                role.controllers[stream_id] = known
            known.election_id = eid
            was_primary = role.primary == stream_id
            if eid is not None and (role.highest is None or eid >= role.highest):
                role.highest = eid
                role.primary = stream_id
                logger.info("controller %d is primary for role '%s' (election id %d)",
                            stream_id, role_name, eid)
                self._notify(role_name, role, None)
            else:
                if was_primary:
                    role.primary = None
                    self._notify(role_name, role, None)
                else:
                    self._notify(role_name, role, stream_id)

    def remove(self, stream_id: int) -> None:
        """Forget a controller whose stream ended; announce it if it was the primary."""
        with self._lock:
            ctl = self._by_stream.pop(stream_id, None)
            if ctl is None:
                return
            role = self._roles[ctl.role]
            role.controllers.pop(stream_id, None)
            if role.primary == stream_id:
                role.primary = None
                logger.info("primary controller %d of role '%s' left", stream_id, ctl.role)
                self._notify(ctl.role, role, None)

    def check_primary(self, device_id: int, role_name: str, election_id: int | None) -> None:
        """Raise NOT_FOUND / PERMISSION_DENIED unless (device, role, election id) is the primary."""
        if device_id != self.device_id:
            raise not_found(f"unknown device_id {device_id} (this switch is device {self.device_id})")
        with self._lock:
            role = self._roles.get(role_name)
            if role is None:
                raise not_found(f"unknown role '{role_name}'")
            primary = role.controllers.get(role.primary) if role.primary is not None else None
            if primary is None or election_id is None or primary.election_id != election_id:
                raise permission_denied("only the primary controller may change the switch "
                                        "(open a StreamChannel and win arbitration first)")

    def is_primary(self, stream_id: int) -> bool:
        with self._lock:
            ctl = self._by_stream.get(stream_id)
            return ctl is not None and self._roles[ctl.role].primary == stream_id

    def _notify(self, role_name: str, role: _Role, only: int | None) -> None:
        for ctl in list(role.controllers.values()):
            if only is not None and ctl.stream_id != only:
                continue
            resp = p4runtime_pb2.StreamMessageResponse()
            upd = resp.arbitration
            upd.device_id = self.device_id
            if role_name:
                upd.role.name = role_name
            if role.highest is not None:
                upd.election_id.high = role.highest >> 64
                upd.election_id.low = role.highest & ((1 << 64) - 1)
            if role.primary == ctl.stream_id:
                upd.status.code = code_pb2.OK
                upd.status.message = "you are the primary controller"
            elif role.primary is not None:
                upd.status.code = code_pb2.ALREADY_EXISTS
                upd.status.message = "another controller is primary; you are a backup"
            else:
                upd.status.code = code_pb2.NOT_FOUND
                upd.status.message = "there is no primary controller; you are a backup"
            ctl.send(resp)
