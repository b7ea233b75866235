"""Spill failures are twisternet errors that say what went wrong and where: a value that cannot be
serialized is a CodecError (not a bare TypeError), a full disk names the spill directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

from collectives import Gather
from collectives.spill import SpillStore, SpillWriteError
from tests.jobs import ROOT, job_env
from twisternet.errors import CodecError, TwisternetError
from twisternet.testing import run_local


def _gather_locks(ctx):
    """Every rank gathers values holding a lock (never serializable) into a small batch store."""
    g = Gather(ctx, sources=ctx.tasks, destinations=[0], edge=1, mode="batch")
    for t in ctx.my_tasks:
        for _ in range(50):
            g.send(t, [threading.Lock(), "x" * 100])
        g.finish(t)
    if ctx.rank == 0:
        return list(g.results())
    return None


@pytest.mark.parametrize("world", [1, 2])
def test_an_unserializable_value_is_a_codec_error(tmp_path, world) -> None:
    with pytest.raises(CodecError, match="lock"):
        run_local(world, _gather_locks, memory_limit=2048, spill_dir=str(tmp_path), timeout=60)


def test_spilling_an_unserializable_value_names_the_store(tmp_path) -> None:
    store = SpillStore(1024, str(tmp_path), name="gather(edge=7)")
    with pytest.raises(CodecError, match=r"gather\(edge=7\).*cannot pickle"):
        for i in range(100):
            store.add(i, threading.Lock())
    store.close()
    assert os.listdir(tmp_path) == []


def test_a_spill_directory_that_cannot_be_made_is_named(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = SpillStore(1024, str(blocker / "spill"), name="partition(edge=3)")
    with pytest.raises(SpillWriteError) as ei:
        for i in range(100):
            store.add(i, "v" * 40)
    assert str(blocker / "spill") in str(ei.value) and "partition(edge=3)" in str(ei.value)
    assert isinstance(ei.value, OSError) and isinstance(ei.value, TwisternetError)


_FULL = textwrap.dedent("""
    import errno, os, sys
    from collectives.spill import SpillStore, SpillWriteError
    store = SpillStore(64 << 10, sys.argv[1], name="keyed_gather(edge=2)", sort=False)
    try:
        for i in range(100_000):
            store.add(i, os.urandom(200))
    except SpillWriteError as e:
        left = [n for d, _, ns in os.walk(sys.argv[1]) for n in ns]
        print("ERROR", e.errno == errno.ENOSPC, store.directory in str(e), "memory_limit" in str(e),
              "keyed_gather(edge=2)" in str(e), "runs", store.runs, "files", len(left), flush=True)
        print(e, flush=True)
        assert sorted(left) == sorted(os.path.basename(p) for p in store._runs)
        # the records that did not fit are still there: the store reads back all it took (unsorted:
        # no merge pass, which would need more room)
        assert sum(1 for _ in store) == store.count
        store.close()
        print("AFTER-CLOSE", os.listdir(sys.argv[1]), flush=True)
    else:
        print("NO ERROR", flush=True)
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_full_spill_filesystem_names_the_directory(tmp_path) -> None:
    """A 1 MB tmpfs mounted (in a private mount namespace) as the spill directory fills up: the error
    names the directory and the way out, the partial run file is removed, the records taken are kept."""
    script = tmp_path / "full.py"
    script.write_text(_FULL)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cmd = ["unshare", "-m", "sh", "-c",
           f"mount -t tmpfs -o size=1m tmpfs {mnt} && exec {sys.executable} {script} {mnt}"]
    proc = subprocess.run(cmd, env=job_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("ERROR True True True True runs"), proc.stdout
    assert out[-1] == "AFTER-CLOSE []", proc.stdout
