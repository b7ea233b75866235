"""What a testbed needs of this machine: root, iproute2, util-linux, and the commands it runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import TwisternetError

#: Every name a testbed creates starts with this (namespaces) or lives under STATE_ROOT.
PREFIX_ROOT = "tntb"
STATE_ROOT = Path("/run/twisternet-testbed")
CMD_TIMEOUT = 30.0


class TestbedError(TwisternetError):
    """Building, using or removing the emulated cluster failed (the message names the command)."""

    __test__ = False


def sh(*cmd: str, timeout: float = CMD_TIMEOUT, check: bool = True, input: str | None = None
        ) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, input=input)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TestbedError(f"{' '.join(cmd)}: {e}") from None
    if check and r.returncode != 0:
        raise TestbedError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def unavailable() -> str | None:
    """None if this machine can build a testbed, else the reason (not root, no ip/tc, unshare refused)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root or in a privileged container)"
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux"),
                      ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (install {pkg})"
    probe = f"{PREFIX_ROOT}-probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=CMD_TIMEOUT)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=CMD_TIMEOUT)
    # what every host needs, tried in a throwaway mount/UTS namespace: a tmpfs /dev/shm and a hostname
    r = subprocess.run(["unshare", "-m", "-u", "--propagation", "private", "sh", "-c",
                        f"mount -t tmpfs -o size=1m tmpfs /dev/shm && hostname {PREFIX_ROOT}-probe"],
                       capture_output=True, text=True, timeout=CMD_TIMEOUT)
    if r.returncode != 0:
        return f"unshare refused a mount/UTS namespace with its own /dev/shm and hostname: {r.stderr.strip()}"
    return None
