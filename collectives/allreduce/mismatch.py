"""What every rank's allreduce value must agree on, and the MismatchError naming who passed what."""

from __future__ import annotations

from typing import Any

import numpy as np

from twisternet.errors import MismatchError


#: Descriptors made so far, by (dtype, shape): a call describes its value on every rank, every time.
_DESCRIPTORS: dict[tuple[np.dtype, tuple[int, ...]], str] = {}


def describe_value(value: Any) -> str:
    """What every rank's value of one call must agree on: an array's dtype (with byte order) and shape."""
    if isinstance(value, np.ndarray):
        key = (value.dtype, value.shape)
        desc = _DESCRIPTORS.get(key)
        if desc is None:
            if len(_DESCRIPTORS) >= 1024:
                _DESCRIPTORS.clear()
            desc = _DESCRIPTORS[key] = f"{value.dtype.str} {value.shape}"
        return desc
    return "-"


def _human(desc: str) -> str:
    if desc == "-":
        return "a value that is not a numpy array"
    dt, _, shape = desc.partition(" ")
    try:
        name = np.dtype(dt).name
    except TypeError:
        name = dt
    order = {"<": ", little-endian", ">": ", big-endian"}.get(dt[:1], "")
    return f"{name} ({dt}{order}) of shape {shape}"


def mismatch_error(call: int, groups: dict[str, list[int]]) -> MismatchError:
    """The error every rank raises when the values of one call differ: who passed what."""
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    odd = sorted(r for _, rs in ordered[1:] for r in rs)
    listing = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {sorted(rs)}: {_human(d)}" for d, rs in ordered)
    err = MismatchError(f"allreduce() call {call}: ranks {odd} passed values that differ from the others' "
                        f"({listing}); every rank must pass arrays of the same shape and dtype, byte order "
                        "included", odd)
    err.call = call     # type: ignore[attr-defined]  # ranks still in an earlier call raise it in this one
    return err


def merge_groups(mine: dict[str, list[int]], theirs: Any) -> dict[str, list[int]]:
    """``mine`` with the ``{descriptor: [ranks]}`` of a received record added (in place)."""
    if isinstance(theirs, dict):
        for d, rs in theirs.items():
            mine.setdefault(d if type(d) is str else str(d), []).extend(map(int, rs))
    return mine
