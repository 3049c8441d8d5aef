"""`optimus train` as replicas that carry on (optimus/parallel/replica_mode.py): real rank
processes, one world per replica, the quorum file and store held here as the controller holds
them (bench/replica_train_run.py), SIGKILL for a lost replica."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from replica_train_run import JOB, Replicas  # noqa: E402

from optimus.contract.env import QUORUM_AFTER, QUORUM_FILE, REPLICA  # noqa: E402
from optimus.data.audit import audit_run  # noqa: E402
from optimus.parallel.replica_mode import ReplicaLaunch  # noqa: E402
from optimus.runtime.launch import LaunchError  # noqa: E402

TOKENS = 2 * 128  # a replica's tokens a step: 2 sequences of 128


@pytest.fixture
def replicas(tmp_path):
    made = []

    def make(**kw) -> Replicas:
        made.append(Replicas(tmp_path, **kw))
        return made[-1]
    yield make
    for r in made:
        r.close()


def losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "event" not in r}


def test_three_replicas_train_as_one_process(replicas, tmp_path):
    run = replicas(steps=6)
    run.quorum([0, 1, 2])
    procs = [run.start(r) for r in range(3)]
    run.wait(lambda: all(p.poll() is not None for p in procs))
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert run.steps_logged() == [1, 2, 3, 4, 5, 6]  # written once, by the lowest member
    assert run.events("replicas")[-1]["members"] == [0, 1, 2]
    # One process reading the whole global batch: the same losses (summation order aside).
    one = subprocess.run(
        [sys.executable, "-m", "optimus", "train", str(ROOT / "jobs" / "tiny-gpt.yaml"), *JOB,
         "--set", "optim.steps=6", "--set", f"run_dir={tmp_path / 'one'}"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    theirs = losses(json.loads(line) for line in
                    (tmp_path / "one" / "metrics.jsonl").read_text().splitlines())
    ours = losses(run.rows())
    assert ours.keys() == theirs.keys()
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-5, abs=1e-5), step


def test_a_lost_replica_leaves_the_others_stepping_and_comes_back_healed(replicas):
    run = replicas(steps=24)
    run.quorum([0, 1, 2])
    survivors = [run.start(0), run.start(1)]
    doomed = run.start(2)
    standby = run.start(2, 1)  # a spare for replica 2: only a quorum after id 1 is its
    run.wait(lambda: len(run.steps_logged()) >= 5)
    doomed.kill()
    killed_at = max(run.steps_logged())
    out = run.quorum([0, 1])  # the controller's word: replica 2 is out
    run.wait(lambda: max(run.steps_logged()) >= killed_at + 4)
    back = run.quorum([0, 1, 2])  # the spare is in
    run.wait(lambda: all(p.poll() is not None for p in [*survivors, standby]))
    assert [p.returncode for p in [*survivors, standby]] == [0, 0, 0]

    logged = run.steps_logged()
    assert logged == list(range(1, 25))  # every step once: none lost, none repeated
    formed = {e["quorum"]: e for e in run.events("quorum")}
    assert formed[out]["members"] == [0, 1]
    assert formed[back]["members"] == [0, 1, 2] and formed[back]["healed"] == [2]
    assert formed[back]["source"] == 0
    # Each step's tokens are its members': replica 2's share is missing while it was out.
    tokens = {r["step"]: r["tokens"] for r in run.rows() if "loss" in r and "event" not in r}
    per_step = {s: tokens[s] - tokens.get(s - 1, 0) for s in tokens}
    short = sorted(s for s, n in per_step.items() if n == 2 * TOKENS)
    assert short and all(n in (2 * TOKENS, 3 * TOKENS) for n in per_step.values())
    assert short == list(range(short[0], short[-1] + 1))  # one stretch: out, then back
    # (a step's row is written at the next boundary: at the kill, the step after the last
    # logged may have been exchanged by all three already)
    assert short[0] <= killed_at + 2 and short[-1] >= killed_at + 4
    ended = run.events("replicas")[-1]
    assert ended["members"] == [0, 1, 2] and ended["step"] == 24  # bit-equal: checked by them
    # Every sample was trained once, or accounted as skipped while replica 2 was out: its
    # slice of each short step, 2 of the 6 samples (indices 4 and 5 of the step's batch).
    audit = audit_run(run.tmp / "run")
    assert audit.ok, audit.lines()
    assert audit.absent == [[s, [2]] for s in short]
    assert audit.untrained == [(6 * (s - 1) + 4, 6 * s) for s in short]
    assert audit.start == 0 and audit.end == 6 * 24 and audit.steps == 24
    # The last checkpoint loads at full size in one process (no replicas).
    resumed = subprocess.run(
        [sys.executable, "-m", "optimus", "train", str(ROOT / "jobs" / "tiny-gpt.yaml"), *JOB,
         "--set", "optim.steps=25", "--set", f"run_dir={run.tmp / 'run'}"],
        cwd=run.tmp, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert max(run.steps_logged()) == 25
    assert any(e.get("step") == 24 for e in run.events("resume"))


def test_a_silent_replica_is_let_go_on_the_controllers_word(replicas):
    """SIGSTOP: no error reaches the others; their exchange waits until the quorum file names
    a quorum without it, not for the exchange's timeout (60 s here)."""
    run = replicas(steps=12, extra=("--set", "supervision.hang_floor_s=120"))
    run.quorum([0, 1, 2])
    survivors = [run.start(0), run.start(1)]
    silent = run.start(2)
    run.wait(lambda: len(run.steps_logged()) >= 4)
    silent.send_signal(signal.SIGSTOP)
    stopped_at = max(run.steps_logged())
    out = run.quorum([0, 1])
    run.wait(lambda: all(p.poll() is not None for p in survivors))
    silent.kill()
    assert [p.returncode for p in survivors] == [0, 0]
    assert run.steps_logged() == list(range(1, 13))
    failed = run.events("exchange_failed")
    assert failed and all("let go: quorum 2 leaves out replica(s) [2]" in e["error"]
                          for e in failed)
    assert {e["quorum"] for e in failed} == {1}
    assert run.events("quorum")[-1]["quorum"] == out
    assert run.events("replicas")[-1]["members"] == [0, 1]
    assert stopped_at < 12
    # Nothing waited out the exchange's timeout (supervision.hang_floor_s: 120 s here), the
    # let-go group's included: dropping it while its operation waits would block that long.
    rows = run.rows()
    last = max(r["time"] for r in rows if r.get("step") == stopped_at and "loss" in r)
    formed = next(r["time"] for r in rows if r.get("event") == "quorum" and r["quorum"] == out)
    assert formed - last < 60


