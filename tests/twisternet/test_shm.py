"""twisternet.shm: segments are created safely (0600, O_EXCL, no symlinks, reserved in full) and attached
only when they are the very file offered; a full tmpfs is an error, not a SIGBUS."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.jobs import ROOT, job_env
from twisternet import owner, shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs Linux with a tmpfs at /dev/shm")


@pytest.fixture
def segments():
    """Segments a test makes, closed and unlinked afterwards whatever happens."""
    made: list[shm.Segment] = []
    yield made
    for seg in made:
        seg.close()
        shm.unlink(seg.path)


def test_created_with_one_name_pattern_mode_0600_whatever_the_umask(segments) -> None:
    old = os.umask(0)
    try:
        seg = shm.create("ar", 3 * 4096, nonce_at=100, nonce_bytes=32)
    finally:
        os.umask(old)
    segments.append(seg)
    name = os.path.basename(seg.path)
    tag = owner.namespace_tag()
    assert name.startswith(f"{shm.PREFIX}{os.getpid()}-{tag}-ar-") and shm.owner_of(name) == (os.getpid(), tag)
    st = os.stat(seg.path)
    assert st.st_mode & 0o777 == 0o600 and st.st_size == 3 * 4096
    assert st.st_blocks * 512 >= 3 * 4096, "every page is reserved (posix_fallocate), not sparse"
    assert bytes(seg.mm[100:132]) == seg.nonce and len(seg.nonce) == 32


def test_attach_maps_the_same_memory_and_checks_everything(segments) -> None:
    seg = shm.create("slot", 8192, nonce_at=0, nonce_bytes=16)
    segments.append(seg)
    other = shm.attach(seg.path, 8192, seg.nonce, kind="slot")
    segments.append(other)
    other.array[5000] = 42
    assert seg.array[5000] == 42
    with pytest.raises(ValueError, match="nonce differs"):
        shm.attach(seg.path, 8192, b"y" * 16, kind="slot")
    with pytest.raises(ValueError, match="has 8192 bytes"):
        shm.attach(seg.path, 4096, seg.nonce, kind="slot")
    with pytest.raises(ValueError, match="of kind 'ar'"):
        shm.attach(seg.path, 8192, seg.nonce, kind="ar")
    for bad in ("/etc/passwd", "/dev/shm/other", "/dev/shm/" + shm.PREFIX + "1-00000000-slot-../../etc/passwd",
                "/dev/shm/sub/" + os.path.basename(seg.path), 17, None):
        with pytest.raises(ValueError, match="not a twisternet shared-memory segment"):
            shm.attach(bad, 8192, seg.nonce, kind="slot")


def test_attach_refuses_a_symlink_and_another_users_file(segments) -> None:
    seg = shm.create("ar", 4096, nonce_at=0, nonce_bytes=16)
    segments.append(seg)
    link = os.path.join(shm.SHM_DIR, shm.segment_name("ar"))
    os.symlink(seg.path, link)
    try:
        with pytest.raises(OSError):                 # O_NOFOLLOW: ELOOP
            shm.attach(link, 4096, seg.nonce, kind="ar")
    finally:
        os.unlink(link)
    if os.geteuid() == 0:
        os.chown(seg.path, 4242, 4242)
        with pytest.raises(ValueError, match="not a regular file of this user"):
            shm.attach(seg.path, 4096, seg.nonce, kind="ar")


def test_create_never_reuses_or_follows_an_existing_name(monkeypatch, segments) -> None:
    target = os.path.join(shm.SHM_DIR, shm.segment_name("slot"))
    with open(target, "wb") as f:
        f.write(b"someone else's")
    monkeypatch.setattr(shm, "segment_name", lambda kind, pid=None: os.path.basename(target))
    try:
        with pytest.raises(FileExistsError):
            shm.create("slot", 4096)
        with open(target, "rb") as f:
            assert f.read() == b"someone else's"
    finally:
        os.unlink(target)


def test_sweep_removes_only_dead_owners_segments_of_this_user(tmp_path) -> None:
    """(In a private directory: other processes on the machine sweep /dev/shm at any time.)"""
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    tag = owner.namespace_tag()
    other_ns = "0" * 8 if tag != "0" * 8 else "1" * 8
    names = {
        "live": os.path.basename(shm.segment_name("slot")),
        "dead_new": f"{shm.PREFIX}{gone}-{tag}-ar-0123456789abcdef",
        "dead_legacy_ar": f"twisternet-{gone}-0123456789abcdef",
        "dead_legacy_slot": f"twisternet-slot-{gone}-0123456789abcdef",
        "dead_other_user": f"{shm.PREFIX}{gone}-{tag}-slot-fedcba9876543210",
        "other_namespace": f"{shm.PREFIX}{gone}-{other_ns}-slot-0123456789abcdef",
        "not_ours": f"something-{gone}-0123456789abcdef",
        "dead_directory": f"{shm.PREFIX}{gone}-{tag}-slot-00000000000000ff",
    }
    paths = {k: str(tmp_path / v) for k, v in names.items()}
    for k, p in paths.items():
        os.mkdir(p) if k == "dead_directory" else open(p, "wb").close()
    os.chown(paths["dead_other_user"], 4242, 4242)
    removed = set(shm.sweep_stale(str(tmp_path)))
    assert removed == {paths["dead_new"], paths["dead_legacy_ar"], paths["dead_legacy_slot"]}
    assert {k for k, p in paths.items() if os.path.exists(p)} == {
        "live", "dead_other_user", "other_namespace", "not_ours", "dead_directory"}


_FULL_TMPFS = textwrap.dedent("""
    import numpy as np
    import collectives as C
    from channels import shm_slots
    from twisternet.errors import ConfigError
    from twisternet.testing import run_local

    try:                                       # the MPI channel's slots: 4 MB in a 1 MB tmpfs
        shm_slots.create_segment(4 << 20)
    except OSError as e:
        print("SLOT-ERROR", e.errno, flush=True)

    def body(ctx):                             # the shared-memory allreduce: an 8 MB segment
        op = C.AllReduce(ctx, edge=1, op="sum", via="shm", shm_chunk_bytes=1 << 20)
        try:
            op.allreduce(np.ones(1 << 18))
        except ConfigError as e:
            return "cannot share memory" in str(e)
        return False
    print("AR-FELL-BACK", run_local(2, body, timeout=60), flush=True)
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_full_tmpfs_is_an_error_not_a_sigbus(tmp_path) -> None:
    """In a private mount namespace with a 1 MB /dev/shm, both users of shared memory get a clean
    error (the slot is not offered, the allreduce says it cannot share memory) instead of SIGBUS."""
    script = tmp_path / "full.py"
    script.write_text(_FULL_TMPFS)
    cmd = ["unshare", "-m", "sh", "-c",
           f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} {script}"]
    proc = subprocess.run(cmd, env=job_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode} (-7 is SIGBUS): {proc.stdout}{proc.stderr}"
    assert "SLOT-ERROR 28" in proc.stdout and "AR-FELL-BACK [True, True]" in proc.stdout, proc.stdout
