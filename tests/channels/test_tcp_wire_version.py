"""Peer links refuse a peer of another frame protocol version (a rank running an older twisternet would
not read a DATA_CREDIT frame), with an error that says so, on the dialling and on the accepting side."""

from __future__ import annotations

import socket
import threading

import pytest

from channels.tcp import build_mesh
from channels.tcp.wire import WIRE_VERSION
from twisternet.auth import handshake
from twisternet.config import Config
from twisternet.errors import OperationTimeout

TOKEN = b"t" * 16


def _table(port0: int, port1: int) -> list[dict]:
    return [{"host_id": "hostA/boot/1", "tcp_host": "127.0.0.1", "tcp_port": port0},
            {"host_id": "hostA/boot/1", "tcp_host": "127.0.0.1", "tcp_port": port1}]


def _old_peer_accepts(listener: socket.socket, done: threading.Event) -> None:
    try:
        sock, _ = listener.accept()
        with sock:
            handshake(sock, TOKEN, initiator=False, hello={"rank": 0, "world": 2}, timeout=20)
            sock.settimeout(20)
            assert sock.recv(1) == b""
    finally:
        done.set()


@pytest.mark.parametrize("hello_version", [None, WIRE_VERSION + 1])
def test_an_accepted_peer_of_another_frame_version_is_refused_and_named(hello_version) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def old() -> None:
        try:
            with socket.create_connection(listener.getsockname(), timeout=20) as s:
                hello = {"rank": 1, "world": 2}
                if hello_version is not None:
                    hello["wire"] = hello_version
                handshake(s, TOKEN, initiator=True, hello=hello, timeout=20)
                s.settimeout(20)
                assert s.recv(1) == b""
        finally:
            done.set()

    t = threading.Thread(target=old, daemon=True)
    t.start()
    try:
        with pytest.raises(OperationTimeout) as err:
            build_mesh(0, 2, _table(listener.getsockname()[1], 1), [listener], TOKEN,
                       Config(connect_timeout=3.0, force_tcp=True))
        text = str(err.value)
        want = 1 if hello_version is None else hello_version
        assert f"speaks the TCP channel's frame protocol version {want}, this process speaks {WIRE_VERSION}" in text
        assert done.wait(20)
    finally:
        listener.close()
        t.join(20)


def test_a_dialled_peer_of_an_older_frame_version_is_refused_and_named() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()
    t = threading.Thread(target=_old_peer_accepts, args=(listener, done), daemon=True)
    t.start()
    try:
        with pytest.raises(OperationTimeout) as err:
            build_mesh(1, 2, _table(listener.getsockname()[1], 1), [], TOKEN,
                       Config(connect_timeout=3.0, force_tcp=True))
        assert f"rank 0 speaks the TCP channel's frame protocol version 1, this process speaks {WIRE_VERSION}" \
            in str(err.value)
        assert done.wait(20)
    finally:
        listener.close()
        t.join(20)
