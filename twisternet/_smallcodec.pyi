"""Types of the compiled short-tuple codec (twisternet/_smallcodec.c; the reference is twisternet.smallrecords)."""

from collections.abc import Callable
from typing import Any

import numpy as np

#: What :func:`decode` returns for a record it leaves to the general decoder.
DECLINE: object

def encode(t: tuple[Any, ...], ndarray: type[np.ndarray], head: Callable[[np.ndarray], bytes | None],
           limit: int, tuple_code: int) -> bytes | None: ...
def decode(record: Any, tuple_code: int, ndarray_code: int,
           kinds: dict[int, list[tuple[bytes, np.dtype, tuple[int, ...]]]],
           empty: Callable[..., np.ndarray]) -> Any: ...
