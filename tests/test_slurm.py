"""deploy/slurm/optimus.sbatch on a real Slurm: slurmctld, three slurmd and munged on this host.

Debian's Slurm is built with multiple-slurmd support, so one host can present three nodes
(`slurmd -N n1`, each on its own port): two train and one is the spare. The test submits the
tiny job through `optimus submit slurm --submit --wait`, with rank 1 killing itself mid-run,
and checks what Slurm, the script and the controller each report: the job COMPLETED with exit
code 0, the culprit's node was excluded and the spare took its place, and a resubmission
leaves the culprit out with --exclude.

Nothing is installed here: `make slurm` (a dependency of `make test`) installs the packages.
Every daemon and every process of the job is killed at the end, pass or fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from cluster import ROOT, free_port, wait_for, write_job
from records import run_plan

from controller.cli.main import main
from controller.schedulers.slurm import time_limit_s
from optimus.checkpoint.manifest import committed_steps

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
NODES = ("n1", "n2", "n3")
STEPS, FAULT_STEP = 30, 15


def needs_slurm(test):
    test = pytest.mark.skipif(any(shutil.which(d) is None for d in DAEMONS),
                              reason="Slurm is not installed: `make slurm` installs Debian's "
                                     "slurmctld, slurmd, slurm-client and munge")(test)
    return pytest.mark.skipif(os.geteuid() != 0, reason="slurmd must run as root to start "
                              "a job's processes as its user")(test)


class SlurmCluster:
    """A private single-host Slurm cluster: its own munge key and socket, config, ports, spool
    and state directories, so that it touches nothing of the host's own setup."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                os.environ.get("PYTHONPATH")]))}
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        for d in ("munge", "state", "log", *(f"spool/{n}" for n in NODES)):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(self._config())
        munge = self.root / "munge"
        self._daemon("munged", "-F", "-f", f"--socket={munge}/socket", f"--key-file={key}",
                     f"--log-file={self.root}/log/munged.log", f"--pid-file={munge}/pid",
                     f"--seed-file={munge}/seed")
        wait_for(lambda: (munge / "socket").exists(), 10, "munged's socket")
        self._daemon("slurmctld", "-D", "-i")
        for node in NODES:
            self._daemon("slurmd", "-D", "-N", node)
        wait_for(self._idle, 30, "three idle Slurm nodes (see the logs in "
                 f"{self.root / 'log'})", interval=0.5)

    def _config(self) -> str:
        host, r = socket.gethostname(), self.root
        nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 "
                          f"Port={free_port()} CPUs=1 RealMemory=500 State=UNKNOWN"
                          for n in NODES)
        return f"""\
ClusterName=optimus-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge/socket
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/state/slurmctld.pid
SlurmdPidFile={r}/spool/%n/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={r}/log/jobcomp.txt
SchedulerType=sched/backfill
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=600
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=30 State=UP
"""

    def _daemon(self, name: str, *args: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 (closed below)
        self.procs.append(subprocess.Popen([name, *args], env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def _idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env,
                             capture_output=True, text=True).stdout.split("\n")
        return sorted(line.split()[0] for line in out if line.endswith(" idle")) == list(NODES)

    def scontrol(self, *args: str) -> str:
        return subprocess.run(["scontrol", *args], env=self.env, capture_output=True,
                              text=True, timeout=10, check=True).stdout

    def completion(self, job_id: str) -> list[dict[str, str]]:
        """What slurmctld recorded each time the job ended (jobcomp/filetxt: no database)."""
        path = self.root / "log" / "jobcomp.txt"
        records = [dict(f.split("=", 1) for f in line.split() if "=" in f)
                   for line in (path.read_text().splitlines() if path.exists() else [])]
        return [r for r in records if r.get("JobId") == job_id]

    def stop(self) -> None:
        """Cancel what still runs, stop the daemons, then kill every process that carries this
        cluster's SLURM_CONF (slurmstepd and the job's own outlive a stopped slurmd)."""
        with contextlib.suppress(Exception):
            subprocess.run(["scancel", "--user", "root", "--full"], env=self.env, timeout=10,
                           capture_output=True)
        for p in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        for pid in self._ours():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def _ours(self) -> list[int]:
        marker = f"SLURM_CONF={self.conf}\0".encode()
        pids = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and int(proc.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if marker in (proc / "environ").read_bytes():
                        pids.append(int(proc.name))
        return pids


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@needs_slurm
def test_a_killed_rank_is_replaced_on_the_spare_node(slurm, tmp_path):
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, name="slurm-e2e", steps=STEPS,
                    faults=[{"kind": "kill_rank", "rank": 1, "step": FAULT_STEP}])
    submit = [sys.executable, "-m", "controller", "submit", "slurm", str(job), "--nodes", "2",
              "--spares", "1", "--partition", "debug", "--time", "5"]
    started = time.monotonic()
    done = subprocess.run([*submit, "--submit", "--wait"], cwd=ROOT, env=slurm.env,
                          capture_output=True, text=True, timeout=170)
    job_id = _job_id(done)
    output = (run / f"slurm-{job_id}.out").read_text()
    assert done.returncode == 0, done.stdout + done.stderr + output + _logs(run)
    assert time.monotonic() - started < 170

    # Slurm's own record: the allocation ended with the job, and with exit code 0.
    (record,) = slurm.completion(job_id)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", record
    assert record["NodeList"] == "n[1-3]" and record["NodeCnt"] == "3", record

    # The controller: rank 1's node excluded, the spare in its place, generation 1 finished.
    events = [json.loads(line) for line in
              (run / "control" / f"events-slurm-{job_id}.jsonl").read_text().splitlines()]
    messages = [e["message"] for e in events]
    first = next(m for m in messages if "generation 0 on" in m)
    survivor, culprit = re.search(r"generation 0 on (n\d), (n\d)", first).groups()
    (spare,) = set(NODES) - {survivor, culprit}
    journal = json.loads((run / "controller.json").read_text())
    assert journal["job"]["state"] == "COMPLETED" and journal["job"]["restarts"] == "1"
    assert list(journal["excluded"]) == [culprit]
    assert f"rank 1 on {culprit} ended with SIGKILL" in journal["excluded"][culprit]["reason"]
    assert journal["plan"]["generation"] == 1
    assert journal["plan"]["nodes"] == [survivor, spare]
    assert any(f"node {culprit} excluded" in m for m in messages), messages
    assert any(f"spares brought in: {spare}" in m for m in messages), messages
    allocation = [e for e in events if e["kind"] == "allocation"]
    assert [e["message"] for e in allocation] == [
        f"slurm job {job_id} on n[1-3], start 0; job slurm-e2e found new"]
    assert {e["actor"] for e in events if e["kind"] == "agent"} == {f"agent:{n}" for n in NODES}
    assert f"job slurm-e2e COMPLETED; excluded: {culprit}" in output

    # Redis: persistent, with passwords only the job's user reads.
    assert (run / "redis" / "appendonlydir").is_dir()
    assert (run / "redis" / "passwords").stat().st_mode & 0o777 == 0o600
    acl = (run / "redis" / "users.acl").read_text()
    assert "CHANGE-ME" not in acl
    # A user per node, each reaching its own node's keys (the agents above ran under them).
    users = {line.split()[1]: line for line in acl.splitlines() if line.startswith("user ")}
    assert sorted(users) == ["default", "optimus-controller", "optimus-node-n1",
                             "optimus-node-n2", "optimus-node-n3", "optimus-operator"]
    for n in NODES:
        assert " ~optimus:{slurm-e2e}:node:" + n + ":* " in users[f"optimus-node-{n}"]
        assert f"(~optimus:{{slurm-e2e}}:commands:{n} +lpop)" in users[f"optimus-node-{n}"]

    # Resubmitting leaves the culprit out of the allocation.
    again = subprocess.run([*submit, "--print"], cwd=ROOT, env=slurm.env, capture_output=True,
                           text=True, timeout=60)
    assert f"#SBATCH --exclude={culprit}\n" in again.stdout


@needs_slurm
def test_a_requeued_job_resumes_from_its_checkpoint(slurm, tmp_path):
    """`scontrol requeue` kills the allocation mid-run and starts the script again: Redis
    reloads a RUNNING job whose plan names agents that are gone. The new leader must take it
    as a new submission from the latest checkpoint, not blame the nodes of the old plan."""
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, name="slurm-requeue", steps=2 * STEPS)
    done = subprocess.run([sys.executable, "-m", "controller", "submit", "slurm", str(job),
                           "--nodes", "2", "--spares", "1", "--time", "5", "--submit"],
                          cwd=ROOT, env=slurm.env, capture_output=True, text=True, timeout=60)
    job_id = _job_id(done)
    wait_for(lambda: committed_steps(run / "checkpoints"), 90, "a committed checkpoint")
    subprocess.run(["scontrol", "requeue", job_id], env=slurm.env, check=True, timeout=10)
    # Slurm holds a requeued job back (BeginTime two minutes on); an administrator's release:
    wait_for(lambda: "JobState=PENDING" in slurm.scontrol("show", "job", job_id), 30,
             "the job pending again", interval=0.2)
    slurm.scontrol("update", f"JobId={job_id}", "StartTime=now")
    records = wait_for(lambda: [r for r in slurm.completion(job_id)
                                if r["JobState"] not in ("REQUEUED", "PENDING")], 120,
                       "the job's end", interval=0.5)
    output = (run / f"slurm-{job_id}.out").read_text()
    assert [r["JobState"] for r in records] == ["COMPLETED"], output + _logs(run)
    assert records[0]["ExitCode"] == "0:0"

    events = [json.loads(line) for line in
              (run / "control" / f"events-slurm-{job_id}.jsonl").read_text().splitlines()]
    allocation = [e["message"] for e in events if e["kind"] == "allocation"]
    assert allocation[0].endswith("start 0; job slurm-requeue found new"), allocation
    assert re.search(r"start 1; job slurm-requeue found (RUNNING|STOPPING)$", allocation[1])
    assert any(e["kind"] == "resubmitted" for e in events)
    # Nobody blamed: no failure excluded a node (a restart for a hang that names no culprit,
    # "nobody excluded", is not a blame; a loaded machine has produced one here).
    blamed = [e for e in events if e["kind"] == "failure"
              and str(e.get("excluded", "0")) in ("1", "True", "true")]
    assert not blamed, f"a node of the old plan blamed: {blamed}"
    journal = json.loads((run / "controller.json").read_text())
    assert journal["job"]["state"] == "COMPLETED" and journal["excluded"] == {}
    loaded = [e["message"] for e in events if e["kind"] == "loaded"]
    assert loaded and "resumed from the checkpoint of step" in loaded[-1], loaded
    assert "(start 1)" in output and "job slurm-requeue COMPLETED" in output


def _job_id(done: subprocess.CompletedProcess) -> str:
    found = re.findall(r"Submitted batch job (\d+)", done.stdout)
    assert len(found) == 1, done.stdout + done.stderr
    return found[0]


def _logs(run: Path) -> str:
    return "".join(f"\n--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                   for p in sorted((run / "control").glob("*.log")))


# --- the script as `optimus submit slurm` fills it in: no Slurm needed --------------------------

def _submit(*args: str):
    return CliRunner().invoke(main, ["submit", "slurm", *args])


def test_the_filled_script_carries_the_values_and_the_known_bad_nodes(tmp_path):
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, name="fill")
    run.mkdir()
    (run / "controller.json").write_text(json.dumps({"excluded": {"n7": {"reason": "x"}}}))
    out = _submit(str(job), "--nodes", "4", "--spares", "2", "--ranks-per-node", "2",
                  "--time", "2", "--partition", "gpu", "--account", "proj-1",
                  "--exclude", "n[8-9]", "--set", "optim.lr=1e-3", "--no-requeue")
    assert out.exit_code == 0, out.output
    script = out.output
    for line in ("#SBATCH --nodes=6", "#SBATCH --time=2", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj-1", "#SBATCH --exclude=n7,n[8-9]",
                 "#SBATCH --no-requeue", "#SBATCH --signal=B:USR1@30",  # a quarter of 2 min
                 f"#SBATCH --output={run}/slurm-%j.out", "NODES=4", "RANKS_PER_NODE=2",
                 "SETS=(--set optim.lr=1e-3)", f"JOB_FILE={job}", "JOB_NAME=fill",
                 "STANDBY_METRICS_PORT=0"):  # the job's metrics are off: the standby's too
        assert f"\n{line}\n" in script, line
    assert "{{" not in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


@pytest.mark.parametrize("args,says", [
    (["--time", "1:0:0:0"], "--time '1:0:0:0' is not a Slurm time limit"),
    (["--partition", "a b"], "--partition 'a b' would not survive a #SBATCH line"),
    (["--exclude", "n1;reboot"], "--exclude 'n1;reboot' would not survive"),
    (["--set", "parallel.tp=3"], "does not divide the world size 2"),
    (["--wait"], "--wait waits for a submitted job"),
    (["--nodes", "0"], "0 is not in the range x>=1"),
])
def test_bad_values_are_refused_in_one_line(tmp_path, args, says):
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", name="fill")
    out = _submit(str(job), "--nodes", "2", *args)
    assert out.exit_code == 2 and says in out.output, out.output
    assert "Traceback" not in out.output


def test_a_missing_job_file_is_refused(tmp_path):
    out = _submit(str(tmp_path / "nope.yaml"), "--nodes", "1")
    assert out.exit_code == 2 and f"no job file {tmp_path / 'nope.yaml'}" in out.output


@pytest.mark.parametrize("text,seconds", [
    ("90", 5400), ("1:30", 90), ("2:00:00", 7200), ("1-0", 86400), ("1-2:3", 93780),
    ("1-2:3:4", 93784),
])
def test_slurm_time_limits_in_seconds(text, seconds):
    assert time_limit_s(text) == seconds


def test_a_new_allocation_takes_a_job_left_running_as_a_new_submission(tmp_path):
    """A requeue finds the job RUNNING (in Redis, or only in the journal if Redis lost it),
    with a plan whose agents are gone: resubmitted, exclusions kept; COMPLETED stays."""
    from cluster import RedisServer

    from controller.cli.main import _resubmit
    from controller.store.store import Store
    from optimus.config import load_job

    server = RedisServer(tmp_path)
    try:
        job = load_job(write_job(tmp_path / "job.yaml", tmp_path / "run", name="requeued"))
        store, journal = Store(server.url, "requeued"), tmp_path / "run" / "controller.json"
        store.update_job({"state": "COMPLETED"})
        _resubmit(store, job, "slurm job 7, start 1")
        assert store.job_record()["state"] == "COMPLETED"
        store.update_job({"state": "RUNNING", "generation": 4})
        store.set_plan(run_plan(4, ["n1", "n2"]))
        store.exclude("n3", "ECC errors", by="controller")
        _resubmit(store, job, "slurm job 7, start 1")
        assert store.job_record() == {} and store.plan() is None
        assert list(store.excluded()) == ["n3"]
        store.reset()  # Redis lost everything: the journal still says RUNNING
        journal.parent.mkdir(parents=True)
        journal.write_text(json.dumps({"job": {"state": "RUNNING"},
                                       "excluded": {"n4": {"reason": "lost", "by": "c"}}}))
        _resubmit(store, job, "slurm job 7, start 2")
        assert list(store.excluded()) == ["n4"] and not journal.exists()
        kinds = [(e["kind"], e["message"]) for _, e in store.events()]
        assert kinds[-1] == ("resubmitted", "job requeued was RUNNING; submitted again in a new "
                             "allocation (slurm job 7, start 2), from its latest committed "
                             "checkpoint; still excluded: n4")
    finally:
        server.stop()
