"""twisternet.malloc: glibc keeps freed memory for the next burst of decoded records.

Each case runs in a fresh interpreter: the thresholds are process-wide and set once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from twisternet.malloc import glibc

ROOT = Path(__file__).resolve().parents[2]

glibc_only = pytest.mark.skipif(not glibc(), reason="mallopt thresholds are glibc's")

#: Allocates and frees bursts of 32 records of 128 KB, as a poll's handlers do, and counts the minor
#: page faults of the second burst before tune() and of the second one after it.
BURSTS = textwrap.dedent("""
    import json, resource, sys
    import twisternet.malloc as m

    def burst():
        held = [b"\\x01" * (128 << 10) for _ in range(32)]      # every page written
        del held

    def faults_of_second_burst():
        burst()
        f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        burst()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f

    before = faults_of_second_burst()
    tuned = m.tune()
    after = faults_of_second_burst()
    print(json.dumps({"before": before, "after": after, "tuned": tuned, "state": m.state(),
                      "again": m.tune()}))
""")


def run(code: str, **env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    full.update(env, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@glibc_only
def test_a_burst_of_freed_records_is_reused_without_page_faults() -> None:
    got = run(BURSTS)
    assert got["tuned"] and got["state"] == "tuned" and got["again"]
    pages = 32 * (128 << 10) // 4096
    # glibc's defaults give the freed burst back to the system, so the next one faults its pages in again
    assert got["before"] >= pages // 2, got
    assert got["after"] < pages // 10, got


@glibc_only
def test_the_users_own_malloc_settings_are_left_alone() -> None:
    for env in ({"MALLOC_TRIM_THRESHOLD_": str(1 << 20)}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}):
        got = run(BURSTS, **env)
        assert not got["tuned"] and got["state"] == "environment", (env, got)


CONTEXT = textwrap.dedent("""
    import json
    import twisternet as tn, twisternet.malloc as m
    with tn.init() as ctx:
        print(json.dumps({"state": m.state()}))
""")


@glibc_only
def test_a_context_tunes_malloc_unless_its_configuration_says_not_to() -> None:
    assert run(CONTEXT)["state"] == "tuned"
    assert run(CONTEXT, TWISTERNET_MALLOC_TUNING="0")["state"] is None


def test_glibc_is_recognised_or_tuning_says_why_not() -> None:
    got = run("import json, twisternet.malloc as m; m.tune(); print(json.dumps({'state': m.state()}))")
    assert got["state"] == ("tuned" if glibc() else "not glibc")
