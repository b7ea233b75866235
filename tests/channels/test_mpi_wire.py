"""Pure parts of the MPI channel, without any MPI: launcher detection, wire encodings, segmenting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import channels.mpi as mpich
from channels.mpi import wire
from twisternet.errors import ProtocolError

ROOT = Path(__file__).resolve().parents[2]


# --- launcher detection --------------------------------------------------------------------------

@pytest.mark.parametrize("env", [
    {"PMI_RANK": "0", "PMI_SIZE": "4", "PMI_FD": "9"},          # MPICH hydra (as set by this mpiexec)
    {"HYDI_CONTROL_FD": "7"},                                    # hydra proxy
    {"PMIX_RANK": "2", "PMIX_NAMESPACE": "job"},                 # PMIx (Open MPI 5, Slurm)
    {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},  # Open MPI
    {"MV2_COMM_WORLD_RANK": "0"},                                # MVAPICH
    {"MPI_LOCALNRANKS": "2"},
])
def test_detects_launchers(env: dict[str, str]) -> None:
    assert mpich.under_mpi_launcher({"PATH": "/bin", **env})


@pytest.mark.parametrize("env", [
    {},
    {"PATH": "/bin", "HOME": "/root"},
    {"HYDRA_HOST_FILE": "/etc/hosts.mpi", "HYDRA_LAUNCHER": "ssh"},  # user config, not a job
    {"PMI_RANK": ""},
])
def test_no_launcher(env: dict[str, str]) -> None:
    assert not mpich.under_mpi_launcher(env)


def test_launch_info() -> None:
    assert mpich.mpi_launch_info({"PMI_RANK": "3", "PMI_SIZE": "8"}) == (3, 8)
    assert mpich.mpi_launch_info({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}) == (1, 2)
    assert mpich.mpi_launch_info({"PMI_RANK": "3"}) is None
    assert mpich.mpi_launch_info({"PMI_RANK": "x", "PMI_SIZE": "2"}) is None


def test_detection_under_real_mpiexec(mpiexec: str) -> None:
    code = "import sys, channels.mpi as m; print(m.under_mpi_launcher(), m.mpi_launch_info(), 'mpi4py' in sys.modules)"
    out = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", code], cwd=ROOT, timeout=60,
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split("\n")[:2]) == ["True (0, 2) False", "True (1, 2) False"]


def test_import_does_not_initialise_mpi() -> None:
    code = "import sys, channels.mpi; assert 'mpi4py' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# --- control messages ------------------------------------------------------------------------------

edges = st.integers(0, (1 << 31) - 1)
counts = st.integers(0, (1 << 63) - 1)


@given(st.lists(st.tuples(edges, counts), max_size=800))
def test_credit_roundtrip(items: list[tuple[int, int]]) -> None:
    msgs = wire._encode_credit(items)
    assert all(len(m) <= wire._CTRL_BUF_SIZE for m in msgs)
    decoded = []
    for m in msgs:
        buf = bytearray(wire._CTRL_BUF_SIZE)  # as received: in a fixed-size buffer
        buf[:len(m)] = m
        kind, body = wire._decode_ctrl(buf)
        assert kind == wire._KIND_CREDIT
        decoded.extend(body)
    assert decoded == items


@given(st.text(max_size=5000))
def test_abort_notice_roundtrip(reason: str) -> None:
    msg = wire._encode_abort(reason)
    assert len(msg) <= wire._CTRL_BUF_SIZE
    kind, text = wire._decode_ctrl(msg)
    assert kind == wire._KIND_ABORT
    assert reason.encode("utf-8", "replace").decode("utf-8", "replace").startswith(text)
    if len(reason.encode("utf-8", "replace")) <= wire._CTRL_BUF_SIZE - 8:
        assert text == reason.encode("utf-8", "replace").decode("utf-8")


@given(st.binary(max_size=64))
def test_garbage_control_message_is_a_protocol_error_or_valid(data: bytes) -> None:
    try:
        kind, _ = wire._decode_ctrl(data)
    except ProtocolError:
        return
    assert kind in (wire._KIND_CREDIT, wire._KIND_ABORT, wire._KIND_OFFER, wire._KIND_SLOT_OFFER,
                    wire._KIND_SLOT_GRANT, wire._KIND_SLOT_RETIRE, wire._KIND_HEARTBEAT)


slot_ids = st.integers(0, (1 << 32) - 1)


@given(slot_ids, st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1), st.binary(min_size=16, max_size=16),
       st.text(min_size=1, max_size=200))
def test_slot_offer_roundtrip(slot: int, cap: int, size: int, nonce: bytes, name: str) -> None:
    offer = wire.shm_slots.Offer(slot, cap, size, nonce, "/dev/shm/" + name)
    msg = wire._encode_slot_offer(offer)
    buf = bytearray(wire._CTRL_BUF_SIZE)
    buf[:len(msg)] = msg
    assert wire._decode_ctrl(buf) == (wire._KIND_SLOT_OFFER, offer)
    with pytest.raises(ProtocolError):
        wire._decode_ctrl(msg[:-1])


def test_slot_offer_path_must_fit_a_control_buffer() -> None:
    with pytest.raises(ValueError, match="too long"):
        wire._encode_slot_offer(wire.shm_slots.Offer(1, 2, 3, b"n" * 16, "/dev/shm/" + "x" * 5000))


@given(st.sampled_from([wire._KIND_SLOT_GRANT, wire._KIND_SLOT_RETIRE]), st.lists(slot_ids, min_size=1, max_size=3000))
@settings(max_examples=50)
def test_slot_ids_roundtrip(kind: int, ids: list[int]) -> None:
    got = []
    for m in wire._encode_slot_ids(kind, ids):
        assert len(m) <= wire._CTRL_BUF_SIZE
        k, body = wire._decode_ctrl(m)
        assert k == kind
        got.extend(body)
        with pytest.raises(ProtocolError):
            wire._decode_ctrl(m[:-1])
    assert got == ids


@given(slot_ids, st.sampled_from(["ack", "refuse", "retired"]))
def test_slot_answer_is_a_data_header(slot: int, answer: str) -> None:
    kind, flags, page, edge, size = wire._HDR.unpack_from(wire._encode_slot_answer(slot, answer), 0)
    assert (kind, wire._ANSWERS[flags], page, edge, size) == (wire._KIND_SLOT_ANSWER, answer, 0, slot, 0)


@given(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1))
def test_pre_post_offer_roundtrip(first: int, cap: int) -> None:
    buf = bytearray(wire._CTRL_BUF_SIZE)
    msg = wire._encode_offer(first, cap)
    buf[:len(msg)] = msg
    assert wire._decode_ctrl(buf) == (wire._KIND_OFFER, (first, cap))
    with pytest.raises(ProtocolError):
        wire._decode_ctrl(msg[:-1])


@given(st.integers(1, 1 << 40))
def test_pre_post_capacity_fits_with_little_slack(n: int) -> None:
    cap = wire._pre_cap(n)
    assert n <= cap <= n + max(64 << 10, n // 8)
    assert wire._pre_cap(cap) == cap       # a payload of exactly the capacity gets the same offer


# --- rendezvous headers and segments ---------------------------------------------------------------

@given(edges, st.lists(st.integers(1, 1 << 40), min_size=1, max_size=50), st.integers(0, 4095),
       st.binary(max_size=64))
def test_rndv_header_roundtrip(edge: int, lengths: list[int], page: int, inline: bytes) -> None:
    hdr = wire._rndv_header(edge, sum(lengths), lengths, page, inline)
    kind, flags, got_page, got_edge, size = wire._HDR.unpack_from(hdr, 0)
    assert (kind, got_page, got_edge, size) == (wire._KIND_RNDV, page, edge, sum(lengths))
    assert flags == (wire._FLAG_INLINE if inline else 0)
    assert list(wire._rndv_lengths(hdr, size)) == lengths
    assert hdr[wire._HDR.size + 4 + 8 * len(lengths):] == inline
    with pytest.raises(ProtocolError):
        wire._rndv_lengths(hdr, size + 1)


part_sizes = st.lists(st.sampled_from([0, 1, 100, (64 << 10) - 1, 64 << 10, 200_000]), max_size=8)


@settings(max_examples=60, deadline=None)
@given(part_sizes, st.integers(0, 2**32 - 1))
def test_segments_concatenate_to_the_message(sizes: list[int], seed: int) -> None:
    import random
    rnd = random.Random(seed)
    parts = [bytes(rnd.getrandbits(8) for _ in range(min(n, 64))) * (n // 64) + bytes(n % 64) for n in sizes]
    views = [wire._byte_view(p) for p in parts]
    segs = wire._segments(views)
    assert b"".join(bytes(memoryview(s)) for s in segs) == b"".join(parts)
    assert all(memoryview(s).nbytes > 0 for s in segs)
    # large parts travel as themselves (zero copy); only small neighbours are joined
    big = [p for p in parts if len(p) >= wire._COALESCE]
    assert sum(1 for s in segs if memoryview(s).nbytes >= wire._COALESCE) >= len(big)
    for s in segs:
        if isinstance(s, memoryview) and s.nbytes >= wire._COALESCE:
            assert any(s.obj is p for p in parts)


def test_byte_view_flattens_and_rejects_non_contiguous() -> None:
    import numpy as np
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    v = wire._byte_view(a)
    assert v.nbytes == 96 and v.format == "B" and bytes(v) == a.tobytes()
    with pytest.raises(TypeError, match="contiguous"):
        wire._byte_view(a[:, ::2])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(1, 2**40)), min_size=1,
                max_size=wire._PIGGY_MAX), st.binary(max_size=64))
def test_piggybacked_credit_roundtrip(items: list[tuple[int, int]], body: bytes) -> None:
    """Credit riding on an eager message: entries come back, and the payload starts right after them."""
    msg = (wire._HDR.pack(wire._KIND_EAGER, wire._FLAG_CREDIT, 0, 3, len(body)) + wire._encode_piggy(items)
           + body)
    off, got = wire._decode_piggy(msg, len(body), peer=1)
    assert got == items
    assert msg[off:off + len(body)] == body


@pytest.mark.parametrize("count", [0, wire._PIGGY_MAX + 1, 3])
def test_malformed_piggybacked_credit_is_a_protocol_error(count: int) -> None:
    """A count of 0, above the limit, or more entries than the message holds is refused."""
    msg = wire._HDR.pack(wire._KIND_EAGER, wire._FLAG_CREDIT, 0, 3, 10) + wire._U32.pack(count) + b"\0" * 20
    with pytest.raises(ProtocolError):
        wire._decode_piggy(msg, 10, peer=1)
