"""Tests of the job-token handshake (twisternet.auth): round trip, refusals, timeouts, garbage."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from twisternet.auth import MAGIC, MAX_HELLO, NONCE_SIZE, VERSION, handshake
from twisternet.errors import AuthError, ProtocolError

pytestmark = pytest.mark.timeout(30)

TOKEN = b"correct horse battery staple"


def run_both(a_token: bytes, b_token: bytes, a_hello: dict | None = None, b_hello: dict | None = None,
             timeout: float = 2.0, tcp: bool = False):
    """Handshake between two sockets in two threads; returns (initiator result, acceptor result),
    each either the returned hello or the raised exception."""
    if tcp:
        with socket.create_server(("127.0.0.1", 0)) as srv:
            a = socket.create_connection(srv.getsockname())
            b, _ = srv.accept()
    else:
        a, b = socket.socketpair()
    results: dict[str, object] = {}

    def side(name: str, sock: socket.socket, token: bytes, initiator: bool, hello: dict) -> None:
        try:
            results[name] = handshake(sock, token, initiator=initiator, hello=hello, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - recorded for the assertions
            results[name] = e

    ta = threading.Thread(target=side, args=("a", a, a_token, True, a_hello or {"who": "a"}))
    tb = threading.Thread(target=side, args=("b", b, b_token, False, b_hello or {"who": "b"}))
    ta.start(), tb.start()
    ta.join(10), tb.join(10)
    a.close(), b.close()
    return results["a"], results["b"]


@pytest.mark.parametrize("tcp", [False, True])
def test_round_trip_returns_peer_hello(tcp: bool) -> None:
    ha = {"rank": 3, "listen": {"tcp": "127.0.0.1:1234"}, "blob": b"\x00\xff"}
    hb = {"kind": "master", "world": 8}
    ra, rb = run_both(TOKEN, TOKEN, ha, hb, tcp=tcp)
    assert ra == hb
    assert rb == ha


def test_restores_socket_timeout_and_blocking_mode() -> None:
    a, b = socket.socketpair()
    a.settimeout(7.5)
    b.setblocking(False)
    t = threading.Thread(target=handshake, args=(b, TOKEN), kwargs=dict(initiator=False, hello={}, timeout=2))
    t.start()
    handshake(a, TOKEN, initiator=True, hello={}, timeout=2)
    t.join(5)
    assert a.gettimeout() == 7.5
    assert b.gettimeout() == 0.0
    a.close(), b.close()


@pytest.mark.parametrize("wrong_side", ["initiator", "acceptor"])
def test_wrong_token_fails_on_both_sides(wrong_side: str) -> None:
    bad = b"another token entirely"
    ra, rb = run_both(bad if wrong_side == "initiator" else TOKEN, bad if wrong_side == "acceptor" else TOKEN)
    assert isinstance(ra, AuthError), ra
    assert isinstance(rb, AuthError), rb


def test_silent_peer_times_out_within_handshake_timeout() -> None:
    a, b = socket.socketpair()
    t0 = time.monotonic()
    with pytest.raises(AuthError, match="timed out"):
        handshake(a, TOKEN, initiator=False, hello={}, timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    a.close(), b.close()


def test_trickling_peer_cannot_extend_the_deadline() -> None:
    """A peer sending one valid byte at a time still meets the total timeout."""
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        data = MAGIC + bytes([VERSION]) + os.urandom(NONCE_SIZE) + os.urandom(40)
        for byte in data:
            if stop.wait(0.1):
                return
            try:
                b.send(bytes([byte]))
            except OSError:
                return
    t = threading.Thread(target=trickle)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(AuthError):
        handshake(a, TOKEN, initiator=False, hello={}, timeout=1.0)
    assert time.monotonic() - t0 < 2.0
    stop.set()
    t.join(5)
    a.close(), b.close()


def test_bad_magic_and_version_are_protocol_errors() -> None:
    for opening in (b"HTTP/1.1 200 OK\r\n" + bytes(20), MAGIC + bytes([VERSION + 1]) + bytes(NONCE_SIZE)):
        a, b = socket.socketpair()
        b.sendall(opening)
        with pytest.raises(ProtocolError):
            handshake(a, TOKEN, initiator=True, hello={}, timeout=2)
        a.close(), b.close()


def test_eof_is_a_protocol_error() -> None:
    a, b = socket.socketpair()
    b.sendall(MAGIC[:2])
    b.shutdown(socket.SHUT_WR)  # half-close: our sends succeed, our reads hit EOF
    with pytest.raises(ProtocolError, match="closed"):
        handshake(a, TOKEN, initiator=True, hello={}, timeout=2)
    a.close(), b.close()
    a, b = socket.socketpair()
    b.close()  # fully gone: whichever of send/recv notices first, it is a ProtocolError
    with pytest.raises(ProtocolError):
        handshake(a, TOKEN, initiator=True, hello={}, timeout=2)
    a.close()


def _raw_peer_opening(sock: socket.socket) -> bytes:
    """Act as a raw peer: send an opening with a fresh nonce, read and return the victim's opening."""
    sock.sendall(MAGIC + bytes([VERSION]) + os.urandom(NONCE_SIZE))
    got = b""
    while len(got) < 5 + NONCE_SIZE:
        got += sock.recv(5 + NONCE_SIZE - len(got))
    return got


