"""The bootstrap wire protocol (twisternet.bootstrap): a master written against the documented protocol,
malformed tables, frames across arbitrary chunking, garbage and oversize frames."""

from __future__ import annotations

import socket
import threading

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from tests.twisternet.bootstrap_harness import FAST, TOKEN, Events
from twisternet.auth import handshake
from twisternet.bootstrap import MAX_MESSAGE, _FrameReader, encode_message, join
from twisternet.errors import ProtocolError

pytestmark = pytest.mark.timeout(60)


def fake_master(frames: bytes, hello: dict | None = None) -> tuple[str, threading.Thread]:
    """A one-shot master written against the documented protocol: handshake, then send ``frames``."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        srv.close()
        try:
            handshake(conn, TOKEN, initiator=False, hello=hello or {"kind": "master", "world": 2},
                      timeout=5)
            conn.sendall(frames)
            conn.settimeout(5)
            while conn.recv(4096):  # until the worker leaves
                pass
        except OSError:
            pass
        finally:
            conn.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"127.0.0.1:{srv.getsockname()[1]}", t


def test_messages_arriving_with_the_table_are_not_lost() -> None:
    table = [{"a": 1, "host_id": "h"}, {"b": 2, "host_id": "h"}]
    frames = b"".join(len(b).to_bytes(4, "big") + b for b in (
        msgpack.packb({"type": "table", "rank": 1, "world": 2, "table": table}),
        msgpack.packb({"type": "peer_lost", "rank": 0, "reason": "gone"})))
    addr, t = fake_master(frames)
    session = join(addr, TOKEN, listen={}, timeout=5, **FAST)
    assert (session.rank, session.world, session.table) == (1, 2, table)
    log = Events(session)
    assert log.wait_for(lambda e: e["type"] == "peer_lost", timeout=1)["rank"] == 0
    assert session.lost == {0}
    session.close()
    t.join(5)


@pytest.mark.parametrize("bad", [
    {"type": "table", "rank": 2, "world": 2, "table": [{}, {}]},
    {"type": "table", "rank": 0, "world": 2, "table": [{}]},
    {"type": "table", "rank": 0, "world": 2},
])
def test_malformed_table_is_a_protocol_error(bad: dict) -> None:
    body = msgpack.packb(bad)
    addr, t = fake_master(len(body).to_bytes(4, "big") + body)
    with pytest.raises(ProtocolError, match="malformed table"):
        join(addr, TOKEN, listen={}, timeout=5, **FAST)
    t.join(5)


def test_peer_that_is_not_a_master_is_refused() -> None:
    addr, t = fake_master(b"", hello={"kind": "worker"})
    with pytest.raises(ProtocolError, match="not a bootstrap master"):
        join(addr, TOKEN, listen={}, timeout=5, **FAST)
    t.join(5)


# ----------------------------------------------------------------------------------- wire format

messages = st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10), max_size=5)


@settings(max_examples=50, deadline=None)
@given(msgs=st.lists(messages, max_size=6), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_frames_round_trip_across_arbitrary_chunking(msgs: list[dict], cuts: list[int]) -> None:
    stream = b"".join(encode_message(m) for m in msgs)
    # independent check of the frame layout: u32 big-endian length + msgpack
    if msgs:
        n = int.from_bytes(stream[:4], "big")
        assert msgpack.unpackb(stream[4:4 + n], raw=False) == msgs[0]
    reader = _FrameReader()
    got: list[dict] = []
    prev = 0
    for c in sorted(min(c, len(stream)) for c in cuts) + [len(stream)]:
        got += reader.feed(stream[prev:c])
        prev = c
    assert got == msgs


@settings(max_examples=100, deadline=None)
@given(junk=st.binary(min_size=1, max_size=200))
def test_frame_garbage_is_a_protocol_error_or_incomplete(junk: bytes) -> None:
    reader = _FrameReader()
    try:
        out = reader.feed(junk)
    except ProtocolError:
        return
    for m in out:  # anything accepted must be a real map that the length prefix delimited
        assert isinstance(m, dict)


def test_oversize_frame_is_refused() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        _FrameReader().feed((MAX_MESSAGE + 1).to_bytes(4, "big"))
    with pytest.raises(ProtocolError, match="map"):
        _FrameReader().feed(encode_message({})[:0] + (1).to_bytes(4, "big") + msgpack.packb(7))
