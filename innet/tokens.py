"""The P4Runtime token of a job's switch, derived from the job token (no gRPC needed to compute it).

The switch process holds only this derived value (see ``innet.p4runtime.auth``), never the job token:
what a switch leaks cannot open the job's TCP connections. This module imports nothing heavy, so a
launcher can compute the token without loading gRPC into a process that forks workers afterwards.
"""

from __future__ import annotations

import hashlib
import hmac

__all__ = ["p4runtime_token", "read_token_file"]

_CONTEXT = b"twisternet innet p4runtime token v1"


def p4runtime_token(job_token: bytes) -> str:
    """The P4Runtime token of a job's switch: HMAC-SHA256(job token, a fixed context), in hex."""
    if not job_token:
        raise ValueError("a P4Runtime token needs a non-empty job token")
    return hmac.new(job_token, _CONTEXT, hashlib.sha256).hexdigest()


def read_token_file(path: str) -> str:
    """The token in a file (its first line, stripped); ValueError if the file holds none."""
    with open(path, encoding="utf-8") as f:
        token = f.readline().strip()
    if not token:
        raise ValueError(f"{path}: no token in the file")
    return token
