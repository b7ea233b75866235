"""The job script's own classes arrive as the receiver's classes (isinstance holds) when every rank runs
the same script, by value otherwise; a pickled object's large arrays travel out of band."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tests.jobs import lines, run_mpi, run_tcp
from twisternet import pickling
from twisternet.codec import Codec, join

SCRIPT = Path(__file__).parent / "scripts" / "main_classes.py"


def _main_module(path: Path, source: str) -> types.ModuleType:
    """A module named ``__main__`` run from ``path`` (what ``python path`` makes)."""
    path.write_text(source)
    mod = types.ModuleType("__main__")
    mod.__file__ = str(path)
    exec(compile(source, str(path), "exec"), mod.__dict__)
    return mod


SOURCE = "class Point:\n    def __init__(self, x):\n        self.x = x\n"


def test_same_script_gives_the_receivers_class_another_script_the_class_by_value(tmp_path, monkeypatch) -> None:
    sender = _main_module(tmp_path / "job.py", SOURCE)
    monkeypatch.setitem(sys.modules, "__main__", sender)
    data = pickling.dumps([sender.Point(3)])

    same = _main_module(tmp_path / "copy-of-job.py", SOURCE)      # the same script, elsewhere
    monkeypatch.setitem(sys.modules, "__main__", same)
    (p,) = pickling.loads(data)
    assert type(p) is same.Point and p.x == 3

    other = _main_module(tmp_path / "other.py", SOURCE + "# another script\n")
    monkeypatch.setitem(sys.modules, "__main__", other)
    (p,) = pickling.loads(data)
    assert type(p) is not other.Point and type(p).__name__ == "Point" and p.x == 3

    nofile = types.ModuleType("__main__")                          # python -c, a notebook
    monkeypatch.setitem(sys.modules, "__main__", nofile)
    (p,) = pickling.loads(data)
    assert p.x == 3 and pickling.main_fingerprint() is None


def test_a_class_the_receiver_lacks_falls_back_to_the_blob(tmp_path, monkeypatch) -> None:
    sender = _main_module(tmp_path / "job.py", SOURCE)
    monkeypatch.setitem(sys.modules, "__main__", sender)
    data = pickling.dumps(sender.Point(5))
    del sender.Point                      # same fingerprint, but no such class any more
    p = pickling.loads(data)
    assert p.x == 5 and type(p).__name__ == "Point"


def test_a_pickled_objects_large_arrays_go_out_of_band() -> None:
    from dataclasses import dataclass

    @dataclass
    class Holder:
        name: str
        big: np.ndarray
        small: np.ndarray

    c = Codec(oob_threshold=64 << 10)
    h = Holder("h", np.arange(1 << 20, dtype=np.float64), np.arange(10))
    parts = c.encode(h)
    oob = [p for p in parts if isinstance(p, memoryview) and np.shares_memory(np.frombuffer(p, np.uint8), h.big)]
    assert len(oob) == 1 and oob[0].nbytes == h.big.nbytes, "the array itself is a part: no copy"
    assert sum(memoryview(p).nbytes for p in parts) - h.big.nbytes < 64 << 10, "nothing else is large"
    rec = join(parts)
    value, views = c.decode_views(rec)
    assert views and np.shares_memory(value.big, np.frombuffer(rec, np.uint8)), "received without a copy"
    assert np.array_equal(value.big, h.big) and np.array_equal(value.small, h.small) and value.name == "h"
    value.big[0] = 7                                                 # writable
    value, views = c.decode_views(rec, copy=True)
    assert not views and not np.shares_memory(value.big, np.frombuffer(rec, np.uint8))
    value, views = c.decode_views(bytes(rec))                       # read-only memory: a writable copy
    assert not views and value.big.flags.writeable
    with pytest.raises(Exception, match="allow_pickle"):
        Codec(allow_pickle=False).decode(rec)


def _check(p: subprocess.CompletedProcess, world: int) -> None:
    parts = lines(p, "PARTS ")     # (lines() splits the ranks' lines that mpiexec glued together)
    got = lines(p, "GOT ")
    out = parts + got
    assert len(parts) == world and all("oob=1" in l for l in parts), out
    assert all(int(re.search(r"inband=(\d+)", l).group(1)) < 1 << 20 for l in parts), out
    assert len(got) == world, out
    for l in got:
        assert "holder=True point=True color=True" in l and "data=True writable=True" in l, l


@pytest.mark.timeout(300)
def test_script_classes_arrive_as_the_receivers_own_under_twisternet_run() -> None:
    p = run_tcp(2, SCRIPT, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    _check(p, 2)


@pytest.mark.timeout(300)
def test_script_classes_arrive_as_the_receivers_own_under_mpiexec(mpiexec: str) -> None:
    p = run_mpi(2, SCRIPT, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    _check(p, 2)
