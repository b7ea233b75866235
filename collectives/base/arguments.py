"""What an operation's constructor takes: modes, callbacks, task lists, keyword aliases."""

from __future__ import annotations

from typing import Any, Literal
from collections.abc import Callable, Iterable, Sequence

from twisternet.errors import ConfigError

Mode = Literal["streaming", "batch"]
#: ``callback(destination_task, item)``; see each operation for what ``item`` is.
Callback = Callable[[int, Any], None]
MODES = ("streaming", "batch")


def task_list(plan: Any, tasks: int | Iterable[int] | None, what: str, default: Sequence[int]) -> list[int]:
    if tasks is None:
        tasks = default
    bad = ConfigError(what, f"must be a task id or a collection of task ids, got {tasks!r}")
    if isinstance(tasks, bool):
        raise bad
    if isinstance(tasks, int):
        tasks = [tasks]
    try:
        out = sorted(set(tasks))
    except TypeError:
        raise bad from None
    if not out:
        raise ConfigError(what, "must name at least one task")
    for t in out:
        if not isinstance(t, int) or isinstance(t, bool) or t not in plan:
            raise ConfigError(what, f"task {t!r} is not in the task plan {plan!r}")
    return out


def pick_alias(operation: str, canonical: str, given: dict[str, Any]) -> Any:
    """The one value the keywords in ``given`` (a canonical name and its aliases, e.g. ``destinations``,
    ``destination``, ``root``, ``dst``) name, or None if none is given; TypeError if two disagree."""
    named = {k: v for k, v in given.items() if v is not None}
    if len({repr(v) for v in named.values()}) > 1:
        listing = ", ".join(f"{k}={v!r}" for k, v in named.items())
        raise TypeError(f"{operation}: {listing} name different {canonical}; give one of "
                        f"{', '.join(given)}")
    return next(iter(named.values()), None)
