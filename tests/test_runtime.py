"""Launch environments, device and backend choice, and the rank harness (the layout and its
mesh: tests/test_layout.py)."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from multiproc import RanksFailed, RanksTimedOut

from optimus.runtime import (
    DeviceError,
    LaunchEnv,
    LaunchError,
    device_name,
    expand_hostlist,
    launch_env,
    max_over_ranks,
    pick_backend,
    pick_device,
)
from optimus.runtime.launch import derived_port, expand_tasks_per_node

# --- launch environments -------------------------------------------------------------------


def test_single_process_when_no_launcher():
    env = launch_env({"HOME": "/root"})
    assert env == LaunchEnv(0, 0, 1, 1, 0, 1, "", 0, "127.0.0.1", 29500, "single")


def test_agent_variables():
    env = launch_env(
        {
            "OPTIMUS_RANK": "13",
            "OPTIMUS_LOCAL_RANK": "1",
            "OPTIMUS_WORLD_SIZE": "24",
            "OPTIMUS_LOCAL_WORLD_SIZE": "12",
            "OPTIMUS_NODE_RANK": "1",
            "OPTIMUS_NUM_NODES": "2",
            "OPTIMUS_JOB_ID": "llama-moe",
            "OPTIMUS_GENERATION": "3",
            "OPTIMUS_MASTER_ADDR": "x1000c0s0b0n0",
            "OPTIMUS_MASTER_PORT": "31234",
        }
    )
    assert env == LaunchEnv(13, 1, 24, 12, 1, 2, "llama-moe", 3, "x1000c0s0b0n0", 31234, "agent")


def test_torchrun_variables():
    env = launch_env(
        {
            "RANK": "5",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "29400",
            "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_RUN_ID": "run7",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    assert env == LaunchEnv(5, 1, 8, 4, 1, 2, "run7", 2, "node0", 29400, "torchrun", True)


def test_slurm_with_compressed_nodelist_and_tasks_per_node():
    env = launch_env(
        {
            "SLURM_PROCID": "6",
            "SLURM_LOCALID": "2",
            "SLURM_NTASKS": "8",
            "SLURM_TASKS_PER_NODE": "4(x2)",
            "SLURM_NODEID": "1",
            "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "nid[001-003,010],login2",
            "SLURM_JOB_ID": "4242",
            "SLURM_RESTART_COUNT": "1",
        }
    )
    assert env == LaunchEnv(6, 2, 8, 4, 1, 2, "4242", 1, "nid001", derived_port("4242"), "slurm")
    assert 20000 <= env.master_port <= 29999


def test_slurm_uneven_tasks_per_node():
    env = launch_env(
        {
            "SLURM_PROCID": "8",
            "SLURM_LOCALID": "0",
            "SLURM_NTASKS": "9",
            "SLURM_TASKS_PER_NODE": "4(x2),1",
            "SLURM_NODEID": "2",
            "SLURM_NNODES": "3",
            "SLURM_JOB_NODELIST": "gpu-[07-09]",
        }
    )
    assert (env.local_world_size, env.num_nodes, env.master_addr) == (1, 3, "gpu-07")


def test_hostlist_and_tasks_expansion():
    assert expand_hostlist("nid[001-003,010],login2") == [
        "nid001",
        "nid002",
        "nid003",
        "nid010",
        "login2",
    ]
    assert expand_hostlist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]
    assert expand_tasks_per_node("4(x2),3") == [4, 4, 3]


def test_pals_on_aurora(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x4102c5s0b0n0.hostmgmt\nx4102c5s1b0n0.hostmgmt\n")
    base = {
        "PALS_RANKID": "13",
        "PALS_LOCAL_RANKID": "1",
        "PALS_NODEID": "1",
        "PALS_LOCAL_SIZE": "12",
        "PALS_DEPTH": "8",
        "PMIX_RANK": "13",
        "PBS_NODEFILE": str(nodefile),
        "PBS_JOBID": "123456.aurora-pbs-0001",
    }
    env = launch_env({**base, "PMI_SIZE": "24"})
    expected = LaunchEnv(
        13,
        1,
        24,
        12,
        1,
        2,
        "123456.aurora-pbs-0001",
        0,
        "x4102c5s0b0n0.hostmgmt",
        derived_port("123456.aurora-pbs-0001"),
        "pals",
    )
    assert env == expected
    # Under --pmi=pmix without PMI_SIZE: PALS_LOCAL_SIZE x hosts in the node file.
    assert launch_env(base) == expected


def test_openmpi_variables():
    env = launch_env(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_COMM_WORLD_NODE_RANK": "1",
            "PMIX_RANK": "3",
            "MASTER_ADDR": "10.0.0.1",
        }
    )
    assert env == LaunchEnv(3, 1, 4, 2, 1, 2, "", 0, "10.0.0.1", 29500, "openmpi")


def test_precedence_agent_then_torchrun_then_slurm():
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}
    torchrun = {"RANK": "2", "WORLD_SIZE": "4"}
    agent = {"OPTIMUS_RANK": "3", "OPTIMUS_WORLD_SIZE": "8"}
    assert launch_env(slurm).launcher == "slurm"
    assert launch_env({**slurm, **torchrun}).rank == 2
    env = launch_env({**slurm, **torchrun, **agent})
    assert (env.launcher, env.rank, env.world_size) == ("agent", 3, 8)


def test_explicit_master_address_and_port_win_under_another_launcher():
    env = launch_env({"RANK": "0", "WORLD_SIZE": "2", "SLURM_JOB_ID": "7",
                      "MASTER_ADDR": "override-host", "MASTER_PORT": "32000"})
    assert (env.launcher, env.master_addr, env.master_port) == ("torchrun", "override-host",
                                                                32000)


def test_under_an_agent_the_plans_address_and_port_win_over_a_batch_templates():
    """A site's template exports MASTER_ADDR (the first node of the allocation): under an
    agent rank 0 moves with the generations, so the plan's address is the one to wait on."""
    env = launch_env(
        {
            "OPTIMUS_RANK": "0",
            "OPTIMUS_WORLD_SIZE": "2",
            "OPTIMUS_MASTER_ADDR": "agent-host",
            "OPTIMUS_MASTER_PORT": "31000",
            "MASTER_ADDR": "override-host",
            "MASTER_PORT": "32000",
        }
    )
    assert (env.launcher, env.master_addr, env.master_port) == ("agent", "agent-host", 31000)


