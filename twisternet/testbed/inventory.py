"""The testbeds present on this machine, by name: listing them, removing one, sweeping the stale."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence

from .system import CMD_TIMEOUT, PREFIX_ROOT, STATE_ROOT, TestbedError

log = logging.getLogger(__name__)

#: A testbed's name: ``tntb-<owner pid or keep>-<hex>``.
TESTBED_NAME = re.compile(rf"^{PREFIX_ROOT}-(\d+|keep)-([0-9a-f]+)$")


def _owner_alive(owner: str) -> bool:
    if owner == "keep":
        return True
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_testbeds() -> dict[str, list[str]]:
    """Every testbed prefix present on this machine -> its namespace names."""
    out: dict[str, list[str]] = {}
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=CMD_TIMEOUT)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        prefix, _, _ = name.rpartition("-")
        if TESTBED_NAME.match(prefix):
            out.setdefault(prefix, []).append(name)
    if STATE_ROOT.is_dir():
        for d in STATE_ROOT.iterdir():
            if TESTBED_NAME.match(d.name):
                out.setdefault(d.name, [])
    return out


def remove_testbed(prefix: str, namespaces: Sequence[str] = ()) -> list[str]:
    """Remove a testbed by prefix: its processes, namespaces, mounts and state. Returns what failed."""
    if not TESTBED_NAME.match(prefix):
        raise TestbedError(f"not a testbed name: {prefix!r} (names look like {PREFIX_ROOT}-<pid>-<hex>)")
    problems: list[str] = []
    names = set(namespaces)
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=CMD_TIMEOUT)
    names.update(n.split()[0] for n in r.stdout.splitlines() if n.strip() and n.split()[0].startswith(prefix + "-"))
    for ns in sorted(names):                 # processes still inside (a killed run's jobs)
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=CMD_TIMEOUT)
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for ns in sorted(names):
        r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, timeout=CMD_TIMEOUT)
        if r.returncode != 0 and "No such file" not in r.stderr:
            problems.append(f"ip netns del {ns}: {r.stderr.strip()}")
    state = STATE_ROOT / prefix
    if state.exists():
        for f in sorted(state.glob("*.mnt")) + sorted(state.glob("*.uts")):
            subprocess.run(["umount", str(f)], capture_output=True, timeout=CMD_TIMEOUT)
        subprocess.run(["umount", str(state)], capture_output=True, timeout=CMD_TIMEOUT)
        shutil.rmtree(state, ignore_errors=True)
        if state.exists():
            problems.append(f"could not remove {state}")
    return problems


def sweep_stale() -> list[str]:
    """Remove the testbeds of processes that are gone (killed runs); returns their prefixes."""
    swept = []
    for prefix, namespaces in list_testbeds().items():
        m = TESTBED_NAME.match(prefix)
        if m and not _owner_alive(m.group(1)):
            log.info("removing the leftovers of testbed %s (its process is gone)", prefix)
            remove_testbed(prefix, namespaces)
            swept.append(prefix)
    return swept
