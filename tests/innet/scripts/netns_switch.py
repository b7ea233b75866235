"""Run inside the switch namespace: start the ATP switch and PS for one job on fixed ports, print READY,
and keep them up until stdin closes (the test's end)."""

import json
import sys

from innet import InnetService

host, sw_port, ps_port, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
svc = InnetService.launch(1, [tuple(w) for w in workers], switch_port=sw_port, ps_port=ps_port, host=host)
print("READY", flush=True)
try:
    sys.stdin.read()
finally:
    svc.close()
