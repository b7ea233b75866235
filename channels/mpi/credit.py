"""Credit returns: the bytes of released messages go back to their senders in batches per peer
(once an edge has a quarter of its credit pending, when a poll is quiet, or after 1 ms)."""

from __future__ import annotations

import logging
import time

from .records import _Send
from .wire import TAG_CTRL, _encode_credit

log = logging.getLogger(__name__)


#: Pending credit older than this (seconds) is returned even if the batch is small.
_CREDIT_MAX_DELAY = 1e-3


class CreditMixin:
    """CREDITMIX"""

    def _flush_credit(self, quiet: bool) -> None:
        """Send batched credit returns: all of them when ``quiet``, else only full or old batches."""
        now = time.monotonic()
        batch = self._credit_batch
        for peer in list(self._credit_out):
            per_edge = self._credit_out[peer]
            if not (quiet or now - self._credit_since[peer] >= _CREDIT_MAX_DELAY
                    or max(per_edge.values()) >= batch):
                continue
            del self._credit_out[peer]
            del self._credit_since[peer]
            for msg in _encode_credit(list(per_edge.items())):
                try:
                    self._submit(msg, TAG_CTRL, _Send(peer, msg), urgent=True)
                except self._MPI.Exception as e:
                    self._lose(peer, f"MPI error returning credit: {e.Get_error_string()}")
                    break
                self.stats["credit_msgs_sent"] += 1

