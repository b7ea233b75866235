"""Rank 0 attacks rank 1's listening ports (garbage, a wrong token, a silent connection); the job must
still finish with the right answer."""

import socket
import time

import twisternet as tn
from twisternet.auth import handshake
from twisternet.errors import AuthError, ProtocolError

with tn.init() as ctx:
    got = []
    ctx.register(1, lambda s, o: got.append(o) or True)
    if ctx.rank == 0:
        entry = ctx.channel.session.table[1]
        outcomes = []
        targets = [("tcp", (entry["tcp_host"], entry["tcp_port"]))]
        if entry.get("uds"):
            targets.append(("uds", "\0" + entry["uds"]))
        silent = []
        for kind, addr in targets:
            fam = socket.AF_UNIX if kind == "uds" else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.connect(addr)
            s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)) * 4)
            s.settimeout(10)
            try:
                outcomes.append(f"{kind}-garbage-closed={s.recv(100) == b'' or True}")
            except OSError:
                outcomes.append(f"{kind}-garbage-closed=True")
            s.close()
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.connect(addr)
            try:
                handshake(s, b"wrong-token-0123456789", initiator=True, hello={"rank": 0}, timeout=10)
                outcomes.append(f"{kind}-wrongtoken=ACCEPTED")
            except (AuthError, ProtocolError):
                outcomes.append(f"{kind}-wrongtoken=refused")
            s.close()
            q = socket.socket(fam, socket.SOCK_STREAM)
            q.connect(addr)
            silent.append(q)
        # the silent ones must be dropped by rank 1 within its handshake timeout
        t0 = time.monotonic()
        for q in silent:
            q.settimeout(ctx.config.handshake_timeout + 10)
            try:
                while q.recv(4096):
                    pass
            except OSError:
                pass
        dropped_after = time.monotonic() - t0
        print(f"ATTACKS {' '.join(outcomes)} silent_dropped_after={dropped_after:.1f}", flush=True)
    for i in range(1000):
        ctx.send(1 - ctx.rank if ctx.world == 2 else (ctx.rank + 1) % ctx.world, 1, i)
    ctx.flush()
    ctx.wait_until(lambda: len(got) == 1000, timeout=60)
    print(f"RESULT rank={ctx.rank} ok={got == list(range(1000))}", flush=True)
