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

Edge incarnations: an edge may be used by one operation after another (an operation per epoch on the
same edge id). Whoever uses an edge tags it (:meth:`tag_edges`) with an *epoch* (the how-many-th
incarnation of the edge this is, counted alike on every rank) and a *fingerprint* (what runs on it,
e.g. ``Gather(edge=7) batch ...``), and registers its handler with the same tag. The first message on a
(peer, edge) stream after the tag changed carries the new tag in front of its payload (no extra
message), and the receiver delivers a record only to a handler of the same epoch: records of a later
epoch wait (buffered) until that epoch's handler registers, records of an earlier one are dropped. A
record whose epoch matches but whose fingerprint differs means the ranks run different operations on
one edge: both the receiver and (through a notice on a control edge) the sender fail with
MismatchError, through the handler's ``on_error`` (or the Context's failure if none is registered).

Layout (one concept per module): ``api`` (the :class:`Context` class), ``streams`` (per (peer, edge)
streams and wire tags), ``outbound`` (packing, queueing, back pressure), ``push`` (large sends completed
by their own thread, :class:`SendHandle`), ``engine`` (progress thread, engine hand-offs),
``coflow_pump`` (scheduled sending), ``inbound`` (channel events, delivery to handlers, mismatches),
``losses`` (peer loss, failures), ``lifecycle`` (leave, close, abort).

Why the parts are mixins of one class and not collaborator objects (``coflow_pump`` is one, as it owns
its state and touches the rest only through the stream tables it is handed): the others share one lock
and condition, one engine lock, and the stream tables, and a single send crosses all of them (outbound
queues, the engine hands to the channel, the channel calls back into inbound, a loss is raised by
losses). Split into objects, each would hold references to the others' state and locks, an attribute
bag spread over several objects, and the per-record hot path would pay a hop per access. Instead each
mixin's docstring names the state it owns; ``Context.__init__`` makes all of it, in one place.
"""

from __future__ import annotations

from .api import Context
from .push import SendHandle
from .streams import Handler

__all__ = ["Context", "Handler", "SendHandle"]
