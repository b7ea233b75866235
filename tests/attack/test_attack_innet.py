"""Attacks on a running in-network (ATP) job from another local process: floods, forgeries, P4Runtime.

The job: a software switch and a parameter server (threads of this process, so their counters can be
read) and the job's workers (threads), through real UDP sockets on loopback. The attacker is a separate
process that knows everything but the token: the job id, the sequence numbers (they are predictable),
the aggregator index function, every UDP port. It sends, for a bounded time and count, loopback only:

* garbage datagrams (random lengths and bytes, and full-length packets of the reserved job 0);
* forged parameter (result/ACK) packets of the job for every sequence number a call can use, with the
  right aggregator indices and bitmaps, to the switch (which would multicast them) and to the workers;
* forged gradient packets claiming to be rank 0 (huge values) to the switch and to the PS.

The results must be bit-exact (equal to the same calls without the attack), every forged packet
dropped and counted, and the job must not leak threads or memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest

from innet import InnetCluster, JobSpec, error_bound
from tests.innet.rank_threads import run_ranks

ROOT = Path(__file__).resolve().parents[2]
JOB = 17
WORLD = 3
SIZE = 60_000                     # floats per call: 968 fragments of 62 values
FLOOD_SECONDS = 4.0
FLOOD_PACKETS = 400_000           # upper bound of the attacker's datagrams (count and time are both bounded)

ATTACKER = textwrap.dedent('''
    import json, os, socket, sys, time
    import numpy as np
    from innet.wire import Packet, encode
    from innet.worker import aggregator_index

    cfg = json.loads(sys.argv[1])
    job, world, n_agg, V = cfg["job"], cfg["world"], cfg["aggregators"], cfg["values"]
    switch, ps = tuple(cfg["switch"]), tuple(cfg["ps"])
    workers = [tuple(w) for w in cfg["workers"]]
    rng = np.random.default_rng(7)
    forged = []
    for seq in range(cfg["max_seq"]):
        idx = aggregator_index(job, seq, n_agg)
        bogus = rng.integers(-2**30, 2**30, V).astype(np.int32)
        # a result every worker would take for its own (right job, index, bitmaps)
        ack = encode(Packet(job, seq, bogus.view(np.int32), bitmap0=(1 << world) - 1, bitmap1=1,
                            fan_in0=world, fan_in1=1, agg_index=idx, is_ack=True))
        grad = encode(Packet(job, seq, bogus, bitmap0=1, bitmap1=1, fan_in0=world, fan_in1=1, agg_index=idx))
        forged += [(ack, switch), (grad, switch), (grad, ps)] + [(ack, w) for w in workers]
    garbage = [(os.urandom(int(n)), switch if i % 2 else ps)
               for i, n in enumerate(rng.integers(0, 400, 512))]
    zero_job = encode(Packet(1, 0, np.zeros(V, np.int32))).replace(b"\\x01", b"\\x00", 0)
    garbage += [(bytes(16) + bytes(4 * V), switch), (bytes(16) + bytes(4 * V), ps)]
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
    # a fixed schedule of bound sends: 7 forged datagrams to 1 of garbage, spread over 4 source sockets
    schedule = []
    for i in range(8 * max(len(forged), len(garbage) * 8) // 7 + 8):
        data, addr = forged[i % len(forged)] if i % 8 else garbage[(i >> 3) % len(garbage)]
        schedule.append((socks[i & 3].sendto, data, addr))
    print("READY", flush=True)
    sys.stdin.readline()                     # go
    sent = errors = 0
    t0 = time.monotonic()
    deadline = t0 + cfg["seconds"]
    while sent + errors < cfg["packets"] and time.monotonic() < deadline:
        for j in range(0, len(schedule), 4096):
            for send, data, addr in schedule[j:j + 4096]:
                try:
                    send(data, addr)
                    sent += 1
                except OSError:
                    errors += 1              # ENOBUFS / EAGAIN under the flood: counted, not fatal
            if sent + errors >= cfg["packets"] or time.monotonic() >= deadline:
                break
    elapsed = time.monotonic() - t0
    print("DONE " + json.dumps({"sent": sent, "errors": errors, "elapsed": elapsed}), flush=True)
''')


def _inputs(call: int) -> list[np.ndarray]:
    return [(np.random.default_rng([call, r]).standard_normal(SIZE) * 10).astype(np.float32)
            for r in range(WORLD)]


@pytest.mark.timeout(300)
def test_flood_and_forged_packets_change_nothing() -> None:
    calls = 6
    # the same calls on a quiet cluster first: the reference results (the quantized sums are exact,
    # so the results do not depend on which path aggregated a fragment)
    with InnetCluster([JobSpec(JOB, WORLD)]) as quiet:
        expected = [quiet.allreduce(JOB, _inputs(c)) for c in range(calls)]
    for c in range(calls):
        ref = np.sum([a.astype(np.float64) for a in _inputs(c)], axis=0)
        assert np.all(np.abs(expected[c][0] - ref) <= error_bound(ref, 2.0**20, WORLD))

    cluster = InnetCluster([JobSpec(JOB, WORLD)])
    attacker = None
    try:
        handles = cluster.jobs[JOB]
        first = cluster.allreduce(JOB, _inputs(0))           # warm up: sockets, threads, numpy buffers
        assert all(np.array_equal(f, e) for f, e in zip(first, expected[0]))
        proc = psutil.Process()
        threads_before, rss_before = threading.active_count(), proc.memory_info().rss
        cfg = {"job": JOB, "world": WORLD, "aggregators": cluster.num_aggregators,
               "values": cluster.value_count, "switch": list(cluster.switch.address),
               "ps": list(cluster.ps.address), "workers": [list(h.address) for h in handles]
               + [list(h.direct_address) for h in handles],
               "max_seq": calls * (-(-SIZE // cluster.value_count)), "seconds": FLOOD_SECONDS,
               "packets": FLOOD_PACKETS}
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, json.dumps(cfg)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env=env)
        assert attacker.stdout.readline().strip() == "READY"
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        got = [first]
        for c in range(1, calls):                            # during (and after) the flood
            got.append(run_ranks([lambda h=h, a=a: h.allreduce(a) for h, a in zip(handles, _inputs(c))],
                                  timeout=120))
        line = attacker.stdout.readline()
        attacker.wait(30)
        report = json.loads(line.split(" ", 1)[1])
        rate = report["sent"] / max(report["elapsed"], 1e-9)
        print(f"attacker: {report['sent']} datagrams in {report['elapsed']:.2f} s ({rate:,.0f}/s), "
              f"{report['errors']} send errors")

        for c in range(calls):
            for r in range(WORLD):
                assert np.array_equal(got[c][r], expected[c][r]), f"call {c} rank {r}: result changed"
        counters = cluster.control.counters()
        print("switch counters:", counters, "PS rejected/dropped:", cluster.ps.server.rejected,
              cluster.ps.server.dropped)
        assert counters["rejected"] > 0, "forged packets of the job were not rejected by the switch"
        assert counters["dropped"] > 0, "garbage was not dropped by the switch"
        assert cluster.ps.server.rejected > 0 and cluster.ps.server.stats(JOB).rejected > 0
        assert cluster.ps.server.dropped > 0
        assert threading.active_count() <= threads_before, "the attack left threads behind"
        assert proc.memory_info().rss - rss_before < 64 << 20, "the attack grew the job's memory by > 64 MB"
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.wait(10)
        cluster.close()


@pytest.mark.timeout(120)
def test_tokenless_p4runtime_client_is_refused() -> None:
    """The shared switch of ``twisternet run --innet``: a local client without the job's token can
    neither become primary, nor read another job's registers, nor join its result multicast group."""
    import queue

    import grpc

    from innet.controller import P4RuntimeController
    from innet.p4runtime.auth import p4runtime_token
    from innet.p4runtime.protos import p4runtime_pb2 as pb, p4runtime_pb2_grpc
    from innet.p4runtime.schema import load_p4info
    from innet.service import start_switch

    token = p4runtime_token(b"the victim job's token")
    sw = start_switch(p4runtime_token=token)
    try:
        addr = f"{sw.p4runtime_addr[0]}:{sw.p4runtime_addr[1]}"
        owner = P4RuntimeController(addr, timeout=20.0, token=token)
        job = owner.free_job_id()
        placement = owner.place_job(job, [("127.0.0.1", 40001), ("127.0.0.1", 40002)], ("127.0.0.1", 40003))
        info = load_p4info()
        reg = next(r.preamble.id for r in info.registers if r.preamble.alias == "agg_values")
        with grpc.insecure_channel(addr) as channel:            # the attacker: no token
            stub = p4runtime_pb2_grpc.P4RuntimeStub(channel)
            q: queue.Queue = queue.Queue()
            arb = pb.StreamMessageRequest()
            arb.arbitration.device_id = 1
            arb.arbitration.election_id.high = 1 << 63           # outranks any controller
            q.put(arb)
            stream = stub.StreamChannel(iter(q.get, None), timeout=20)
            with pytest.raises(grpc.RpcError) as err:
                next(stream)
            q.put(None)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            read = pb.ReadRequest(device_id=1)
            read.entities.add().register_entry.register_id = reg
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Read(read, timeout=20))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            join = pb.WriteRequest(device_id=1)
            join.election_id.high = 1 << 63
            u = join.updates.add(type=pb.Update.MODIFY)
            mg = u.entity.packet_replication_engine_entry.multicast_group_entry
            mg.multicast_group_id = job
            for port in (*placement.worker_ports, 99):
                mg.replicas.add().egress_port = port
            with pytest.raises(grpc.RpcError) as err:
                stub.Write(join, timeout=20)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert owner.job_ids() == {job}                          # the owner still controls the switch
        owner.remove_job(placement)
        assert owner.job_ids() == set()
    finally:
        sw.close()
