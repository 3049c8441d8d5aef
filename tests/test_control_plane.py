"""The control plane end to end: a real redis-server, a controller, agents and gloo ranks.

Each fault is injected for real (SIGKILL, SIGSTOP, a node's agent killed with its ranks) into a
two-node job with one spare; the test checks that the culprit node is excluded, that the job
continues on the spare from the last committed checkpoint, and that its final loss equals that of
an unfaulted run resumed from the same checkpoint. Then the controller is killed under a standby,
and Redis is restarted empty under a running job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cluster import (
    ROOT,
    Processes,
    final_loss,
    maps_torch,
    metrics,
    metrics_so_far,
    train_ranks,
    wait_for,
    write_job,
)

from controller.store.store import Store
from optimus.checkpoint.manifest import committed_steps, step_dir, verify
from optimus.checkpoint.quarantine import quarantined
from optimus.data.audit import audit_run

STEPS = 30
FAULT_STEP = 15

_reference_losses: dict[tuple, float] = {}  # (resume step, moe) -> an unfaulted run's loss
MOE = {"experts": 4, "top_k": 2, "expert_ffn_dim": 64, "balance": "bias"}


def reference_loss(tmp_path_factory, faulty_run: Path, resume_step: int,
                   moe: bool = False) -> float:
    """Final loss of a plain two-rank run resumed from the faulty run's checkpoint."""
    key = (resume_step, moe)
    if key not in _reference_losses:
        ref = tmp_path_factory.mktemp(f"reference-{resume_step}")
        shutil.copytree(step_dir(faulty_run / "checkpoints", resume_step),
                        step_dir(ref / "checkpoints", resume_step))
        shutil.copytree(faulty_run / "secrets", ref / "secrets")  # the run's key: its own
        job = write_job(ref / "job.yaml", ref, steps=STEPS, **_moe(moe))
        train_ranks(job, 2)
        assert metrics(ref)[0]["event"] == "resume"
        _reference_losses[key] = final_loss(ref, STEPS)
    return _reference_losses[key]


def _moe(moe: bool) -> dict:
    return {"moe": MOE} if moe else {}


