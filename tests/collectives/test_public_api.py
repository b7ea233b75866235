"""The collectives package exports what its ``__all__`` names."""

from __future__ import annotations

import collectives as C


def test_public_api() -> None:
    for name in C.__all__:
        assert hasattr(C, name), name
