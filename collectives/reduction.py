"""Reduction functions: the named ones ("sum", "max", "min", "prod", and "avg"/"mean") with a numpy fast
path, or any callable.

"avg" (alias "mean") combines like "sum" and is divided by the number of contributions once, at the end
(:meth:`Reduction.finalize`): the rank-level ``AllReduce.allreduce`` and the functional layer
(``tn.all_reduce``, ``tn.reduce``) know that number; the streaming and batch dataflow forms do not, so
they refuse it rather than deliver a sum under the name of an average.

A callable is never sent over the network: every process builds the operation with its own copy of the
function, so it must be the same function (same module-level name or an equal lambda) in every process.
Reductions must be associative and commutative: inner tree nodes combine partial results in an order
that depends on the tree, not on the sources.
"""

from __future__ import annotations

import copy
import operator
from typing import Any
from collections.abc import Callable

import numpy as np

from twisternet.errors import CodecError
from twisternet.arrowcodec import is_arrow_data, own_arrow
from twisternet.codec import _array_like

ReduceFn = Callable[[Any, Any], Any]

_NAMED: dict[str, tuple[Any, Callable[[Any, Any], Any]]] = {
    "sum": (np.add, operator.add),
    "prod": (np.multiply, operator.mul),
    "max": (np.maximum, max),
    "min": (np.minimum, min),
    "avg": (np.add, operator.add),     # a sum, divided by the count in Reduction.finalize
    "mean": (np.add, operator.add),
}
#: Named reductions that are a sum divided by the number of values combined.
AVERAGES = frozenset({"avg", "mean"})

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, np.generic)
#: Exact types whose values never change (checked by ``type(v) in``, much cheaper than isinstance).
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})


def snapshot(value: Any) -> Any:
    """A copy of ``value`` that later changes by the caller cannot affect (arrays and containers copied).

    Flat records (a dict, list or tuple of plain scalars, the common case) take a shallow copy, which
    is as safe as a deep one for them and tens of times cheaper; anything else is deep-copied.
    """
    t = type(value)
    if t in _ATOMS or isinstance(value, _IMMUTABLE):
        return value
    if t is dict:
        if _flat(value.values()) and _flat(value):
            return value.copy()
    elif t is tuple:
        if _flat(value) or all(isinstance(v, _IMMUTABLE) for v in value):
            return value
    elif t is list:
        if _flat(value):
            return value[:]
        if all(type(x) is dict and _flat(x.values()) and _flat(x) for x in value):
            return [x.copy() for x in value]       # a table of flat records
    elif isinstance(value, np.ndarray):
        return value.copy()
    else:
        arr = _array_like(value)      # a torch tensor & co.: a numpy copy, as a receiver would get it
        if arr is not None:
            return arr.copy()
    try:
        return copy.deepcopy(value)
    except (TypeError, copy.Error) as e:     # what cannot be copied cannot be serialized either
        raise CodecError(f"cannot copy a value of type {t.__qualname__}: {e}") from e


def _flat(items: Any) -> bool:
    """Whether every item is a plain scalar (``type(x) in _ATOMS``); a loop beats ``all(genexpr)`` here."""
    for x in items:  # noqa: SIM110 - measured faster than all() over a generator
        if type(x) not in _ATOMS:
            return False
    return True


def own_values(values: list) -> list:
    """:func:`own` of every item of a freshly decoded list, in place (plain records are left as they are)."""
    for i, v in enumerate(values):
        t = type(v)
        if t in _ATOMS or (t is dict and _flat(v.values())):
            continue
        values[i] = own(v)
    return values


def own(value: Any) -> Any:
    """``value`` with every numpy array that is a view of someone else's memory copied.

    Received arrays may be views of channel receive buffers that are reused once the handler returns;
    anything an operation keeps past the handler call goes through this.
    """
    t = type(value)
    if t in _ATOMS:
        return value
    if isinstance(value, np.ndarray):
        return value.copy() if value.base is not None else value
    if t is tuple or t is list:
        if _flat(value):
            return value
        if any(isinstance(v, (np.ndarray, tuple, list, dict)) or is_arrow_data(v) for v in value):
            return t(own(v) for v in value)
        return value
    if t is dict:
        if _flat(value.values()):
            return value
        return {k: own(v) for k, v in value.items()}
    if is_arrow_data(value):       # an Arrow table decoded over the receive buffer
        return own_arrow(value)
    return value


class Reduction:
    """A binary reduction with an in-place numpy fast path for the named operations."""

    def __init__(self, op: str | ReduceFn) -> None:
        if isinstance(op, str):
            if op not in _NAMED:
                raise ValueError(f"unknown reduction {op!r}; use one of {', '.join(_NAMED)} or a callable")
            self.name = op
            self.ufunc, self._py = _NAMED[op]
            #: "avg"/"mean": combined as a sum, divided by the count in :meth:`finalize`.
            self.average = op in AVERAGES
            self._fn: ReduceFn | None = None
            #: The reduction of two plain scalars (``type(x) in _ATOMS``): what combine() calls for them.
            self.scalar: ReduceFn = self._py
        elif callable(op):
            self.name = getattr(op, "__name__", repr(op))
            self.ufunc = None
            self.average = False
            self._fn = op
            self.scalar = op
        else:
            raise TypeError(f"reduce must be a name ({', '.join(_NAMED)}) or a callable, got {op!r}")

    @property
    def named(self) -> bool:
        """True for the built-in reductions (eligible for the ring allreduce)."""
        return self.ufunc is not None

    def combine(self, acc: Any, value: Any) -> Any:
        """``acc`` reduced with ``value``. ``acc`` must be owned by the caller: it may be updated in place."""
        if self._fn is not None:
            return self._fn(acc, value)
        if isinstance(acc, np.ndarray) or isinstance(value, np.ndarray):
            uf = self.ufunc
            if (isinstance(acc, np.ndarray) and acc.flags.writeable
                    and np.shape(value) == acc.shape
                    and np.result_type(acc, value) == acc.dtype):
                uf(acc, value, out=acc)
                return acc
            return uf(acc, value)
        return self._py(acc, value)

    def finalize(self, value: Any, count: int) -> Any:
        """The final result of ``count`` values combined into ``value``: ``value / count`` for "avg"/"mean"
        (floating arrays divided in place; integer arrays give a new float64 array, Python numbers a float),
        ``value`` itself for every other reduction."""
        if not self.average:
            return value
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"an average needs a count >= 1, got {count!r}")
        if isinstance(value, np.ndarray):
            if value.dtype.kind in "fc" and value.flags.writeable:
                np.true_divide(value, count, out=value)
                return value
            return np.true_divide(value, count)
        if isinstance(value, (np.generic, int, float, complex)):
            return value / count  # type: ignore[operator]  # numeric scalars divide; the stubs lack it
        raise TypeError(f"cannot average a value of type {type(value).__qualname__}; "
                        "use numbers or numpy arrays with op='avg'")

    def __repr__(self) -> str:
        return f"Reduction({self.name})"