@pytest.mark.parametrize("fault,evidence,moe", [
    ({"kind": "kill_rank", "rank": 1}, "rank 1 on {node} ended with SIGKILL (9): fault "
     f"injection: rank 1 kills itself at step {FAULT_STEP}", True),
    ({"kind": "freeze_rank", "rank": 1}, "rank 1 on {node}: no heartbeat for", False),
    ({"kind": "kill_node", "node": 1}, "node {node} lost: its agent has been silent", False),
], ids=["kill_rank-moe", "freeze_rank", "kill_node"])
def test_fault_excludes_the_culprit_and_finishes_on_the_spare(fault, evidence, moe, tmp_path,
                                                              tmp_path_factory):
    run = tmp_path / "run"
    # Saves in the step (sync): step 10 is committed before the fault at step 15 however
    # loaded the machine (a thread's save of the MoE model outlasted five steps under a CPU
    # hog, and generation 1 rightly started from scratch). Async saves have tests of their own.
    # A node's fault is the agent's to carry out, at the first tick that sees the step reached
    # (heartbeats and ticks every 0.25 s): 20-odd unpaced steps late on a loaded machine, which
    # landed it in step 20's save (the survivor then did not leave that collective in process
    # within its grace, and restarted as a new process). Paced at 0.1 s a step from step 11,
    # it lands before step 20.
    pace = [{"kind": "slow_rank", "rank": r, "step": 0, "seconds": 0.1, "generation": 0}
            for r in range(2)] if fault["kind"] == "kill_node" else []
    step = 11 if fault["kind"] == "kill_node" else FAULT_STEP
    job = write_job(tmp_path / "job.yaml", run, steps=STEPS, async_mode="sync",
                    faults=[{**fault, "step": step}, *pace], **_moe(moe))
    out = subprocess.run([sys.executable, "-m", "controller", "run", str(job), "--nodes", "2",
                          "--ranks-per-node", "1", "--spares", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]

    # Generation 0 runs on the first two nodes to register; rank 1 is on the second of them.
    first = re.search(r"generation 0 on (node\d), (node\d) from scratch", out.stdout)
    assert first, out.stdout
    survivor, culprit = first.groups()
    (spare,) = {"node0", "node1", "node2"} - {survivor, culprit}
    journal = json.loads((run / "controller.json").read_text())
    assert journal["job"]["state"] == "COMPLETED", journal["job"]
    assert journal["job"]["restarts"] == "1"
    assert list(journal["excluded"]) == [culprit]
    assert evidence.format(node=culprit) in journal["excluded"][culprit]["reason"]
    assert "Error" not in journal["excluded"][culprit]["reason"]  # its own words, not a peer's
    if fault["kind"] == "kill_node":  # named in seconds: its host refused the controller's
        # connection to its agent (controller/common/probe.py), not after the 8 s timeout
        assert journal["excluded"][culprit]["reason"].endswith(
            "and its host refused a connection to it (the agent is gone)")
    assert journal["plan"]["generation"] == 1
    assert journal["plan"]["nodes"] == [survivor, spare]  # the spare took the culprit's place
    # The plan carried the port node 0's agent held for it (controller/node/ports.py): the
    # spare launched without waiting for it to be picked and relayed.
    assert 1024 <= int(journal["plan"]["master_port"]) < 65_536, journal["plan"]
    assert f"node {culprit} excluded" in out.stdout
    assert f"spares brought in: {spare}" in out.stdout
    # The survivor's rank went on in process: the same PID in generation 1 (in-process
    # restart); the spare's is a new process.
    launches = {(e["node"], e["message"].split(":")[0]): e
                for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
                if e["kind"] == "launch"}
    kept = launches[survivor, "generation 1"]
    assert (kept["in_process"], kept["pids"]) == ("1", launches[survivor, "generation 0"]["pids"])
    assert launches[spare, "generation 1"]["in_process"] == "0"
    # What the restart cost, counted once generation 1 passed the step the fault found the job
    # at (watching.track_progress): under the failure's cause, and said in an event.
    cause = {"kill_rank": "rank_exit", "freeze_rank": "heartbeat",
             "kill_node": "node_lost"}[fault["kind"]]
    lost = json.loads(journal["job"]["lost_s"])
    assert list(lost) == [cause] and lost[cause] > 0, lost
    (recovered,) = [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
                    if e["kind"] == "recovered"]
    assert (recovered["cause"], recovered["generation"]) == (cause, "1")
    assert float(recovered["seconds"]) == lost[cause]

    resumes = [m for m in metrics(run) if m.get("event") == "resume"]
    assert len(resumes) == 1  # generation 1 resumed; generation 0 started from scratch
    resume_step = resumes[0]["step"]
    # A rank's fault fires as it starts step 15: no later step can be committed (a frozen rank
    # thawed by the stop may still save this one). A node's agent kills it at its first tick
    # whose heartbeats say step 15 or later, and its ranks may be steps ahead of their last
    # heartbeat: any step of generation 0 may be the last committed, and is resumed from.
    if fault["kind"] == "kill_node":
        assert 0 < resume_step < STEPS and resume_step % 10 == 0  # a periodic save's step
    else:
        assert 0 < resume_step <= FAULT_STEP
    assert final_loss(run, STEPS) == reference_loss(tmp_path_factory, run, resume_step, moe)
    if moe:  # the experts' load went on being counted across the restart
        last = [m for m in metrics(run) if "loss" in m][-1]
        assert sum(last["moe"]["load"][0]) == 8 * 64 * 2  # batch x seq x top_k


def _agents(procs: Processes, url: str, n: int = 2) -> None:
    for i in range(n):
        procs.start(f"agent{i}", "agent", "--job", "e2e", "--node", f"node{i}", "--redis", url,
                    "--interval", "0.25")


def _rank0_step(store: Store) -> int:
    plan = store.plan()
    if not plan:
        return -1
    beat = store.rank_beats(plan["nodes"][0]).get(0)
    return beat["step"] if beat else -1


def _events(store: Store, kind: str) -> list[dict]:
    return [e for _, e in store.events(count=10_000) if e["kind"] == kind]


def test_chaos_command_reaches_the_agent_and_the_job_recovers(redis_server, procs, tmp_path):
    run = tmp_path / "run"
    # Generation 0's steps paced at 0.5 s (a sleep, not the machine's speed): the command
    # must land while it runs (under a CPU hog the job's 60 fast steps were done before the
    # `optimus chaos` process had started).
    pace = [{"kind": "slow_rank", "rank": r, "step": 0, "seconds": 0.5, "generation": 0}
            for r in range(2)]
    job = write_job(tmp_path / "job.yaml", run, steps=60, faults=pace)
    procs.start("c1", "controller", str(job), "--nodes", "2", "--ranks-per-node", "1",
                "--redis", redis_server.url, "--exit-when-done")
    _agents(procs, redis_server.url, n=3)
    store = Store(redis_server.url, "e2e")
    wait_for(lambda: _rank0_step(store) >= 3, 120, "rank 0 to reach step 3")
    holder = store.plan()["nodes"][0]  # rank 0's node
    out = subprocess.run([sys.executable, "-m", "controller", "chaos", "freeze-rank", "--job",
                          "e2e", "--rank", "0", "--redis", redis_server.url], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f"freeze-rank sent to the agent of {holder}" in out.stdout
    procs.procs["c1"].wait(timeout=180)
    record = store.job_record()
    assert record["state"] == "COMPLETED" and record["restarts"] == "1", record
    assert list(store.excluded()) == [holder]
    assert "rank 0 on" in store.excluded()[holder]["reason"]
    assert holder not in store.plan()["nodes"]


def test_standby_controller_takes_over_and_the_ranks_never_notice(redis_server, procs,
                                                                  tmp_path):
    run = tmp_path / "run"
    # min_nodes: the controllers plan the layouts of a smaller job at their start, as a job
    # that may shrink has them do (the planner, read without torch).
    job = write_job(tmp_path / "job.yaml", run, steps=80, min_nodes=1)
    lease = 2.0
    common = ["controller", str(job), "--nodes", "2", "--ranks-per-node", "1", "--redis",
              redis_server.url, "--lease", str(lease), "--exit-when-done"]
    procs.start("c1", *common, "--id", "c1")
    store = Store(redis_server.url, "e2e")
    wait_for(lambda: store.fence.leader() == "c1", 30, "c1 to lead")
    procs.start("c2", *common, "--id", "c2")
    _agents(procs, redis_server.url)
    wait_for(lambda: _rank0_step(store) >= 5, 120, "rank 0 to reach step 5")

    procs.procs["c1"].kill()  # SIGKILL, mid-run
    # How soon is the machine's to say (within a lease and a tick when quiet: 9.4 s once under
    # a CPU hog); what was decided is asserted below: c2 leads and nothing restarted.
    wait_for(lambda: store.fence.leader() == "c2", 3 * lease, "c2 to take over")
    step_at_takeover = _rank0_step(store)
    # Neither a controller nor an agent imports torch (a standby's start, a failover and every
    # agent's restart pay for no import of seconds); the ranks are other processes.
    for name in ("c2", "agent0", "agent1"):
        assert not maps_torch(procs.procs[name].pid), f"{name} imported torch"

    procs.procs["c2"].wait(timeout=180)
    record = store.job_record()
    assert record["state"] == "COMPLETED", record
    assert record["generation"] == "0" and record["restarts"] == "0"  # no new generation
    assert step_at_takeover < 80
    leaders = [e["controller"] for e in _events(store, "leader")]
    assert leaders == ["c1", "c2"]
    assert [e for e in metrics(run) if e.get("event") == "resume"] == []  # never restarted


def test_redis_restarted_empty_agents_reregister_and_the_job_continues(redis_server, procs,
                                                                      tmp_path):
    run = tmp_path / "run"
    # Paced (both ranks alike: no straggler), so that Redis dies before the last step however
    # starved this test is: a step takes a few ms, and under a CPU hog the 80 had ended (and the
    # job's record with them) before this test killed Redis.
    pace = [{"kind": "slow_rank", "rank": r, "step": 1, "seconds": 0.2} for r in (0, 1)]
    job = write_job(tmp_path / "job.yaml", run, steps=80, faults=pace)
    procs.start("c1", "controller", str(job), "--nodes", "2", "--ranks-per-node", "1",
                "--redis", redis_server.url, "--lease", "2", "--exit-when-done", "--id", "c1")
    _agents(procs, redis_server.url)
    store = Store(redis_server.url, "e2e")
    wait_for(lambda: committed_steps(run / "checkpoints"), 120, "a committed checkpoint")
    before = committed_steps(run / "checkpoints")
    step_before = _rank0_step(store)

    redis_server.kill()
    time.sleep(1.0)
    redis_server.start()  # empty: no persistence

    procs.procs["c1"].wait(timeout=180)
    record = store.job_record()
    assert record.get("state") == "COMPLETED", (record, procs.log("c1")[-3000:])
    assert record["generation"] == "0"  # the ranks trained through the outage
    assert len(_events(store, "rebuilt")) == 1
    registered = {e["node"] for e in _events(store, "register")}
    assert registered == {"node0", "node1"}  # both came back on their own
    after = committed_steps(run / "checkpoints")
    assert set(before) <= set(after) and after[-1] == 80  # nothing committed was lost
    steps = [m["step"] for m in metrics(run) if "loss" in m]
    assert steps == list(range(1, 81)) and step_before < 80


@pytest.mark.usefixtures("fresh_warm")  # every process of the run is looked for by what it holds
def test_ctrl_c_stops_the_run_with_a_committed_checkpoint_and_leaves_no_process(tmp_path):
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, steps=10_000, async_mode="process")
    p = subprocess.Popen([sys.executable, "-m", "controller", "run", str(job), "--nodes", "2",
                          "--ranks-per-node", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: any(m.get("step", 0) >= 13 for m in _metrics_or_none(run)), 120,
                 "step 13")
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out[-4000:]
    assert "job STOPPED: stopped by optimus run (Ctrl-C)" in out
    stopped = [m for m in metrics(run) if m.get("event") == "stopped"]
    assert len(stopped) == 1
    at = stopped[0]["step"]
    assert 13 <= at < 10_000
    assert committed_steps(run / "checkpoints")[-1] == at  # saved where the ranks stopped
    assert f"latest committed checkpoint: step {at}" in out
    left = subprocess.run(["pgrep", "-f", str(job)], capture_output=True, text=True).stdout
    assert left == ""  # no rank or controller left behind
    assert _holding(f"@127.0.0.1:{_redis_port(out)}/0") == []  # nor an agent (the URL is in
    # its environment, never on its command line)


def _redis_port(out: str) -> str:
    return re.search(r"Redis redis://(?:\S*@)?127.0.0.1:(\d+)/0", out).group(1)


def _holding(text: str) -> list[int]:
    """The processes whose environment holds `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def _metrics_or_none(run: Path) -> list[dict]:
    """What rank 0 has logged so far: a line it is still writing is not read yet."""
    return metrics_so_far(run)


def test_a_failed_final_save_fails_the_job_and_a_resubmission_completes_it(redis_server, procs,
                                                                           tmp_path):
    """Issue 15: a full disk fails the last step's save; the job ends FAILED with the reason,
    not COMPLETED, and is not restarted. With space again, --resubmit continues from the
    newest committed checkpoint and COMPLETED then means the final step (7, not a multiple of
    the interval) is committed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    # One checkpoint (1.9 MB) fits in 3 MiB, a second does not.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        run = tmp_path / "run"
        job = write_job(tmp_path / "job.yaml", run, steps=7)
        raw = yaml.safe_load(job.read_text())
        raw["checkpoint"].update(dir=str(disk / "ckpt"), interval=3, keep_last=1)
        job.write_text(yaml.safe_dump(raw))
        controller = ["controller", str(job), "--nodes", "1", "--ranks-per-node", "2",
                      "--redis", redis_server.url, "--exit-when-done", "--linger", "0"]
        store = Store(redis_server.url, "e2e")

        procs.start("c1", *controller)
        _agents(procs, redis_server.url, n=1)
        procs.procs["c1"].wait(timeout=120)
        record = store.job_record()
        assert record["state"] == "FAILED", (record, procs.log("c1")[-3000:])
        reason = record["reason"]
        assert reason.startswith("the final checkpoint (step 7) failed, the newest committed "
                                 "is step 3: write failed"), reason
        assert "No space left on device" in reason and "resubmit" in reason
        assert record["restarts"] == "0" and record["generation"] == "0"  # not restarted
        assert record["latest_checkpoint"] == "3"
        assert [e["message"] for e in _events(store, "failed")] == [reason]
        assert _events(store, "restarting") == []
        assert committed_steps(disk / "ckpt") == [3]
        status = subprocess.run([sys.executable, "-m", "controller", "job", "status", "--job",
                                 "e2e", "--redis", redis_server.url, "-o", "json"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        shown = json.loads(status.stdout)
        assert (shown["state"], shown["reason"], shown["latest_checkpoint"]) == (
            "FAILED", reason, 3)

        # Space again; the resubmission continues from step 3 and commits the final step.
        procs.procs["agent0"].wait(timeout=60)  # it exits once the job has ended
        subprocess.run(["mount", "-o", "remount,size=32m", str(disk)], check=True)
        procs.start("c2", *controller, "--resubmit")
        procs.start("agent0-again", "agent", "--job", "e2e", "--node", "node0", "--redis",
                    redis_server.url, "--interval", "0.25")
        procs.procs["c2"].wait(timeout=120)
        record = store.job_record()
        assert record["state"] == "COMPLETED", (record, procs.log("c2")[-3000:])
        assert record["latest_checkpoint"] == "7"
        assert committed_steps(disk / "ckpt") == [7]
        assert len(_events(store, "resubmitted")) == 1
        lines = metrics(run)
        resumes = [m["step"] for m in lines if m.get("event") == "resume"]
        assert resumes == [3]
        after = lines.index(next(m for m in lines if m.get("event") == "resume"))
        assert [m["step"] for m in lines[after:] if "loss" in m] == [4, 5, 6, 7]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _damage(path: Path, how: str) -> None:
    """The largest shard of a checkpoint: cut in half, or bytes flipped at the same size."""
    shards = list(path.glob("*.distcp"))
    # Once seen under a CPU hog: no shard there. Say what the folder held then.
    assert shards, (f"no shard in {path}: "
                    f"{sorted(q.name for q in path.parent.rglob('*'))[:200]}")
    shard = max(shards, key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_the_checkpoint_named_is_the_one_the_ranks_load_and_corrupt_ones_are_set_aside(
        redis_server, tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    # Rank 0 slows down once step 15 is saved (2 s a step): time for the test to damage it and
    # for the kill to arrive before step 20 is saved, however loaded the machine. Saves in the
    # step (sync): a thread-mode save still in flight at the next interval makes it skip, and
    # step 10 was once never saved (under a CPU hog, and once on a quiet machine).
    job = write_job(tmp_path / "job.yaml", run, steps=25, async_mode="sync", faults=[
        {"kind": "slow_rank", "rank": 0, "step": 16, "seconds": 2.0, "generation": 0}])
    p = subprocess.Popen([sys.executable, "-m", "controller", "run", str(job), "--nodes", "2",
                          "--ranks-per-node", "1", "--spares", "1", "--set",
                          "checkpoint.interval=5"], cwd=ROOT,
                         env={**os.environ, "REDIS_URL": redis_server.url},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    store = Store(redis_server.url, "e2e")
    try:
        wait_for(lambda: 15 in committed_steps(ckpts), 120, "step 15 committed")
        _damage(step_dir(ckpts, 15), "truncate")  # the controller's size check sees this one
        _damage(step_dir(ckpts, 10), "flip")  # only rank 0's sha256 sees this one
        assert committed_steps(ckpts) == [5, 10, 15]
        store.push_command(store.plan()["nodes"][1], {"kind": "kill_rank", "rank": 1})
        output, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, output[-5000:]

    # The plan named what its size check allowed, step 10; rank 0 found step 10 corrupt too,
    # set both aside and loaded step 5; the event, the job record and `job status` say so.
    plan_1 = _events(store, "generation")[1]["message"]
    assert "from the checkpoint of step 10 (newer ones fail their size check: step 15: " \
           "truncated: step_000000015/" in plan_1, plan_1
    out = subprocess.run([sys.executable, "-m", "controller", "events", "--job", "e2e", "-o",
                          "json", "--no-follow", "-n", "1000", "--kind", "loaded"], cwd=ROOT,
                         env={**os.environ, "REDIS_URL": redis_server.url},
                         capture_output=True, text=True, timeout=60)
    loaded = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(e["generation"], e["step"], e["planned_step"]) for e in loaded] == [
        ("0", "", ""), ("1", "5", "10")]
    assert json.loads(loaded[1]["quarantined"]) == [15, 10]
    assert loaded[1]["message"].startswith(
        "generation 1 resumed from the checkpoint of step 5, not from step 10 as planned: rank "
        "0 set aside step 15 (truncated: step_000000015/")
    assert "; step 10 (checksum mismatch: step_000000010/" in loaded[1]["message"]
    status = json.loads(subprocess.run(
        [sys.executable, "-m", "controller", "job", "status", "--job", "e2e", "-o", "json"],
        cwd=ROOT, env={**os.environ, "REDIS_URL": redis_server.url}, capture_output=True,
        text=True, timeout=60).stdout)
    assert (status["state"], status["resumed_generation"], status["resumed_from"]) == (
        "COMPLETED", 1, 5)
    assert status["latest_checkpoint"] == 25
    assert status["last_failure"]["cause"] == "rank_exit" and status["last_failure"]["rank"] == 1

    # Both set aside with their reasons; passing steps 10 and 15 again saved them afresh.
    assert [(q["step"], q["kind"]) for q in quarantined(ckpts)] == [
        (15, "corrupt"), (10, "corrupt")]
    assert committed_steps(ckpts) == [5, 10, 15, 20, 25]
    assert all(verify(step_dir(ckpts, s)) == [] for s in committed_steps(ckpts))
    # Across the restart, every sample was read once by the steps that count.
    audit = audit_run(run)
    assert audit.ok, audit.problems
    assert (audit.steps, audit.generations, audit.end) == (25, 2, 25 * 8)
    assert audit.repeated >= 10  # generation 0 got past step 15
