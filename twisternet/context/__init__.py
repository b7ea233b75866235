"""Context: one process's view of a job — rank, world, task plan, channel — and its progress engine.

The Context turns values into records (codec), packs small records into pool buffers per
(peer, edge) and sends large ones zero-copy, hands incoming records to the operation registered on
their edge, and runs the channel's progress either on a background thread (default) or when the
program calls :meth:`Context.progress` (``progress="manual"``).

Threading rules that operations rely on:

* Handlers registered with :meth:`register` run on the progress thread (or the thread inside
  ``progress()`` in manual mode), never while the Context holds its own locks, one at a time.
* :meth:`send` is thread-safe. Called from a user thread it blocks under back pressure. Called from
  inside a handler it never blocks (blocking there would stop the very progress that frees space):
  it queues regardless of limits. A handler that wants to propagate back pressure checks
  :meth:`can_send` and returns False (refusing its input) while the way onward is congested.
* Records on one (source rank, edge) are delivered in the order they were sent; a refused record and
  everything after it from that source on that edge wait until it is accepted.

Edges are tagged with an *epoch* and a *fingerprint* (:meth:`tag_edges`), so an edge reused by one
operation after another delivers each record to the right incarnation, and different operations on
one edge fail with MismatchError on both ranks.

Layout (one concept per module): ``api`` (the :class:`Context` class), ``streams`` (per (peer, edge)
streams and wire tags), ``outbound`` (packing, queueing, back pressure), ``push`` (large sends completed
by their own thread, :class:`SendHandle`), ``engine`` (progress thread, engine hand-offs),
``coflow_pump`` (scheduled sending), ``inbound`` (channel events, delivery to handlers, mismatches),
``losses`` (peer loss, failures), ``lifecycle`` (leave, close, abort). Edge incarnations in detail, and
why the parts are mixins of one class: docs/architecture.md, section "The Context".
"""

from __future__ import annotations

from .api import Context
from .push import SendHandle
from .streams import Handler

__all__ = ["Context", "Handler", "SendHandle"]