def test_reflected_mac_is_rejected() -> None:
    """A peer without the token that bounces the victim's own proof back must fail (role binding)."""
    a, b = socket.socketpair()

    def reflector() -> None:
        _raw_peer_opening(b)
        header = b""
        while len(header) < 36:
            header += b.recv(36 - len(header))
        (length,) = struct.unpack("!I", header[32:])
        body = b""
        while len(body) < length:
            body += b.recv(length - len(body))
        b.sendall(header + body)  # the victim's own MAC and hello, echoed
    t = threading.Thread(target=reflector)
    t.start()
    with pytest.raises(AuthError):
        handshake(a, TOKEN, initiator=False, hello={"x": 1}, timeout=2)
    t.join(5)
    a.close(), b.close()


def _token_holder(sock: socket.socket, *, mac_over: bytes, send: bytes, role: bytes = b"acceptor",
                  token: bytes = TOKEN) -> None:
    """A raw peer holding ``token`` that follows the documented MAC construction (independent of the
    module) over ``mac_over`` but sends ``send`` as its hello."""
    my_nonce = os.urandom(NONCE_SIZE)
    sock.sendall(MAGIC + bytes([VERSION]) + my_nonce)
    op = b""
    while len(op) < 5 + NONCE_SIZE:
        op += sock.recv(5 + NONCE_SIZE - len(op))
    their_nonce = op[5:]
    nonces = their_nonce + my_nonce if role == b"acceptor" else my_nonce + their_nonce
    msg = b"twisternet-auth-v1\x00" + role + b"\x00" + nonces + hashlib.sha256(mac_over).digest()
    mac = hmac.new(token, msg, hashlib.sha256).digest()
    sock.sendall(mac + struct.pack("!I", len(send)) + send)


def test_independent_peer_is_accepted() -> None:
    """The wire format matches its documentation: an independently written peer passes."""
    a, b = socket.socketpair()
    body = msgpack.packb({"independent": True})
    t = threading.Thread(target=_token_holder, args=(b,), kwargs=dict(mac_over=body, send=body))
    t.start()
    assert handshake(a, TOKEN, initiator=True, hello={}, timeout=2) == {"independent": True}
    t.join(5)
    a.close(), b.close()


def test_mac_bound_to_hello() -> None:
    """A valid MAC followed by a different hello (tampering in flight) is refused."""
    a, b = socket.socketpair()
    t = threading.Thread(target=_token_holder, args=(b,),
                         kwargs=dict(mac_over=msgpack.packb({"rank": 1}), send=msgpack.packb({"rank": 2})))
    t.start()
    with pytest.raises(AuthError):
        handshake(a, TOKEN, initiator=True, hello={}, timeout=2)
    t.join(5)
    a.close(), b.close()


def test_mac_with_wrong_role_is_refused() -> None:
    """A MAC computed for the initiator role does not pass as the acceptor's."""
    a, b = socket.socketpair()
    body = msgpack.packb({})
    t = threading.Thread(target=_token_holder, args=(b,),
                         kwargs=dict(mac_over=body, send=body, role=b"initiator"))
    t.start()
    with pytest.raises(AuthError):
        handshake(a, TOKEN, initiator=True, hello={}, timeout=2)
    t.join(5)
    a.close(), b.close()


def test_oversize_hello_rejected() -> None:
    a, b = socket.socketpair()

    def liar() -> None:
        _raw_peer_opening(b)
        b.sendall(os.urandom(32) + struct.pack("!I", MAX_HELLO + 1))
    t = threading.Thread(target=liar)
    t.start()
    with pytest.raises(ProtocolError, match="exceeds"):
        handshake(a, TOKEN, initiator=True, hello={}, timeout=2)
    t.join(5)
    a.close(), b.close()
    with pytest.raises(ValueError, match="limit"):
        handshake(socket.socketpair()[0], TOKEN, initiator=True, hello={"big": b"x" * (MAX_HELLO + 1)},
                  timeout=1)


