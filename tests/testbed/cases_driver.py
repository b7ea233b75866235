"""Run many collective scenarios in one job (one process per rank): ``python cases_driver.py CASES.json``.

The file holds a list of ``{"scenario": NAME, "params": {...}}`` (see tests/collectives/scenarios.py).
Each case gets its own edge and, for ``run_op``, its own task plan (set on the context before the
operation is built, which is when operations read it). Prints one JSON line per case and rank:
``{"case": i, "rank": r, "host": hostname, "result": ...}``.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path


import twisternet as tn
from tests.collectives.scenarios import SCENARIOS
from twisternet.task_plan import TaskPlan


def main(path: str) -> int:
    cases = json.loads(Path(path).read_text())
    host = socket.gethostname()
    with tn.init() as ctx:
        default_plan = ctx.plan
        for i, case in enumerate(cases):
            params = dict(case["params"], edge=100 + i)
            plan = params.get("plan")
            ctx.plan = TaskPlan(ctx.world, {int(t): r for t, r in plan.items()}) if plan else default_plan
            result = SCENARIOS[case["scenario"]](ctx, params)
            print(json.dumps({"case": i, "rank": ctx.rank, "host": host, "result": result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
