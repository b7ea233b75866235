"""Coflow scheduling for twisternet: pluggable policies (FIFO, fair, Varys SEBF+MADD, deadline admission
control, JIT-style DAG/LAT), a trace-driven event simulator, the coflow-benchmark trace format, and a
small thread-safe table the runtime uses to rank its coflows, the per-process runtime hook that orders
and paces pending sends (``live``), and the job-wide coordinator service (docs/design.md section 6)."""

from __future__ import annotations

from .errors import CoflowError, SimulationError, TraceFormatError, UnknownPolicyError
from .job_dag import DagTiming, JobDag
from .model import GBIT, MB, Allocation, Coflow, Flow, PortCapacities
from .rate_allocation import effective_bottleneck, madd_rates, max_min_fair
from .scheduler import Scheduler, get_policy, policy_names, register_policy, unregister_policy
from .policies import (DagScheduler, DeadlineScheduler, FairScheduler, FifoScheduler, SebfScheduler,
                       solve_lat_lp)
from .simulator import CoflowResult, SimulationResult, simulate
from .trace import (Trace, TraceCoflow, format_trace, parse_trace, published_trace_path, read_trace,
                    write_trace)
from .trace_generator import generate_like, generate_trace
from .live_table import LiveCoflowTable
from .live import CoflowGroup, CoflowRuntime
from .coordinator import CoflowCoordinator

__all__ = [
    "CoflowError", "SimulationError", "TraceFormatError", "UnknownPolicyError",
    "Flow", "Coflow", "PortCapacities", "Allocation", "GBIT", "MB",
    "effective_bottleneck", "madd_rates", "max_min_fair",
    "Scheduler", "register_policy", "get_policy", "policy_names", "unregister_policy",
    "FifoScheduler", "FairScheduler", "SebfScheduler", "DeadlineScheduler", "DagScheduler",
    "solve_lat_lp", "JobDag", "DagTiming",
    "simulate", "SimulationResult", "CoflowResult",
    "Trace", "TraceCoflow", "parse_trace", "read_trace", "format_trace", "write_trace",
    "generate_trace", "generate_like", "published_trace_path",
    "LiveCoflowTable", "CoflowRuntime", "CoflowGroup", "CoflowCoordinator",
]
