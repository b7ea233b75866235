"""One job uses two coordinator services at once: the coflow coordinator (coflow_policy="fair") and a
PartialBarrier, interleaved, twice. Each must get its own answers: the coordinator its schedule, the
barrier its release naming every rank. Runs under ``twisternet run`` (the master hosts the services)
and under ``mpiexec`` (rank 0 does)."""

import twisternet as tn
from collectives import PartialBarrier
from twisternet.coflow.coordinator import SERVICE_NAME

with tn.init(coflow_policy="fair") as ctx:
    coflows = ctx.coflows
    barrier = PartialBarrier(ctx, "both-services", max=ctx.world)
    for round_ in range(2):
        if round_:
            coflows.set_remote_priorities(None)      # forget the schedule; say hello again
            coflows.connect(lambda msg: ctx.services.send(SERVICE_NAME, msg))
        ctx.wait_until(lambda: coflows._remote is not None, timeout=30)
        release = barrier.enter(f"rank{ctx.rank}", wait=30)
        passed = ",".join(f"{label}:{rank}" for label, rank in sorted(release.fire.passed.items()))
        print(f"SERVICES rank={ctx.rank} round={round_} coflow=ok barrier={release.status.value} "
              f"passed={passed}", flush=True)
