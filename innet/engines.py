"""The choice between an optional compiled extension of ``innet`` and its Python reference.

``setup.py`` builds the extensions (``_fastpath``: the switch dataplane, ``_hostio``: the end hosts'
batched datagram I/O, ``_pscore``: the parameter server's packet path) when it can; each is chosen by a
mode, from a config key or an environment variable: ``auto`` (compiled when built, else Python), ``c``
(compiled, an error if it is not built) or ``python`` (the reference).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = ["MODES", "choose_engine", "import_extension"]

MODES = ("auto", "c", "python")


def import_extension(name: str) -> tuple[Any, str | None]:
    """``(module, None)`` for the extension ``innet.<name>``, or ``(None, why)`` when it does not import
    (not built: no compiler at install time; or stale)."""
    try:
        return importlib.import_module(f"innet.{name}"), None
    except ImportError as e:
        return None, str(e)


def choose_engine(requested: str | None, env: str, built: object | None, import_error: str | None, what: str,
                  unavailable: type[Exception]) -> str:
    """``"c"`` or ``"python"``: ``requested`` (None: the environment variable ``env``, default ``auto``)
    resolved against ``built`` (the imported extension, None when it is not built, for ``import_error``).
    ValueError for an unknown mode; ``unavailable`` (naming ``what``) when ``c`` is asked for and not
    built."""
    want = (requested if requested is not None else os.environ.get(env, "auto")).strip().lower()
    if want not in MODES:
        raise ValueError(f"{env} / {what} must be auto, c or python, got {want!r}")
    if want == "python":
        return "python"
    if built is None:
        if want == "c":
            raise unavailable(f"{what} is not built ({import_error or 'no compiled extension'}); reinstall "
                              "with a C compiler and the Python headers (pip install .), or use python")
        return "python"
    return "c"
