"""What a job token must be: long and random enough, and (in a file) readable by its owner alone.

Every connection of a TCP job proves it holds the token (:mod:`twisternet.auth`); a token someone can
guess or read is no protection. A token is refused, with the reason, when it is shorter than
:data:`MIN_LENGTH` characters, uses fewer than :data:`MIN_DISTINCT` different characters, is worth
less than :data:`MIN_BITS` bits by a generous estimate (its length times log2 of the size of the
character classes it draws on), or is a common password with digits or punctuation around it. A
token file that other users may read or write is refused too.
"""

from __future__ import annotations

import math
import os
import secrets
import stat
import string
from pathlib import Path

from .errors import TwisternetError

__all__ = ["token_problem", "check_token", "check_token_file", "new_token", "HOW_TO_MAKE_ONE",
           "MIN_LENGTH", "MIN_DISTINCT", "MIN_BITS", "WeakTokenError"]

MIN_LENGTH = 12
MIN_DISTINCT = 6
MIN_BITS = 64
#: Appended to every refusal.
HOW_TO_MAKE_ONE = ("make a good one with `twisternet token` (or python -c 'import secrets; "
                   "print(secrets.token_hex(32))'), and keep a token file private with chmod 600")

_COMMON = {
    "password", "passw", "passwd", "pass", "secret", "token", "changeme", "letmein", "qwerty",
    "qwertyuiop", "asdf", "asdfgh", "admin", "root", "test", "testing", "default", "welcome",
    "twisternet", "monkey", "dragon", "master", "login", "abc", "abcdef", "iloveyou", "trustno",
    "hello", "foobar", "foo", "bar", "guest", "user",
}


class WeakTokenError(TwisternetError, ValueError):
    """The job token (or its file) would not keep strangers out; the message says why and what to do."""


def new_token() -> str:
    """A fresh random token: 32 bytes from the OS's CSPRNG, as 64 hex digits."""
    return secrets.token_hex(32)


def _bits(token: str) -> float:
    pool = 0
    if any(c in string.ascii_lowercase for c in token):
        pool += 26
    if any(c in string.ascii_uppercase for c in token):
        pool += 26
    if any(c in string.digits for c in token):
        pool += 10
    if any(c in string.punctuation or c == " " for c in token):
        pool += 33
    if any(ord(c) > 127 for c in token):
        pool += 100
    return len(token) * math.log2(max(pool, 2))


def token_problem(token: str) -> str | None:
    """Why ``token`` is too weak to be a job token, or None when it is good enough."""
    if len(token) < MIN_LENGTH:
        return f"it is {len(token)} characters long; at least {MIN_LENGTH} are needed"
    if len(set(token)) < MIN_DISTINCT:
        return f"it uses only {len(set(token))} different characters; at least {MIN_DISTINCT} are needed"
    core = "".join(c for c in token.lower() if c.isalpha())
    if core in _COMMON or any(core == w * (len(core) // len(w)) for w in _COMMON if core and
                              len(core) % len(w) == 0):
        return "it is a common password with digits or punctuation around it"
    bits = _bits(token)
    if bits < MIN_BITS:
        return f"it is worth about {bits:.0f} bits; at least {MIN_BITS} are needed"
    return None


def check_token(token: str, source: str) -> str:
    """Return ``token`` if it is good enough, else raise WeakTokenError naming ``source``."""
    problem = token_problem(token)
    if problem is not None:
        raise WeakTokenError(f"the job token from {source} is too weak: {problem}; {HOW_TO_MAKE_ONE}")
    return token


def check_token_file(path: str | os.PathLike[str]) -> None:
    """Raise WeakTokenError if other users may read or write the token file ``path``."""
    p = Path(path)
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise WeakTokenError(f"token file {p} is accessible by other users (mode "
                             f"{stat.S_IMODE(mode):o}); run chmod 600 {p}, or {HOW_TO_MAKE_ONE}")