def test_a_stop_told_to_one_replica_stops_every_replica_after_the_same_step(replicas):
    """SIGTERM (an operator's stop) reaches replica 1 only: its word goes to the others with
    the next exchange, and all stop after the same step; the lowest member saves it."""
    run = replicas(steps=200, extra=("--set", "checkpoint.interval=100"))
    run.quorum([0, 1, 2])
    procs = [run.start(r) for r in range(3)]
    run.wait(lambda: len(run.steps_logged()) >= 5)
    procs[1].send_signal(signal.SIGTERM)
    run.wait(lambda: all(p.poll() is not None for p in procs))
    assert [p.returncode for p in procs] == [0, 0, 0]
    stopped = max(run.steps_logged())
    assert stopped < 200
    ended = run.events("replicas")[-1]
    assert ended["members"] == [0, 1, 2] and ended["step"] == stopped  # checked: same state
    assert [e["step"] for e in run.events("stopped")] == [stopped]  # said once, by the writer
    assert "SIGTERM" in run.events("stopped")[0]["message"]
    assert (run.tmp / "run" / "checkpoints" / f"step_{stopped:09d}").is_dir()


def test_a_pause_or_checkpoint_told_to_one_replica_is_every_replicas(replicas):
    """The control word (an agent's pause, checkpoint) reaches replica 2 only: every replica
    pauses after the same step (none waits in an exchange meanwhile: the pause outlasts the
    exchange's timeout, 8 s here), resumes, and the lowest member saves the checkpoint."""
    run = replicas(steps=60, extra=("--set", "supervision.hang_floor_s=8"))
    run.quorum([0, 1, 2])
    procs = [run.start(r) for r in range(3)]
    run.wait(lambda: len(run.steps_logged()) >= 5)
    run.control(2, pause=True)
    run.wait(lambda: run.events("paused"))
    paused = run.events("paused")[0]["step"]
    time.sleep(10)  # longer than the exchange's timeout: nobody is in one
    assert max(run.steps_logged()) == paused
    run.control(2, pause=False, checkpoint=1)
    run.wait(lambda: all(p.poll() is not None for p in procs))
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert len(run.events("paused")) == 1 and len(run.events("resumed")) == 1
    assert run.steps_logged() == list(range(1, 61))
    assert run.events("exchange_failed") == []
    assert run.events("replicas")[-1]["members"] == [0, 1, 2]
    asked = [e for e in run.events("checkpoint") if "asked" in e["message"]]
    assert asked, run.events("checkpoint")