def test_hello_that_is_not_a_map_is_protocol_error_even_with_valid_mac() -> None:
    a, b = socket.socketpair()
    body = msgpack.packb([1, 2, 3])
    t = threading.Thread(target=_token_holder, args=(b,), kwargs=dict(mac_over=body, send=body))
    t.start()
    with pytest.raises(ProtocolError, match="map"):
        handshake(a, TOKEN, initiator=True, hello={}, timeout=2)
    t.join(5)
    a.close(), b.close()


def test_bad_arguments() -> None:
    a, b = socket.socketpair()
    with pytest.raises(TypeError):
        handshake(a, b"", initiator=True, hello={}, timeout=1)
    with pytest.raises(TypeError):
        handshake(a, "text", initiator=True, hello={}, timeout=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        handshake(a, TOKEN, initiator=True, hello=[1], timeout=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        handshake(a, TOKEN, initiator=True, hello={}, timeout=0)
    a.close(), b.close()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbage=st.binary(max_size=400), valid_opening=st.booleans(), close=st.booleans(),
       initiator=st.booleans())
def test_random_garbage_never_hangs_and_never_passes(garbage: bytes, valid_opening: bool, close: bool,
                                                     initiator: bool) -> None:
    a, b = socket.socketpair()
    try:
        prefix = MAGIC + bytes([VERSION]) + os.urandom(NONCE_SIZE) if valid_opening else b""
        b.sendall(prefix + garbage)
        if close:
            b.shutdown(socket.SHUT_WR)
        t0 = time.monotonic()
        with pytest.raises((AuthError, ProtocolError)):
            handshake(a, TOKEN, initiator=initiator, hello={"k": 1}, timeout=0.15)
        assert time.monotonic() - t0 < 1.15
    finally:
        a.close(), b.close()


# --- token rules (twisternet.tokens): weak tokens and readable token files are refused ---------------

from twisternet import cli
from twisternet.config import load_config
from twisternet.errors import ConfigError
from twisternet.tokens import WeakTokenError, new_token, token_problem


@pytest.mark.parametrize("weak", ["password", "password1234", "Password!2024", "aaaaaaaaaaaaaaaaaaaa",
                                  "abababababababab", "hunter2", "letmein-letmein", "changeme12345",
                                  "1234567890123"])
def test_a_weak_token_in_the_environment_is_refused_with_the_reason_and_the_remedy(weak):
    with pytest.raises(ConfigError) as e:
        load_config(env={"TWISTERNET_TOKEN": weak})
    assert e.value.key == "token"
    text = str(e.value)
    assert "too weak" in text and "twisternet token" in text and "secrets.token_hex(32)" in text


def test_the_launchers_tokens_and_the_tests_tokens_are_good_enough():
    for good in (new_token(), "correct horse battery staple", "bootstrap-test-token",
                 "worker-command-token", "env-token-12345", "wrong-token-0123456789"):
        assert token_problem(good) is None, good
        assert load_config(env={"TWISTERNET_TOKEN": good}).token == good


def test_the_worker_command_refuses_a_weak_token(monkeypatch, capsys, tmp_path):
    script = tmp_path / "w.py"
    script.write_text("print('ran')\n")
    monkeypatch.setenv("TWISTERNET_TOKEN", "password")
    assert cli.main(["worker", "--master", "127.0.0.1:9", str(script)]) == 1
    err = capsys.readouterr().err
    assert "TWISTERNET_TOKEN is too weak" in err and "twisternet token" in err


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_token_file_others_may_read_is_refused(tmp_path, mode):
    path = tmp_path / "token"
    path.write_text(new_token() + "\n")
    path.chmod(mode)
    with pytest.raises(WeakTokenError) as e:
        cli.read_or_create_token(path)
    assert f"chmod 600 {path}" in str(e.value)
    path.chmod(0o600)
    assert cli.read_or_create_token(path)[1] is False


def test_a_weak_token_in_a_private_file_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("password12\n")
    path.chmod(0o600)
    with pytest.raises(WeakTokenError, match="too weak"):
        cli.read_or_create_token(path)


def test_twisternet_token_prints_or_writes_a_fresh_private_token(tmp_path, capsys):
    assert cli.main(["token"]) == 0
    printed = capsys.readouterr().out.strip()
    assert len(printed) == 64 and int(printed, 16) >= 0 and token_problem(printed) is None
    path = tmp_path / "job.token"
    assert cli.main(["token", "--file", str(path)]) == 0
    assert (path.stat().st_mode & 0o777) == 0o600
    assert token_problem(path.read_text().strip()) is None
    assert cli.main(["token", "--file", str(path)]) == 1      # never overwrites
