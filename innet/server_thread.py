"""A server loop (the parameter server, the software switch) in a daemon thread of this process, for
tests and demos: :class:`~innet.ps.PSThread` and :class:`~innet.switch_server.SwitchThread` are this."""

from __future__ import annotations

import threading
from typing import Protocol, TypeVar

_T = TypeVar("_T", bound="ServerThread")


class _Server(Protocol):
    @property
    def address(self) -> tuple[str, int]: ...
    def run(self) -> None: ...
    def stop(self) -> None: ...


class ServerThread:
    """Runs ``server.run()`` in a daemon thread named ``name`` from :meth:`start` until :meth:`stop`; a
    context manager (started on entry, stopped on exit)."""

    def __init__(self, server: _Server, name: str) -> None:
        self._server = server
        self._thread = threading.Thread(target=server.run, name=name, daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        """Where the server listens."""
        return self._server.address

    def start(self: _T) -> _T:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and close the socket (the server "dies": its port becomes unreachable)."""
        self._server.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self: _T) -> _T:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
