"""Drive the P4Runtime server with the real ``p4runtime-shell`` client, in its own virtual environment.

p4runtime-shell pins protobuf<3.21, p4runtime 1.4.1 and IPython 7, so it cannot share the project venv:
it lives in ``$TWISTERNET_P4SHELL_VENV`` (default ``~/.cache/twisternet/p4shell-venv``), created on first
use with ``pip install p4runtime-shell`` (that test is then ``slow``; skipped with the reason if PyPI is
unreachable). The client runs in a subprocess with a timeout, because its stream thread is not a daemon
and would hang a process that fails before ``teardown()``.

``setup(verbose=False)`` also turns off canonical bytestrings in p4runtime-shell 0.0.6 (its two options
share one enum value), so the two parametrizations exercise padded and canonical encodings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from innet.control import JobEntry, MulticastGroup
from innet.p4runtime import DEFAULT_P4INFO_PATH, serve
from innet.p4runtime.auth import p4runtime_token

from tests.innet.fake_switch import FakeSwitch

VENV = Path(os.environ.get("TWISTERNET_P4SHELL_VENV",
                           Path.home() / ".cache" / "twisternet" / "p4shell-venv"))
VENV_PYTHON = VENV / "bin" / "python"
SCRIPT_TIMEOUT = 120
TOKEN = p4runtime_token(b"job token of the shell test")
SHELL_TOKEN_DIR = Path(__file__).resolve().parents[2] / "innet" / "p4runtime"
PIP_TIMEOUT = 900


def _venv_ready() -> bool:
    return VENV_PYTHON.exists() and any(VENV.glob("lib/python*/site-packages/p4runtime_sh/shell.py"))


def _ensure_venv() -> None:
    """Create the p4runtime-shell venv if needed; skip (printing why) when it cannot be built."""
    if _venv_ready():
        return
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True,
                       capture_output=True, timeout=PIP_TIMEOUT)
        pip = subprocess.run([str(VENV / "bin" / "pip"), "install", "--disable-pip-version-check",
                              "-q", "p4runtime-shell"], capture_output=True, text=True,
                             timeout=PIP_TIMEOUT)
    except (subprocess.SubprocessError, OSError) as exc:
        reason = f"cannot create the p4runtime-shell venv at {VENV}: {exc}"
        print(reason)
        pytest.skip(reason)
    if pip.returncode != 0 or not _venv_ready():
        reason = (f"pip could not install p4runtime-shell into {VENV} (is PyPI reachable?): "
                  f"{(pip.stderr or pip.stdout).strip()[-500:]}")
        print(reason)
        pytest.skip(reason)


SHELL_SCRIPT = textwrap.dedent('''
    import json, os, sys
    addr, verbose, p4info_path, bin_path = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4]
    token_dir, token = sys.argv[5], sys.argv[6]
    if token:          # the supported way: innet/p4runtime/shell_token.py, its directory on PYTHONPATH
        import shell_token
        shell_token.install(token)
    import p4runtime_sh.shell as sh
    from p4runtime_sh.p4runtime import P4RuntimeWriteException
    from p4.v1 import p4runtime_pb2

    out = {}
    if not token:
        try:
            sh.setup(device_id=1, grpc_addr=addr, election_id=(0, 1), verbose=verbose)
            out["refused"] = None
        except BaseException as exc:  # noqa: BLE001 - whatever the shell raises, report it
            out["refused"] = repr(exc)
        print("RESULT:" + json.dumps(out), flush=True)
        os._exit(0)                             # the shell's stream thread is not a daemon
    # pushes the pipeline (SetForwardingPipelineConfig VERIFY_AND_COMMIT), then fetches the P4Info back
    sh.setup(device_id=1, grpc_addr=addr, election_id=(0, 1), verbose=verbose,
             config=sh.FwdPipeConfig(p4info_path, bin_path))
    try:
        out["canonical"] = sh.global_options.get_option(sh.Options.canonical_bytestrings)
        te = sh.TableEntry("job_table")(action="set_job")
        te.match["job_id"] = "3"
        te.action["fan_in"] = "4"
        te.action["ps_port"] = "9"
        te.action["mcast_grp"] = "2"
        te.action["level"] = "1"
        te.insert()
        out["sent_params"] = [p.value.hex() for p in te.msg().action.action.params]
        sh.MulticastGroupEntry(2).add(1).add(5).insert()
        try:
            te.insert()
            out["duplicate"] = None
        except P4RuntimeWriteException as exc:
            out["duplicate"] = [[idx, err.canonical_code, err.message] for idx, err in exc.errors]
        out["jobs"] = [[e.msg().match[0].exact.value.hex(),
                        [p.value.hex() for p in e.msg().action.action.params]]
                       for e in sh.TableEntry("job_table").read()]
        out["groups"] = [[g.group_id, [r.egress_port for r in g.replicas]]
                         for g in sh.MulticastGroupEntry().read()]
        out["counters"] = {}
        for name in ("aggregated", "forwarded", "collisions", "resends", "acks", "dropped",
                     "ecn_marked", "rejected"):
            for c in sh.CounterEntry(name).read():
                out["counters"][name] = c.packet_count
        # p4runtime-shell has no RegisterEntry: raw protobuf through its client
        reg_id = next(r.preamble.id for r in sh.context.p4info.registers
                      if r.preamble.alias == "ecn_threshold")
        update = p4runtime_pb2.Update(type=p4runtime_pb2.Update.MODIFY)
        update.entity.register_entry.register_id = reg_id
        update.entity.register_entry.index.index = 0
        update.entity.register_entry.data.bitstring = (40).to_bytes(3, "big")
        sh.client.write_update(update)
        entity = p4runtime_pb2.Entity()
        entity.register_entry.register_id = reg_id
        out["ecn_threshold"] = [int.from_bytes(e.register_entry.data.bitstring, "big")
                                for resp in sh.client.read_one(entity) for e in resp.entities]
    finally:
        sh.teardown()
    print("RESULT:" + json.dumps(out))
''')


def _make_software():
    try:
        from innet.switch import SoftwareSwitch
    except Exception as exc:  # noqa: BLE001
        reason = f"innet.switch.SoftwareSwitch unavailable: {exc!r}"
        print(reason)
        pytest.skip(reason)
    return SoftwareSwitch(num_aggregators=16, value_count=4)


_slow_unless_ready = (lambda f: f) if _venv_ready() else pytest.mark.slow


@_slow_unless_ready
@pytest.mark.timeout(PIP_TIMEOUT + SCRIPT_TIMEOUT + 60)
@pytest.mark.parametrize("make_switch, verbose", [
    pytest.param(lambda: FakeSwitch(num_aggregators=16, value_count=4), False, id="fake-padded"),
    pytest.param(_make_software, True, id="software-canonical"),
])
def test_p4runtime_shell_drives_the_switch(make_switch, verbose, tmp_path):
    _ensure_venv()
    switch = make_switch()
    if isinstance(switch, FakeSwitch):
        switch.bump("aggregated", 12)
        switch.bump("ecn_marked", 3)
    expected_counters = switch.counters()
    script = tmp_path / "drive_shell.py"
    script.write_text(SHELL_SCRIPT)
    device_config = tmp_path / "atp.bin"
    device_config.write_bytes(b"no compiled target config on this machine")
    def shell(token: str) -> dict:
        proc = subprocess.run([str(VENV_PYTHON), str(script), server.address, "1" if verbose else "0",
                               str(DEFAULT_P4INFO_PATH), str(device_config), str(SHELL_TOKEN_DIR), token],
                              capture_output=True, text=True, timeout=SCRIPT_TIMEOUT,
                              env={**os.environ, "PYTHONPATH": str(SHELL_TOKEN_DIR) if token else ""})
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT:")]
        assert proc.returncode == 0 and lines, f"shell failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return {**json.loads(lines[-1][len("RESULT:"):]), "stderr": proc.stderr}

    with serve(switch, 0, token=TOKEN) as server:
        switch.insert_job(JobEntry(77, 1, 1, 1))              # cleared by the shell's pipeline push
        refused = shell("")                                    # without the token: refused, nothing done
        assert refused["refused"] and "UNAUTHENTICATED" in refused["stderr"], refused
        assert list(switch.read_jobs()) == [JobEntry(77, 1, 1, 1)]
        out = shell(TOKEN)

    assert out["canonical"] is verbose
    # what the shell put on the wire: ps_port is bit<9>, so padded mode sends two bytes
    assert out["sent_params"] == (["04", "09", "02", "01"] if verbose else ["04", "0009", "0002", "01"])
    assert list(switch.read_jobs()) == [JobEntry(job_id=3, fan_in=4, ps_port=9, mcast_group=2, level=1)]
    assert list(switch.read_mcast_groups()) == [MulticastGroup(2, (1, 5))]
    (dup,) = out["duplicate"]
    assert dup[0] == 0 and dup[1] == 6 and "exist" in dup[2]     # google.rpc.ALREADY_EXISTS == 6
    assert out["jobs"] == [["03", ["04", "09", "02", "01"]]]     # canonical answers
    assert out["groups"] == [[2, [1, 5]]]
    assert out["counters"] == expected_counters
    assert out["ecn_threshold"] == [40] and switch.ecn_threshold() == 40
