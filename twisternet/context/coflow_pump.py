"""Scheduled sending: with a coflow policy set, the order in which a Context hands queued messages to
its channel is the coflow scheduler's (``twisternet.coflow.live``), not first come first served."""

from __future__ import annotations

import time
from typing import Any

from ..channel import Channel
from ..config import Config
from .streams import _OutStream


class CoflowPump:
    """Hands a Context's queued messages to the channel in coflow priority order.

    Owns the pacing state (``pace_until``: when a paced send may go next, which the engine polls for).
    It shares the Context's stream tables (``out``, ``out_ready``, the same objects, mutated under the
    Context lock) and is only ever called with that lock held."""

    def __init__(self, channel: Channel, coflows: Any, config: Config,
                 out: dict[tuple[int, int], _OutStream], out_ready: set[tuple[int, int]]) -> None:
        self.channel = channel
        self.coflows = coflows
        self.config = config
        self.out = out
        self.out_ready = out_ready
        #: When the earliest paced send may go (inf: none is waiting for a pacing token).
        self.pace_until = 0.0

    def pump(self) -> bool:
        """The coflow-scheduled pump (Context lock held): streams in the coflows' priority order; per
        peer, no more than ``coflow_inflight`` bytes waiting in the channel (``Channel.pending_bytes``),
        so the backlog stays here where a more urgent coflow can overtake; optional token-bucket pacing
        per flow. True if a message was handed over."""
        cf = self.coflows
        cf.refresh()
        did = False
        now = time.monotonic()
        cap = self.config.coflow_inflight
        pacing = self.config.coflow_pacing
        pending = self.channel.pending_bytes
        wake = float("inf")
        for key in sorted(self.out_ready, key=lambda k: cf.edge_rank(k[1])):
            s = self.out[key]
            while s.queue:
                if pending(s.peer) >= cap and cf.edge_rank(s.edge) >= 0:
                    break
                msg = s.queue[0]
                if pacing:
                    wait = cf.pace(s.edge, s.peer, msg.nbytes)
                    if wait > 0:
                        wake = min(wake, now + wait)
                        break
                if not self.channel.send(s.peer, s.edge, msg.parts, msg):
                    break
                s.queue.popleft()
                s.queued_bytes -= msg.nbytes
                cf.report_sent(s.edge, s.peer, msg.nbytes)
                did = True
            if not s.queue:
                self.out_ready.discard(key)
        self.pace_until = wake
        return did
