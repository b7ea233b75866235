"""What a killed process leaves behind, and the start-up sweep that removes it.

A rank that ends normally removes its own files: shared-memory segments (:mod:`twisternet.shm`) are
unlinked once every peer has them mapped, spill directories (:mod:`collectives.spill`) when their
store closes. A rank killed at the wrong moment (SIGKILL, or SIGTERM, whose default action skips every
clean-up) cannot; so every file name carries its owner's pid, and :func:`sweep` — called when a
Context is created — removes the segments and spill directories whose owner process is gone and that
belong to this user. Files of live processes, of other hosts or pid namespaces, of other users, and
names of any other pattern are never touched.

Spill directories are named ``twisternet-spill-<pid>-<tag>-<random>`` (:func:`spill_dir_prefix`; the
namespace tag of :mod:`twisternet.owner` keeps a sweep from judging pids of another host or container
that shares the directory) and live in
``spill_dir`` (default: the system temp directory); the sweep looks in the ``spill_dir`` of the Context
being created, which is where this job's killed ranks left theirs.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from typing import TYPE_CHECKING

from . import owner, shm

if TYPE_CHECKING:
    from .config import Config

log = logging.getLogger(__name__)

#: Name prefix of spill directories (followed by ``<pid>-<tag>-`` and a random suffix).
SPILL_PREFIX = "twisternet-spill-"
_SPILL_NAME = re.compile(re.escape(SPILL_PREFIX) + r"(\d+)-([0-9a-f]{8})-[A-Za-z0-9_]+")


def spill_dir_prefix() -> str:
    """The name prefix of this process's spill directories (``mkdtemp(prefix=...)``): its pid and
    namespace tag (twisternet.owner)."""
    return f"{SPILL_PREFIX}{os.getpid()}-{owner.namespace_tag()}-"


def spill_base(spill_dir: str | None) -> str:
    """The directory spill directories are made in for config ``spill_dir``."""
    return spill_dir if spill_dir is not None else tempfile.gettempdir()


def sweep_spill_dirs(spill_dir: str | None = None) -> list[str]:
    """Remove the spill directories in ``spill_base(spill_dir)`` whose owner process is gone and that
    belong to this user; returns their paths."""
    base = spill_base(spill_dir)

    def spill_owner(name: str) -> tuple[int, str | None] | None:
        m = _SPILL_NAME.fullmatch(name)
        return None if m is None else (int(m.group(1)), m.group(2))

    removed = owner.remove_orphans(base, spill_owner, stat.S_ISDIR,
                                   lambda path: shutil.rmtree(path, ignore_errors=True))
    if removed:
        log.info("removed %d spill directories left in %s by processes that are gone", len(removed), base)
    return removed


def sweep(spill_dir: str | None = None) -> list[str]:
    """The start-up sweep: stale shared-memory segments and spill directories (see module doc);
    returns the paths removed. Never raises for a file it cannot remove."""
    removed: list[str] = []
    try:
        if shm.supported():
            removed += shm.sweep_stale()
        removed += sweep_spill_dirs(spill_dir)
    except OSError as e:      # a sweep is a courtesy: it must never stop a job from starting
        log.warning("sweeping stale twisternet files failed: %s", e)
    return removed


def sweep_at_start(config: Config) -> None:
    """The hook a Context calls when it starts: :func:`sweep` unless config ``sweep_stale`` is off."""
    if config.sweep_stale:
        sweep(config.spill_dir)


__all__ = ["SPILL_PREFIX", "spill_dir_prefix", "spill_base", "sweep_spill_dirs", "sweep", "sweep_at_start"]
