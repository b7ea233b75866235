"""Launcher detection from the environment alone (twisternet.launch_env)."""

from __future__ import annotations

import pytest

from twisternet.errors import ConfigError, LaunchEnvError
from twisternet.launch_env import DEFAULT_PORT, announced_world, detect, expand_nodelist


@pytest.mark.parametrize("spec, hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("gpu[001-002],cpu7", ["gpu001", "gpu002", "cpu7"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x[3],y", ["x3", "y"]),
])
def test_expand_nodelist(spec, hosts):
    assert expand_nodelist(spec) == hosts


@pytest.mark.parametrize("spec", ["node[01-", "node]1", "node[4-2]", "node[a-b]", ""])
def test_expand_nodelist_rejects_garbage(spec):
    with pytest.raises(LaunchEnvError):
        expand_nodelist(spec)


def test_nothing_is_a_one_process_job():
    info = detect({})
    assert info.launcher == "none" and info.master is None and not info.hosts_master


def test_twisternet_run_wins():
    info = detect({"TWISTERNET_MASTER": "h:1", "TWISTERNET_RANK": "2", "TWISTERNET_WORLD": "4", "RANK": "0",
                   "WORLD_SIZE": "4", "MASTER_ADDR": "x", "MASTER_PORT": "1"})
    assert (info.launcher, info.rank, info.world) == ("twisternet", 2, 4)


def test_mpi_before_slurm_and_torchrun():
    env = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
           "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"}
    info = detect(env)
    assert (info.launcher, info.rank, info.world, info.local_rank, info.local_world) == ("mpi", 1, 4, 1, 2)
    assert info.master is None


def test_torchrun():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "node07", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc"}
    info = detect(env)
    assert (info.launcher, info.rank, info.world, info.local_rank, info.local_world) == ("torchrun", 3, 4, 1, 2)
    assert info.master == ("node07", 29501)       # MASTER_PORT itself is torch's TCPStore
    assert info.job_id == "abc" and not info.hosts_master
    assert detect({**env, "RANK": "0"}).hosts_master
    assert detect({**env, "TWISTERNET_MASTER_PORT": "4000"}).master == ("node07", 4000)
    assert info.store is None


def test_torchrun_with_the_agent_store_publishes_a_free_port():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node07", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}
    info = detect(env)
    assert info.master == ("node07", 0) and info.store == ("node07", 29500)
    assert info.store_key == "twisternet/abc/2/master_port"
    fixed = detect({**env, "TWISTERNET_MASTER_PORT": "4000"})
    assert fixed.master == ("node07", 4000) and fixed.store is None


def test_a_port_never_published_in_the_agent_store_is_a_clear_error():
    torch = pytest.importorskip("torch", reason="torch is in the dev extra (pip install '.[dev]')")
    from datetime import timedelta

    from twisternet.errors import TwisternetError
    from twisternet.rendezvous import _published_port
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=1))
    info = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port),
                   "TORCHELASTIC_USE_AGENT_STORE": "True"})
    client = torch.distributed.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=1))
    with pytest.raises(TwisternetError, match="did not publish the bootstrap port"):
        _published_port(client, info, 1.0)
    server.set(info.store_key, "4711")
    assert _published_port(client, info, 1.0) == 4711


def test_torchrun_without_master_says_what_is_missing():
    with pytest.raises(LaunchEnvError, match="MASTER_PORT") as e:
        detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    assert isinstance(e.value, ConfigError)


def test_rank_must_be_below_world():
    with pytest.raises(LaunchEnvError, match="rank 4 but a world of 4"):
        detect({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(LaunchEnvError, match="RANK"):
        detect({"RANK": "x", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_slurm_step():
    env = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_STEP_ID": "0",
           "SLURM_STEP_NODELIST": "node[03-04,07,09]", "SLURM_JOB_NODELIST": "node[01-09]", "SLURM_JOB_ID": "123456"}
    info = detect(env)
    assert (info.launcher, info.rank, info.world, info.local_rank, info.local_world) == ("slurm", 5, 8, 1, 2)
    assert info.master == ("node03", 20000 + 123456 % 20000)
    assert info.job_id == "123456"
    assert detect({**env, "TWISTERNET_MASTER_PORT": "7777"}).master == ("node03", 7777)


def test_slurm_batch_script_with_several_tasks_is_an_error():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "9"}
    with pytest.raises(LaunchEnvError, match="srun"):
        detect(env)
    with pytest.raises(LaunchEnvError, match="srun"):
        detect({**env, "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "4294967294"})
    # a one-task allocation running the script directly is a one-process job
    assert detect({**env, "SLURM_NTASKS": "1"}).launcher == "none"


def test_kubernetes_indexed_job():
    env = {"JOB_COMPLETION_INDEX": "2", "TWISTERNET_WORLD": "4", "TWISTERNET_K8S_SERVICE": "tn",
           "HOSTNAME": "wordcount-2"}
    info = detect(env)
    assert (info.launcher, info.rank, info.world) == ("kubernetes", 2, 4)
    assert info.master == ("wordcount-0.tn", DEFAULT_PORT)
    for var in ("TWISTERNET_WORLD", "TWISTERNET_K8S_SERVICE"):
        with pytest.raises(LaunchEnvError, match=var):
            detect({k: v for k, v in env.items() if k != var})
    with pytest.raises(LaunchEnvError, match="Indexed"):
        detect({**env, "HOSTNAME": "wordcount-abcde"})


def test_announced_world():
    assert announced_world({}) is None
    assert announced_world({"WORLD_SIZE": "1"}) is None
    assert announced_world({"WORLD_SIZE": "4"}) == ("WORLD_SIZE", 4)
    assert announced_world({"PMI_SIZE": "2"}) == ("PMI_SIZE", 2)
