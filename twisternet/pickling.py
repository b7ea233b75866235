"""The codec's pickle: cloudpickle, with the job script's own classes kept as the receiver's classes.

cloudpickle copies classes defined in ``__main__`` (the job script) *by value*: the receiver rebuilds
a new class from the pickled definition, so an object of the script's ``Point`` arrives as an instance
of a different ``Point`` and ``isinstance(p, Point)`` fails on the receiving rank, although it runs the
very same script. Here such a class is written as a call ``main_class(fingerprint, qualname, blob)``:

* ``fingerprint`` is a SHA-256 of the sender's main script (its file's bytes);
* the receiver returns *its own* ``__main__.<qualname>`` when its main script has the same fingerprint
  (every rank of ``twisternet run -n N script.py`` or ``mpiexec -n N python script.py`` does);
* otherwise (another script, an interactive session, a class defined inside a function) it unpickles
  ``blob``, the class by value as cloudpickle writes it: the behaviour of plain cloudpickle.

The blob is made once per class and remembered, so a message costs no more than before.

Large buffers (numpy arrays inside any pickled object) are handed to ``buffer_callback`` (pickle
protocol 5), so the codec sends them out of band instead of copying them into the pickle.
"""

from __future__ import annotations

import hashlib
import io
import logging
import sys
import threading
import weakref
from typing import Any
from collections.abc import Callable, Iterable

import cloudpickle

log = logging.getLogger(__name__)

_lock = threading.Lock()
_fingerprint: tuple[Any, str | None] = (None, None)      # (main module, its fingerprint)
_blobs: weakref.WeakKeyDictionary[type, bytes] = weakref.WeakKeyDictionary()


def main_fingerprint() -> str | None:
    """SHA-256 (hex) of this process's main script, or None when ``__main__`` is no file (``-c``, a
    notebook, the interactive prompt)."""
    global _fingerprint
    main = sys.modules.get("__main__")
    cached_main, digest = _fingerprint
    if cached_main is main and main is not None:
        return digest
    path = getattr(main, "__file__", None)
    digest = None
    if isinstance(path, str):
        try:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError as e:
            log.debug("cannot read the main script %s to fingerprint it: %s", path, e)
    with _lock:
        _fingerprint = (main, digest)
    return digest


def _by_value(cls: type) -> bytes:
    """``cls`` pickled by value (cloudpickle's way), made once per class."""
    blob = _blobs.get(cls)
    if blob is None:
        blob = cloudpickle.dumps(cls, protocol=5)
        with _lock:
            _blobs[cls] = blob
    return blob


def main_class(fingerprint: str, qualname: str, blob: bytes) -> type:
    """The receiver's side of a ``__main__`` class: its own class of that name when it runs the same
    main script, else the class rebuilt from ``blob`` (by value)."""
    if fingerprint == main_fingerprint():
        obj: Any = sys.modules.get("__main__")
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, type) and obj.__module__ == "__main__" and obj.__qualname__ == qualname:
            return obj
    cls: type = cloudpickle.loads(blob)
    return cls


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle has no type information
    """cloudpickle's pickler writing ``__main__`` classes as :func:`main_class` calls."""

    def __init__(self, file: io.BytesIO, fingerprint: str | None,
                 buffer_callback: Callable[[Any], Any] | None) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self._main_fp = fingerprint

    def reducer_override(self, obj: Any) -> Any:
        if (self._main_fp is not None and isinstance(obj, type) and obj.__module__ == "__main__"
                and "<locals>" not in obj.__qualname__):
            return main_class, (self._main_fp, obj.__qualname__, _by_value(obj))
        return super().reducer_override(obj)


def dumps(obj: Any, buffer_callback: Callable[[Any], Any] | None = None) -> bytes:
    """``obj`` pickled (protocol 5) as the module doc says; ``buffer_callback`` as in :mod:`pickle`."""
    f = io.BytesIO()
    _Pickler(f, main_fingerprint(), buffer_callback).dump(obj)
    return f.getvalue()


def loads(data: Any, buffers: Iterable[Any] = ()) -> Any:
    """The object :func:`dumps` wrote, its out-of-band ``buffers`` in order."""
    return cloudpickle.loads(data, buffers=buffers)


__all__ = ["dumps", "loads", "main_fingerprint", "main_class"]
