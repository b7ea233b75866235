"""The machinery every collective shares: task/edge validation, handler wrapping, non-blocking emission,
back-pressure waits, result sinks (iterator or callback), diagnostics and clean shutdown.

Locking: each operation has one re-entrant lock guarding its state. Handlers (progress thread) take it;
user calls take it only to mutate state, never while blocking. Calls into the Context made under the
lock never block: sends from a handler are queued by the core regardless of credit, and sends from a
user thread use ``try_send`` and park the record in a small backlog that the same call then waits to
hand over (outside the lock) or that the next handler call forwards.

Layout (one concept per module): ``arguments`` (modes, callbacks, task lists, keyword aliases),
``operation`` (the :class:`Operation` class: construction, public calls, user-thread sends and waits),
and its parts, mixins of that one class as the Context's are (they share one lock and one state):
``results`` (result sinks, readers, callbacks), ``failures`` (failing on every rank), ``plumbing``
(handlers on the edges, non-blocking sends); ``state`` declares the state and methods they share, for
the type checker (the table paths of :mod:`collectives.columnar` are parts of the operations too).
"""

from __future__ import annotations

from .arguments import MODES, Callback, Mode, pick_alias
from .operation import Operation
from .results import record_nbytes

__all__ = ["Operation", "Mode", "Callback", "MODES", "pick_alias", "record_nbytes"]