def test_an_agents_ranks_do_not_inherit_another_launchers_variables():
    from controller.node.spawn import launcher_variables, rank_environment

    env = {"MASTER_ADDR": "10.231.0.10", "MASTER_PORT": "29500", "RANK": "3",
           "WORLD_SIZE": "8", "LOCAL_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "REDIS_URL": "redis://x", "PATH": "/bin", "OPTIMUS_JOB": "j", "SLURM_JOB_ID": "7"}
    assert rank_environment(env) == {"PATH": "/bin", "OPTIMUS_JOB": "j", "SLURM_JOB_ID": "7"}
    assert launcher_variables(env) == ["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RANK",
                                       "TORCHELASTIC_USE_AGENT_STORE", "WORLD_SIZE"]


def test_port_derived_from_job_id_is_stable_and_in_range():
    ports = {derived_port(f"job{i}") for i in range(200)}
    assert all(20000 <= p <= 29999 for p in ports) and len(ports) > 150
    assert derived_port("job1") == derived_port("job1")
    assert derived_port("") == 29500


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not below world size WORLD_SIZE=4"),
        ({"RANK": "one", "WORLD_SIZE": "4"}, "RANK='one' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "LOCAL_RANK=2 is not below local world size LOCAL_WORLD_SIZE=2",
        ),
        (
            {"OPTIMUS_RANK": "0", "OPTIMUS_WORLD_SIZE": "2", "OPTIMUS_LOCAL_WORLD_SIZE": "4"},
            "OPTIMUS_LOCAL_WORLD_SIZE=4 exceeds world size OPTIMUS_WORLD_SIZE=2",
        ),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4x2"},
            "SLURM_TASKS_PER_NODE='4x2'",
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            "set MASTER_ADDR",
        ),
        ({"PALS_RANKID": "0"}, "PALS_LOCAL_SIZE, PMI_LOCAL_SIZE"),
    ],
)
def test_launch_errors_name_the_variable(environ, message):
    with pytest.raises(LaunchError) as info:
        launch_env(environ)
    assert message in str(info.value)


# --- devices and backends ------------------------------------------------------------------


def test_auto_device_and_backend_on_cpu():
    device = pick_device("auto", local_rank=3)
    assert device == torch.device("cpu")
    assert pick_backend(device) == "gloo"
    assert device_name(device) == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without cuda")
def test_requesting_missing_cuda_is_refused():
    with pytest.raises(DeviceError, match="'cuda' was requested .* use device 'auto' or 'cpu'"):
        pick_device("cuda")
    with pytest.raises(DeviceError, match="unknown device 'tpu'"):
        pick_device("tpu")


def test_backend_requests():
    cpu = torch.device("cpu")
    with pytest.raises(DeviceError, match="end-of-life .* use backend 'xccl'"):
        pick_backend(cpu, "ccl")
    with pytest.raises(DeviceError, match="'nccl' cannot move cpu tensors; for cpu use gloo"):
        pick_backend(cpu, "nccl")
    with pytest.raises(DeviceError, match="'gloo' cannot move xpu tensors; for xpu use xccl"):
        pick_backend(torch.device("xpu", 0), "gloo")
    assert pick_backend(cpu, "GLOO") == "gloo"


