"""The ``Work`` objects the backend returns: a torch ``Work`` backed by a torch Future that twisternet's
non-blocking handles complete (``wait()`` raises the call's error)."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


class TwisternetWork(dist.Work):
    """A torch Work backed by a torch Future that a twisternet handle completes: ``wait()`` returns once
    the call completed and raises its error (torch's future-wrapping Work would swallow it)."""

    def __init__(self, fut: torch.futures.Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: Any = None) -> bool:
        self._fut.wait()        # raises the call's error
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True

    def exception(self) -> Any:
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as e:  # noqa: BLE001
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        return self._fut


def _create_work_from_future(fut: torch.futures.Future) -> TwisternetWork:
    return TwisternetWork(fut)


def _work(handles: Sequence[Any], value: Callable[[], Any]) -> Any:
    """A torch Work whose future completes with ``value()`` once every handle did (or with the first error)."""
    fut: torch.futures.Future = torch.futures.Future()
    left = [len(handles)]
    lock = threading.Lock()

    def one_done(f: concurrent.futures.Future) -> None:
        err = f.exception()
        with lock:
            if left[0] < 0:
                return
            if err is not None:
                left[0] = -1
            else:
                left[0] -= 1
                if left[0]:
                    return
        if err is not None:
            fut.set_exception(err)
            return
        try:
            got = value()
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
        else:
            fut.set_result(got)
    if not handles:
        fut.set_result(value())
    for h in handles:
        h.get_future().add_done_callback(one_done)
    return _create_work_from_future(fut)


def _done_work(value: Any) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return _create_work_from_future(fut)


def _failed_work(err: BaseException) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_exception(err)
    return _create_work_from_future(fut)


def _chain(works: list[Any], value: Any) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    futs = [w.get_future() for w in works]
    all_done = torch.futures.collect_all(futs)

    def done(f: Any) -> None:
        try:
            for x in f.value():
                x.value()
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
        else:
            fut.set_result(value)
    all_done.add_done_callback(done)
    return _create_work_from_future(fut)

