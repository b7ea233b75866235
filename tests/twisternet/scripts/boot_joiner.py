"""Test helper: join a bootstrap master through the env contract and behave as told by argv[1].

Modes: hold (stay joined, heartbeating), close (leave cleanly, exit 0), events (print every master event
as a JSON line until killed). Prints ``JOINED <rank> <world>`` once joined.
"""

import json
import os
import sys
import time


from twisternet.bootstrap import join


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "hold"
    env = os.environ
    session = join(env["TWISTERNET_MASTER"], env["TWISTERNET_TOKEN"].encode(),
                   listen={"pid": os.getpid()},
                   rank=int(env["TWISTERNET_RANK"]) if env.get("TWISTERNET_RANK") else None,
                   world=int(env["TWISTERNET_WORLD"]) if env.get("TWISTERNET_WORLD") else None,
                   timeout=30, heartbeat_interval=float(env.get("BOOT_HB", "0.2")),
                   peer_timeout=float(env.get("BOOT_PEER_TIMEOUT", "3")))
    session.on_event(lambda ev: print("EVENT " + json.dumps(ev), flush=True))
    print(f"JOINED {session.rank} {session.world}", flush=True)
    if mode == "close":
        session.close()
        return 0
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
