"""Prints ``WHO {"rank": r, "host": hostname}`` (tests of the testbed's rank numbering)."""

import json
import socket

import twisternet as tn

with tn.init(timeout=120) as ctx:
    print("WHO " + json.dumps({"rank": ctx.rank, "host": socket.gethostname()}), flush=True)
