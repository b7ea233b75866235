"""Gather, AllGather and KeyedGather: records of many sources collected up k-ary trees.

Inner nodes forward records as they arrive (no holding beyond the per-operation limit); batch
destinations keep them in a :class:`~collectives.spill.SpillStore` bounded by ``config.memory_limit``.

Layout (one concept per module): ``chunks`` (Gather's records held and sent as per-source chunks),
``tree`` (forwarding up the trees, the roots' stores), ``gather`` (:class:`Gather`), ``quorum`` (batch
Gather's finish quorum), ``allgather`` (:class:`AllGather`), ``keyed`` (:class:`KeyedGather`).
"""

from __future__ import annotations

from .allgather import AllGather
from .gather import Gather
from .keyed import KeyedGather

__all__ = ["Gather", "AllGather", "KeyedGather"]