# --- the harness itself --------------------------------------------------------------------


def _world_info(rank, world_size, scale):
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return rank * scale, dist.get_world_size(), value.item(), os.environ["OMP_NUM_THREADS"]


def _fails_on_rank_1(rank, world_size):
    if rank == 1:
        raise KeyError("missing-shard-17")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for rank 1 in a collective
    return rank


def _dies_on_rank_0(rank, world_size):
    if rank == 0:
        os._exit(7)
    return rank


def _aborts_on_rank_1(rank, world_size):
    if rank == 1:
        os.abort()  # a native crash, as a C++ assertion in a kernel would be
    return rank


def _hangs_on_rank_2(rank, world_size):
    if rank == 2:
        time.sleep(60)
    return rank


def test_harness_returns_results_by_rank(run_ranks):
    results = run_ranks(_world_info, 3, 10)
    assert results == [(0, 3, 3.0, "1"), (10, 3, 3.0, "1"), (20, 3, 3.0, "1")]


def test_harness_shows_a_failing_rank_traceback(run_ranks):
    with pytest.raises(RanksFailed) as info:
        run_ranks(_fails_on_rank_1, 2)
    text = str(info.value)
    first = text.split("--- rank ")[1]
    assert first.startswith("1 ---") and "Traceback" in first
    assert "_fails_on_rank_1" in first and "KeyError: 'missing-shard-17'" in first


def test_harness_reports_a_rank_that_died(run_ranks):
    with pytest.raises(RanksFailed, match="rank 0 exited with code 7"):
        run_ranks(_dies_on_rank_0, 2)


def test_harness_shows_where_a_rank_crashed_natively(run_ranks):
    with pytest.raises(RanksFailed) as info:
        run_ranks(_aborts_on_rank_1, 2)
    text = str(info.value)
    assert f"rank 1 exited with code -{signal.SIGABRT}; its last stacks" in text
    assert "Fatal Python error: Aborted" in text and "in _aborts_on_rank_1" in text


def test_harness_kills_a_hung_rank_at_the_timeout(run_ranks):
    # 10 s: room for ranks 0 and 1 to start and finish on a loaded machine; only rank 2 hangs.
    with pytest.raises(RanksTimedOut, match=r"ranks \[2\] of 3 did not finish within 10 s"):
        run_ranks(_hangs_on_rank_2, 3, timeout=10)


# --- memory ---------------------------------------------------------------------------------

GIB = 1 << 30
PEAKS = [{"allocated_bytes": 5 * GIB, "reserved_bytes": 9 * GIB},  # rank 0
         {"allocated_bytes": 7 * GIB + 3, "reserved_bytes": 8 * GIB},
         {"allocated_bytes": 6 * GIB, "reserved_bytes": 9 * GIB}]


def _max_over_ranks(rank, world_size):
    return max_over_ranks(PEAKS[rank], rank)


def _over_a_host_group(rank, world_size):
    """What a rank under nccl does at its step boundary, on the gloo group made beside it
    (here the default group is gloo too: the host group is made as for nccl all the same)."""
    from optimus.runtime.dist import LAZY_GLOO, host_group
    from optimus.supervision.commands import Command, Commands

    group = host_group("nccl")
    commands = Commands(world_size, torch.device("cpu"), control_file="")
    commands.group = group
    if rank == 2:
        commands.requested |= Command.PAUSE
    agreed = commands.agree()
    return {"backend": dist.get_backend(group), "size": group.size(),
            "memory": max_over_ranks(PEAKS[rank], rank, group), "pause": bool(agreed.pause),
            "lazy_left_set": LAZY_GLOO in os.environ}


def test_the_boundary_agrees_on_a_host_group_beside_the_devices(run_ranks):
    results = run_ranks(_over_a_host_group, 3)
    assert {r["backend"] for r in results} == {"gloo"} and {r["size"] for r in results} == {3}
    assert all(r["pause"] for r in results)  # rank 2's request, seen by all
    assert all(r["memory"]["allocated_rank"] == 1 for r in results)
    assert not any(r["lazy_left_set"] for r in results)  # the lazy setting was for that group


def test_max_over_ranks_finds_the_largest_peaks_and_their_ranks(run_ranks):
    results = run_ranks(_max_over_ranks, 3)
    # Exact bytes; a tie (9 GiB reserved on ranks 0 and 2) names the lowest rank.
    expected = {"allocated_bytes": 7 * GIB + 3, "allocated_rank": 1,
                "reserved_bytes": 9 * GIB, "reserved_rank": 0}
    assert results == [expected] * 3
