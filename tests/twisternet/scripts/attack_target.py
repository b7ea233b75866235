"""The job tests/attack/test_attack_connections.py attacks: two ranks, rank 0 sends rank 1 a numbered
array per round and checks the sum rank 1 sends back, round after round, until the attacker says it
is done (file ``attack-done`` in ``$ATTACK_DIR``). Rank 0 publishes the addresses to attack and both
ranks their pids in that directory."""

import json
import os
import time
from pathlib import Path

import numpy as np

import twisternet as tn

d = Path(os.environ["ATTACK_DIR"])
with tn.init() as ctx:
    inbox: list = []
    replies: list = []
    ctx.register(1, lambda src, obj: inbox.append(obj) or True)
    ctx.register(2, lambda src, obj: replies.append(obj) or True)
    (d / f"pid-{ctx.rank}").write_text(str(os.getpid()))
    if ctx.rank == 0:
        entry = ctx.channel.session.table[1]
        target = {"worker": [entry["tcp_host"], entry["tcp_port"]], "uds": entry.get("uds"),
                  "master": ctx.config.master}
        (d / "target.tmp").write_text(json.dumps(target))
        os.replace(d / "target.tmp", d / "target.json")
        n, ok = 0, True
        give_up = time.monotonic() + 240
        while n < 3 or not (d / "attack-done").exists():
            arr = np.arange(1 << 14, dtype=np.int64) * (n + 1)
            ctx.send(1, 1, (n, arr))
            ctx.flush()
            ctx.wait_until(lambda n=n: len(replies) > n, timeout=120)
            ok = ok and list(replies[n]) == [n, int(arr.sum())]
            n += 1
            if n == 3:
                (d / "job-running").write_text("")
            if time.monotonic() > give_up:
                break
        ctx.send(1, 1, "stop")
        ctx.flush()
        print(f"RESULT rank=0 rounds={n} ok={ok}", flush=True)
    else:
        k = 0
        while True:
            ctx.wait_until(lambda k=k: len(inbox) > k, timeout=250)
            msg, inbox[k] = inbox[k], None     # keep no array longer than its round
            k += 1
            if msg == "stop":
                break
            n, arr = msg
            ctx.send(0, 2, (n, int(arr.sum())))
            ctx.flush()
        print(f"RESULT rank=1 rounds={k - 1} ok=True", flush=True)
