"""deploy/pbs/optimus.pbs run as PBS would run it, against a fake PALS `mpiexec` (PBS is not
packaged for Debian): a $PBS_NODEFILE of three "nodes" on this machine, tests/fake_pals/mpiexec
placing one agent on each. What is proven is the script's own logic (Redis with ACL users and
persistence, two controllers, agents named by their line of the nodefile, spares, the exit
status, the nodefile filtered on a resubmission), not PALS or PBS themselves."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from cluster import ROOT, free_port, write_job

from controller.cli.main import main
from controller.schedulers.pbs import SCRIPT
from optimus.runtime import LaunchError, cpu_binding

NODES = ["localhost", "pbs-node1", "pbs-node2"]  # the first is where PBS runs the script


def run_script(tmp_path: Path, job: Path, jobid: str, *, nodes: int, pmi: str = "pals",
               hosts: list[str] = NODES, timeout: float = 100) -> subprocess.CompletedProcess:
    """The script as PBS starts it on the first node; every process it started is gone after."""
    nodefile = tmp_path / f"nodefile-{jobid}"
    nodefile.write_text("".join(f"{h}\n" for h in hosts))
    env = {**os.environ, "PBS_NODEFILE": str(nodefile), "PBS_JOBID": jobid,
           "PBS_O_WORKDIR": str(tmp_path), "FAKE_MPIEXEC_LOG": str(tmp_path / "mpiexec.log"),
           "PATH": f"{ROOT / 'tests' / 'fake_pals'}:{Path(sys.executable).parent}:"
                   f"{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "OPTIMUS_JOB_FILE": str(job), "OPTIMUS_NODES": str(nodes),
           "OPTIMUS_RANKS_PER_NODE": "1", "OPTIMUS_PMI": pmi, "OPTIMUS_HOME": str(ROOT),
           "OPTIMUS_PYTHON": sys.executable, "OPTIMUS_REDIS_PORT": str(free_port())}
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # Redis, controllers, mpiexec, agents
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
        proc.wait()


def mpiexec_calls(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "mpiexec.log").read_text().splitlines()]


def test_the_script_runs_the_job_replaces_a_killed_rank_and_a_resubmission_leaves_it_out(
        tmp_path):
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, name="pbs", steps=24,
                    faults=[{"kind": "kill_rank", "rank": 1, "step": 12}])
    first = run_script(tmp_path, job, "101.fake", nodes=2)
    assert first.returncode == 0, first.stdout[-3000:]
    assert "job pbs ended COMPLETED" in first.stdout

    journal = json.loads((run / "controller.json").read_text())
    assert (journal["job"]["state"], journal["job"]["restarts"]) == ("COMPLETED", "1")
    (culprit,) = journal["excluded"]
    assert "fault injection: rank 1 kills itself" in journal["excluded"][culprit]["reason"]
    spare = (set(NODES) - set(journal["plan"]["nodes"])) - {culprit}
    assert not spare and culprit not in journal["plan"]["nodes"]  # the spare took its place
    assert len(journal["plan"]["nodes"]) == 2

    # The standby and the agents start side by side: their calls are told apart by content.
    calls = mpiexec_calls(tmp_path)
    assert len(calls) == 2
    (standby,) = [c for c in calls if "--id" in c["argv"]]
    (agents,) = [c for c in calls if "--hostfile" in c["argv"]]
    assert standby["hosts"] == ["pbs-node1"]
    assert agents["hosts"] == NODES  # one agent per node, PALS --ppn 1
    assert agents["argv"][:7] == ["--envall", "-n", "3", "--ppn", "1", "--hostfile",
                                  str(run / "control" / "pbs-101.fake" / "hosts")]
    assert "--pmi=pmix" not in agents["argv"]
    secrets = run / "redis" / "passwords"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    assert stat.S_IMODE((run / "redis").stat().st_mode) == 0o700
    acl = (run / "redis" / "users.acl").read_text()
    assert "CHANGE-ME" not in acl
    # A user per node, each reaching its own node's keys; no shared agent user.
    users = sorted(line.split()[1] for line in acl.splitlines() if line.startswith("user "))
    assert users == sorted(["default", "optimus-controller", "optimus-operator",
                            *(f"optimus-node-{n}" for n in NODES)])
    assert "appendonly yes" in (run / "redis" / "redis.conf").read_text()
    passwords = secrets.read_text()

    # Resubmitted (PMIx this time): Redis comes back from its append-only file with the
    # exclusion, and the script leaves that node out of the agents' host list.
    second = run_script(tmp_path, job, "102.fake", nodes=2, pmi="pmix")
    assert second.returncode == 0, second.stdout[-3000:]
    assert f"leaving out {culprit}: excluded by the job" in second.stdout
    agents = [c for c in mpiexec_calls(tmp_path) if "--hostfile" in c["argv"]][-1]
    assert agents["hosts"] == [h for h in NODES if h != culprit]
    assert "--pmi=pmix" in agents["argv"] and "-n" in agents["argv"]
    assert agents["argv"][agents["argv"].index("-n") + 1] == "2"
    assert secrets.read_text() == passwords  # generated once, then reused


def test_a_failed_job_ends_the_script_with_status_1(tmp_path):
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", name="pbs-fail", steps=20,
                    faults=[{"kind": "kill_rank", "rank": 0, "step": 2}], max_restarts=0)
    done = run_script(tmp_path, job, "201.fake", nodes=1, hosts=["localhost"], timeout=60)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "job pbs-fail ended FAILED" in done.stdout


def test_too_few_nodes_after_exclusions_is_refused_in_one_line(tmp_path):
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", name="pbs-few")
    done = run_script(tmp_path, job, "301.fake", nodes=2, hosts=["localhost"], timeout=30)
    assert done.returncode == 1
    assert "1 usable node(s) for --nodes 2; ask for more (-l select)" in done.stdout


# --- optimus submit pbs ---------------------------------------------------------------------

def submit(*args: str):
    return CliRunner().invoke(main, ["submit", "pbs", str(ROOT / "jobs" / "tiny-gpt.yaml"),
                                     *args])


def test_submit_print_fills_in_the_header_and_the_settings():
    result = submit("--nodes", "4", "--spares", "2", "--ranks-per-node", "2", "--queue", "prod",
                    "--walltime", "06:00:00", "--account", "MyProj", "--filesystems",
                    "home:flare", "--pmi", "pmix")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for expected in ("#PBS -N tiny-gpt", "#PBS -l select=6", "#PBS -l walltime=06:00:00",
                     "#PBS -q prod", "#PBS -A MyProj", "#PBS -l filesystems=home:flare",
                     "#PBS -l place=scatter"):
        assert expected in lines
    settings = {line.split("=", 1)[0]: line for line in lines if line.startswith("OPTIMUS_")}
    assert settings["OPTIMUS_NODES"].startswith("OPTIMUS_NODES=${OPTIMUS_NODES:-4}")
    assert settings["OPTIMUS_RANKS_PER_NODE"].startswith("OPTIMUS_RANKS_PER_NODE="
                                                         "${OPTIMUS_RANKS_PER_NODE:-2}")
    assert f":-{ROOT / 'jobs' / 'tiny-gpt.yaml'}}}" in settings["OPTIMUS_JOB_FILE"]
    assert settings["OPTIMUS_PMI"].startswith("OPTIMUS_PMI=${OPTIMUS_PMI:-pmix}")
    assert f":-{ROOT}}}" in settings["OPTIMUS_HOME"]
    assert f":-{sys.executable}}}" in settings["OPTIMUS_PYTHON"]
    body = SCRIPT.read_text().split("set -euo pipefail", 1)[1]
    assert result.output.endswith(body)  # only the header and the settings change
    check = subprocess.run(["bash", "-n"], input=result.output, text=True, capture_output=True)
    assert check.returncode == 0, check.stderr


def test_submit_without_account_leaves_the_sites_default():
    result = submit("--nodes", "1", "--spares", "0", "--ranks-per-node", "1")
    assert result.exit_code == 0, result.output
    assert not any(line.startswith("#PBS -A") for line in result.output.splitlines())
    assert "#PBS -l select=1" in result.output.splitlines()


@pytest.mark.parametrize("args,message", [
    (("--walltime", "6h"), "--walltime '6h' is not a duration — fix: HH:MM:SS"),
    (("--walltime", "00:00:00"), "--walltime '00:00:00' is not a duration"),
    (("--walltime", "01:75:00"), "--walltime '01:75:00' is not a duration"),
    (("--queue", "prod; rm -rf ~"), "--queue 'prod; rm -rf ~' is not a queue name"),
    (("--account", "a b"), "--account 'a b' is not a project name"),
    (("--filesystems", "home,flare"), "--filesystems 'home,flare' is not a list of file"),
])
def test_submit_refuses_bad_values_in_one_line(args, message):
    result = submit("--nodes", "2", "--spares", "1", "--ranks-per-node", "1", *args)
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_submit_refuses_a_layout_the_world_cannot_hold():
    result = CliRunner().invoke(main, ["submit", "pbs", str(ROOT / "jobs" / "gpt-175b.yaml"),
                                       "--nodes", "1", "--spares", "0", "--ranks-per-node", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "gpt-175b.yaml" in result.output


def test_submit_without_qsub_says_so(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    result = submit("--nodes", "1", "--spares", "0", "--ranks-per-node", "1", "--submit")
    assert result.exit_code == 2
    assert "qsub is not on PATH" in result.output


def test_each_rank_takes_its_entry_of_the_cpu_list():
    aurora = "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100"
    assert cpu_binding(aurora, 0) == set(range(1, 9))
    assert cpu_binding(aurora, 6) == set(range(53, 61))  # core 52 is left to the system
    assert cpu_binding("list:0,2:1,3", 1) == {1, 3}
    assert cpu_binding("none", 3) is None and cpu_binding(None, 0) is None
    with pytest.raises(LaunchError, match="no entry for local rank 12"):
        cpu_binding(aurora, 12)
    with pytest.raises(LaunchError, match="'x-2' is not a CPU"):
        cpu_binding("list:x-2", 0)
