"""The control server of a standing parameter server: jobs placed on a PS that runs on a host of its own.

ATP's PS is a server of the cluster, not one of the workers: a PS on a worker's host doubles the bytes
through that host's link (the switch's aggregates come in and the parameter packets go out beside the
worker's own gradients and results). ``twisternet ps --host A --values V --control-port C
--control-token-file F`` runs such a PS; the first rank of an ``AllReduce(via="innet")`` whose config
names it (``innet_ps``, with a shared switch) registers its job there instead of starting a PS of its own,
and removes it when the operation closes.

Protocol: one TCP connection per request, one JSON line each way. The request carries the token (the
job's derived in-network token, ``innet.tokens.p4runtime_token``, as the switch's P4Runtime server
holds it) and an ``op``: ``info`` (answer: the PS's UDP ``address`` and packet width ``values``), ``add``
(``job``: job_id, world, scale, switch, workers, keep; refused if the id is taken) or ``remove``
(``job_id``). Answers are ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. A wrong token, a
line over 1 MB or a silent client for 10 s ends the connection with an error answer. At most
:data:`MAX_CONNECTIONS` connections are served at once (a thread each); more are closed at once, so held
connections cannot pile up threads.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import socketserver
import threading
from typing import Any
from collections.abc import Mapping

__all__ = ["PSControlError", "PSControlServer", "ps_request"]

log = logging.getLogger(__name__)

_MAX_LINE = 1 << 20
_TIMEOUT = 10.0
#: Connections served at once; the ones past it are closed unanswered (requests are one line each, and
#: the first rank of a job makes one at a time).
MAX_CONNECTIONS = 32


class PSControlError(RuntimeError):
    """The standing PS refused a request or could not be reached."""


class PSControlServer:
    """Serves the control requests of one :class:`innet.ps.ParameterServer` on ``host:port``."""

    def __init__(self, ps: Any, host: str, port: int, token: str) -> None:
        if not token:
            raise ValueError("a PS control server needs a token")
        self.ps, self.token = ps, token
        #: Connections closed unanswered because MAX_CONNECTIONS were being served.
        self.refused = 0
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = _TIMEOUT

            def handle(self) -> None:
                try:
                    line = self.rfile.readline(_MAX_LINE + 1)
                    answer = outer._answer(line)
                except (OSError, ValueError, KeyError, TypeError) as e:
                    answer = {"ok": False, "error": f"bad request: {type(e).__name__}: {e}"}
                try:
                    self.wfile.write((json.dumps(answer) + "\n").encode())
                except OSError:
                    pass

        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request: Any, client_address: Any) -> None:
                if not slots.acquire(blocking=False):
                    outer.refused += 1
                    if outer.refused in (1, 10, 100) or outer.refused % 1000 == 0:
                        log.warning("PS control: %d connections refused (over %d at once)", outer.refused,
                                    MAX_CONNECTIONS)
                    self.shutdown_request(request)
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        self._server = Server((host, port), Handler)
        bound = self._server.server_address
        self.address: tuple[str, int] = (str(bound[0]), int(bound[1]))
        self._thread = threading.Thread(target=self._server.serve_forever, name="ps-control", daemon=True)
        self._thread.start()

    def _answer(self, line: bytes) -> dict[str, Any]:
        from .ps import job_config_from_dict
        if len(line) > _MAX_LINE or not line.endswith(b"\n"):
            return {"ok": False, "error": "request too long or not a line"}
        req = json.loads(line)
        if not isinstance(req, dict) or not hmac.compare_digest(str(req.get("token", "")).encode(),
                                                                self.token.encode()):
            log.warning("PS control: request with a wrong token refused")
            return {"ok": False, "error": "wrong token"}
        op = req.get("op")
        if op == "info":
            return {"ok": True, "address": list(self.ps.address), "values": self.ps.value_count}
        if op == "add":
            cfg = job_config_from_dict(req["job"])
            if self.ps.has_job(cfg.job_id):
                return {"ok": False, "error": f"job id {cfg.job_id} is served already"}
            self.ps.add_job(cfg)
            log.info("PS control: job %d added (%d workers)", cfg.job_id, cfg.world)
            return {"ok": True}
        if op == "remove":
            self.ps.remove_job(int(req["job_id"]))
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def ps_request(address: tuple[str, int], token: str, op: str, timeout: float = _TIMEOUT,
               **fields: Any) -> Mapping[str, Any]:
    """Send one request to a standing PS's control server; its answer, or PSControlError."""
    req = {"token": token, "op": op, **fields}
    try:
        with socket.create_connection(address, timeout=timeout) as s:
            s.sendall((json.dumps(req) + "\n").encode())
            with s.makefile("rb") as f:
                line = f.readline(_MAX_LINE + 1)
    except OSError as e:
        raise PSControlError(f"parameter server control at {address[0]}:{address[1]}: {e}") from None
    try:
        answer = json.loads(line)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise PSControlError(f"parameter server control at {address[0]}:{address[1]} gave no answer")
    if not answer.get("ok"):
        raise PSControlError(f"parameter server at {address[0]}:{address[1]} refused {op}: "
                             f"{answer.get('error')}")
    return answer
