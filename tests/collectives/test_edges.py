"""Edge claims (collectives.edges): one owner per edge and context, released edges reusable, and the
channel edge numbering stays below the reserved range."""

from __future__ import annotations

import pytest

from collectives.edges import EDGE_SPAN, MAX_USER_EDGE, UP_BASE, channel_edge, claim_edge, release_edge
from twisternet.errors import ConfigError


# ------------------------------------------------------------------------------------------ edges
def test_edge_claims() -> None:
    class Ctx:
        pass
    ctx = Ctx()
    claim_edge(ctx, 3, "A")
    with pytest.raises(ConfigError, match="already used by A"):
        claim_edge(ctx, 3, "B")
    claim_edge(Ctx(), 3, "other process")           # per context
    release_edge(ctx, 3)
    claim_edge(ctx, 3, "B")
    assert channel_edge(3, 0) == 3 * EDGE_SPAN and channel_edge(3, UP_BASE) == 3 * EDGE_SPAN + UP_BASE
    assert channel_edge(MAX_USER_EDGE - 1, EDGE_SPAN - 1) < 2**31 - 1024
    with pytest.raises(ValueError):
        channel_edge(1, EDGE_SPAN)
