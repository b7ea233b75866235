"""P4Runtime registers and counters: the ECN threshold, counter reads, and aggregator registers that
show the dataplane state (planted in the fake, or made by real packets in the software switch).

Every test that takes ``rig`` runs against the in-memory FakeSwitch and innet.switch.SoftwareSwitch.
Expected values come from the test's own inputs (or from the switch's SwitchControl view), never from
the server's answers.
"""

from __future__ import annotations

import struct
import time

import grpc
import numpy as np
import pytest

from innet.p4runtime import serve
from innet.p4runtime.bytestrings import decode_uint
from innet.p4runtime.protos import code_pb2, p4runtime_pb2 as pb

from tests.innet.fake_switch import COUNTER_NAMES, FakeSwitch
from tests.innet.p4runtime_client import (COUNTER, REGISTER, TABLE, Client, _make_software, _p4int,
                                          job_update, member_update, port_update, register_update,
                                          write_errors)

pytestmark = pytest.mark.timeout(60)


def test_ecn_threshold_register(rig):
    switch, _, primary, _ = rig
    primary.write(register_update("ecn_threshold", b"\x00\x01\x00"))
    assert switch.ecn_threshold() == 256
    read = pb.Entity()
    read.register_entry.register_id = REGISTER["ecn_threshold"]
    (entity,) = primary.read(read)
    assert entity.register_entry.data.bitstring == b"\x01\x00"
    assert entity.register_entry.index.index == 0
    with pytest.raises(grpc.RpcError) as info:
        primary.write(register_update("ecn_threshold", (1 << 19).to_bytes(3, "big")),
                      register_update("ecn_threshold", b"\x05", index=1),
                      register_update("agg_bitmap", b"\x05"))
    assert [e.canonical_code for e in write_errors(info.value)] == \
        [code_pb2.OUT_OF_RANGE, code_pb2.OUT_OF_RANGE, code_pb2.UNIMPLEMENTED]
    assert switch.ecn_threshold() == 256


def test_counters_read(rig):
    switch, _, primary, _ = rig
    expected = switch.counters()
    if isinstance(switch, FakeSwitch):
        for i, name in enumerate(COUNTER_NAMES):
            switch.bump(name, 10 + i)
            expected[name] += 10 + i
    everything = primary.read(pb.Entity(counter_entry=pb.CounterEntry()))
    alias_by_id = {v: k for k, v in COUNTER.items()}
    got = {alias_by_id[e.counter_entry.counter_id]: e.counter_entry.data.packet_count
           for e in everything}
    assert got == expected
    one = pb.Entity(counter_entry=pb.CounterEntry(counter_id=COUNTER["collisions"]))
    one.counter_entry.index.index = 0
    (entity,) = primary.read(one)
    assert entity.counter_entry.data.packet_count == expected["collisions"]
    one.counter_entry.index.index = 1
    with pytest.raises(grpc.RpcError) as info:
        primary.read(one)
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE


def test_aggregator_registers_return_planted_state():
    switch = FakeSwitch(num_aggregators=16, value_count=4)
    switch.plant(5, job_seq=(7 << 24) | 99, bitmap=0b1011, counter=3, ecn=True, timestamp=12.5,
                 values=[1, -2, 2**31 - 1, -(2**31)])
    with serve(switch, 0) as server:
        client = Client(server.address)
        try:
            def reg(alias, index=None):
                e = pb.Entity()
                e.register_entry.register_id = REGISTER[alias]
                if index is not None:
                    e.register_entry.index.index = index
                return [(x.register_entry.index.index, _p4int(x.register_entry.data.bitstring))
                        for x in client.read(e)]

            assert reg("agg_job_seq", 5) == [(5, (7 << 24) | 99)]
            assert reg("agg_bitmap", 5) == [(5, 0b1011)]
            assert reg("agg_counter", 5) == [(5, 3)]
            assert reg("agg_ecn", 5) == [(5, 1)]
            assert reg("agg_timestamp", 5) == [(5, 12_500_000)]
            lanes = reg("agg_values")                       # wildcard: 16 slots x 4 lanes
            assert len(lanes) == 64 and [i for i, _ in lanes] == list(range(64))
            assert [v for i, v in lanes if 20 <= i < 24] == \
                [1, 2**32 - 2, 2**31 - 1, 2**31]             # two's complement bit<32>
            assert all(v == 0 for i, v in lanes if not 20 <= i < 24)
            assert len(reg("agg_bitmap")) == 16             # the live switch size, not the P4Info's
            for alias, index in (("agg_bitmap", 16), ("agg_values", 64)):
                with pytest.raises(grpc.RpcError) as info:
                    reg(alias, index)
                assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
        finally:
            client.close()


def _gradient(job_id: int, seq: int, bitmap0: int, agg_index: int, values, fan_in0: int) -> bytes:
    """An ATP gradient packet built from the wire layout documented in innet/wire.py."""
    flags_word = (fan_in0 % 32) << 11 | (1 << 6)            # fan_in1 = 1, no flag bits
    head = struct.pack("!IIHHI", bitmap0, 1, flags_word, agg_index, (job_id << 24) | seq)
    return head + np.asarray(values, ">i4").tobytes()


def test_software_switch_aggregator_state_over_p4runtime():
    switch = _make_software()
    with serve(switch, 0) as server:
        client = Client(server.address)
        try:
            assert client.arbitrate(1).arbitration.status.code == code_pb2.OK
            client.write(job_update(pb.Update.INSERT, 3, fan_in=2, ps_port=1, mcast=1, level=0),
                         port_update(pb.Update.INSERT, 1, "127.0.0.1", 40000))
            out = switch.process(_gradient(3, 17, 0b01, 6, [5, -6, 7, 8], 2), 2, time.monotonic())
            assert out == [] and switch.counters()["rejected"] == 1     # port 2 is no member yet
            client.write(member_update(pb.Update.INSERT, 3, 2))
            assert list(switch.read_members()) == [(3, 2)]
            e = pb.Entity()
            e.table_entry.table_id = TABLE["member_table"]
            assert [decode_uint(x.table_entry.match[0].exact.value, 32, "member")
                    for x in client.read(e)] == [3 << 24 | 2]
            out = switch.process(_gradient(3, 17, 0b01, 6, [5, -6, 7, 8], 2), 2, time.monotonic())
            assert out == []                                 # absorbed, waiting for the 2nd worker
            e = pb.Entity()
            e.register_entry.register_id = REGISTER["agg_values"]
            got = [_p4int(x.register_entry.data.bitstring) for x in client.read(e)][24:28]
            assert got == [5, 2**32 - 6, 7, 8]
            for alias, want in (("agg_job_seq", (3 << 24) | 17), ("agg_bitmap", 1), ("agg_counter", 1)):
                e = pb.Entity()
                e.register_entry.register_id = REGISTER[alias]
                e.register_entry.index.index = 6
                (x,) = client.read(e)
                assert _p4int(x.register_entry.data.bitstring) == want, alias
            counters = {c.counter_entry.counter_id: c.counter_entry.data.packet_count
                        for c in client.read(pb.Entity(counter_entry=pb.CounterEntry()))}
            assert counters[COUNTER["aggregated"]] == 1
        finally:
            client.close()