def test_two_replicas_of_two_ranks_each_heal_a_lost_replica_whole(replicas):
    """FSDP2 inside each replica: the positions' quorum groups switch after the same step (the
    replica's ranks agree on the newest quorum id with the commands), and both heal."""
    run = replicas(steps=16, replicas=2, shard=2, batch=8)
    run.quorum([0, 1])
    run.start(0)
    run.start(1)
    run.wait(lambda: len(run.steps_logged()) >= 4)
    run.procs[2].kill()  # replica 1's first rank: its partner's world breaks under it
    run.may_fail.add(3)
    killed_at = max(run.steps_logged())
    alone = run.quorum([0])  # replica 0 carries on alone
    run.wait(lambda: max(run.steps_logged()) >= killed_at + 3)
    run.start(1, alone)  # replica 1 again: a new world of two
    back = run.quorum([0, 1])
    survivors, returned = run.procs[:2], run.procs[4:]
    run.wait(lambda: all(p.poll() is not None for p in [*survivors, *returned]))
    assert [p.returncode for p in [*survivors, *returned]] == [0, 0, 0, 0]
    assert run.steps_logged() == list(range(1, 17))
    formed = {e["quorum"]: e for e in run.events("quorum")}
    assert formed[alone]["members"] == [0]
    assert formed[back]["healed"] == [1] and formed[back]["source"] == 0
    assert run.events("replicas")[-1]["members"] == [0, 1]


@pytest.mark.parametrize(("env", "words"), [
    ({REPLICA: "x"}, "OPTIMUS_REPLICA='x'"),
    ({REPLICA: "3"}, "name a replica from 0 to 2"),
    ({REPLICA: "1", QUORUM_AFTER: "-1"}, "OPTIMUS_QUORUM_AFTER='-1'"),
])
def test_a_wrong_launch_is_named(env, words):
    with pytest.raises(LaunchError, match=words):
        ReplicaLaunch.from_env(3, {QUORUM_FILE: "/q.json", **env})


def test_replicas_need_two_and_a_quorum_file():
    assert ReplicaLaunch.from_env(3, {REPLICA: "1"}) is None  # no quorum file: plain training
    with pytest.raises(LaunchError, match="need at least 2"):
        ReplicaLaunch.from_env(1, {QUORUM_FILE: "/q.json", REPLICA: "0"})
    launch = ReplicaLaunch.from_env(3, {QUORUM_FILE: "/q.json", REPLICA: "2",
                                        QUORUM_AFTER: "4"})
    # a later generation's first launch joins after the last generation's quorums: not a
    # relaunch (it resumes from the checkpoint or snapshot); the agent's launch count says so
    assert (launch.replica, launch.replicas, launch.after, launch.launch) == (2, 3, 4, 0)
    assert ReplicaLaunch.from_env(3, {QUORUM_FILE: "/q.json", REPLICA: "2", QUORUM_AFTER: "4",
                                      "OPTIMUS_REPLICA_LAUNCH": "2"}).launch == 2
    assert launch.batch_slice(1, 2) == (5, 6)  # replica 2's second rank of two: slice 5 of 6


def test_a_heals_notes_are_checked_before_anything_is_taken():
    from optimus.checkpoint.state import Progress
    from optimus.parallel.heal import HealError
    from optimus.parallel.replica_mode import ReplicaSteps

    steps = ReplicaSteps.__new__(ReplicaSteps)  # only the notes' taker: no quorum behind it
    steps.progress = Progress(6)

    class Watch:
        taken = None

        def load_state_dict(self, state):
            self.taken = state

    steps.watch = Watch()
    from optimus.metrics import MetricsLog

    steps.log = MetricsLog(None, 10, 0, None, 1, enabled=False)
    steps.log.samples(1, {"start": 0, "end": 6})  # this rank's own row of step 1
    good = {"step": 3, "tokens": 0, "data_index": 0}
    for bad in ({}, {"progress": {"step": "3", "tokens": 0, "data_index": 0}, "stability": {}},
                {"progress": {"step": 3, "tokens": -1, "data_index": 0}, "stability": {}},
                {"progress": good, "stability": []},
                {"progress": good, "stability": {}, "rows": {"step": 2}},
                {"progress": good, "stability": {}, "rows": [{"step": "2"}]},
                {"progress": good, "stability": {}, "rows": [{"step": 2}] * 65},
                # a row that is no step's (an event: the writer would log it as the run's)
                {"progress": good, "stability": {}, "rows": [{"step": 2, "event": "resume"}]}):
        with pytest.raises(HealError):
            steps._take(bad)
        assert steps.progress.step == 0 and steps.watch.taken is None  # nothing taken
        assert [r["step"] for r in steps.log.recent] == [1]
    # Checked, they are taken only when the replica's ranks all have theirs (positions.py):
    # the source's rows of the steps this rank is healed past are then kept for a catch-up;
    # its own are not replaced.
    take = steps._take({"progress": {"step": 3, "tokens": 768, "data_index": 18},
                        "stability": {"history": "{}"},
                        "rows": [{"step": 1, "loss": 9.0}, {"step": 2}, {"step": 3}]})
    assert steps.progress.step == 0 and steps.watch.taken is None
    take()
    assert (steps.progress.step, steps.progress.tokens, steps.progress.data_index) == (3, 768, 18)
    assert steps.watch.taken == {"history": "{}"}
    assert [r["step"] for r in steps.log.recent] == [1, 2, 3]
    assert "loss" not in steps.log.recent[0]
