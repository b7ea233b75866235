"""The start-up sweep: a Context removes the /dev/shm segments and spill directories that killed
processes of this user left behind, and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from collectives.spill import SpillStore
from tests.jobs import ROOT, job_env
from twisternet import leftovers, owner, shm
from twisternet.testing import run_local

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs Linux with a tmpfs at /dev/shm")

# Spills a store and creates a slot segment, reports both, then waits to be killed.
_VICTIM = textwrap.dedent("""
    import sys, time
    from channels import shm_slots
    from collectives.spill import SpillStore
    store = SpillStore(4096, sys.argv[1])
    for i in range(2000):
        store.add(i, "x" * 50)
    seg = shm_slots.create_segment(4096)
    print(store.directory, seg.path, flush=True)
    time.sleep(120)
""")


def _leave_files_behind(tmp_path, sig: int) -> tuple[str, str]:
    """Start a process that spills and maps a segment, kill it with ``sig``; its spill dir and segment."""
    script = tmp_path / "victim.py"
    script.write_text(_VICTIM)
    spill = tmp_path / "spill"
    proc = subprocess.Popen([sys.executable, str(script), str(spill)], env=job_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert len(line) == 2, f"victim said {line!r}"
    finally:
        proc.send_signal(sig)
        proc.wait(60)
        proc.stdout.close()
    directory, segment = line
    # (the segment is in the machine's /dev/shm, which any process starting a Context may sweep now;
    # the spill directory is in this test's own directory)
    assert os.path.isdir(directory), "the killed process left its spill directory"
    return directory, segment


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_context_removes_what_a_killed_process_left(tmp_path, sig) -> None:
    directory, segment = _leave_files_behind(tmp_path, sig)
    try:
        mine = SpillStore(4096, str(tmp_path / "spill"))       # a live process's spill directory
        for i in range(2000):
            mine.add(i, "y" * 50)
        assert mine.directory is not None
        run_local(1, lambda ctx: None, spill_dir=str(tmp_path / "spill"))
        assert not os.path.exists(directory), "the dead process's spill directory was swept"
        assert not os.path.exists(segment), "the dead process's segment was swept"
        assert os.path.isdir(mine.directory) and len(list(mine)) == 2000, "a live store is untouched"
        mine.close()
    finally:
        shm.unlink(segment)


def test_sweep_stale_off_keeps_them(tmp_path) -> None:
    directory, segment = _leave_files_behind(tmp_path, signal.SIGKILL)
    try:
        run_local(1, lambda ctx: None, spill_dir=str(tmp_path / "spill"), sweep_stale=False)
        assert os.path.isdir(directory)
        assert directory in leftovers.sweep(str(tmp_path / "spill"))
        assert not os.path.exists(segment)
    finally:
        shm.unlink(segment)


def test_spill_sweep_leaves_other_names_users_and_live_owners(tmp_path) -> None:
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    tag = owner.namespace_tag()
    other_ns = "0" * 8 if tag != "0" * 8 else "1" * 8
    dead = tmp_path / f"twisternet-spill-{gone}-{tag}-abc123"
    other_user = tmp_path / f"twisternet-spill-{gone}-{tag}-def456"
    other_host = tmp_path / f"twisternet-spill-{gone}-{other_ns}-abc123"   # e.g. a shared NFS spill_dir
    live = tmp_path / f"twisternet-spill-{os.getpid()}-{tag}-ghi789"
    old_style = tmp_path / "twisternet-spill-k2j3h4g5"           # no pid: nobody can tell its owner
    unrelated = tmp_path / f"my-data-{gone}-abc123"
    for d in (dead, other_user, other_host, live, old_style, unrelated):
        d.mkdir()
        (d / "run-000001.bin").write_bytes(b"x")
    os.chown(other_user, 4242, 4242)
    link = tmp_path / f"twisternet-spill-{gone}-{tag}-link00"
    link.symlink_to(unrelated)
    assert leftovers.sweep_spill_dirs(str(tmp_path)) == [str(dead)]
    assert all(d.exists() for d in (other_user, other_host, live, old_style, unrelated)) and link.is_symlink()
    assert (unrelated / "run-000001.bin").exists()


def test_spill_directories_name_their_owner(tmp_path) -> None:
    store = SpillStore(1024, str(tmp_path))
    for i in range(500):
        store.add(i, "z" * 40)
    assert os.path.basename(store.directory).startswith(f"twisternet-spill-{os.getpid()}-{owner.namespace_tag()}-")
    store.close()
