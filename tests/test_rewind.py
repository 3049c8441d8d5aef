"""Rewinds end to end: a real redis-server, a controller, agents and gloo ranks.

A poisoned step (the `spike` fault: random tokens for one step's batch) with
`stability.on_spike: rewind`: every rank stops before the step's update, the controller sets the
abandoned line aside (a checkpoint inside the window goes to quarantine), the next generation
resumes from before the window, skips its batches and completes; its final loss is within noise
of an unpoisoned run's, and `optimus data audit` finds every sample read once but the skipped
ones. Then the operators' side on a running job: `optimus chaos spike` makes the rules rewind,
and `optimus job rewind` goes back by hand."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml
from cluster import ROOT, final_loss, metrics, train_ranks, wait_for, write_job

from controller.store.store import Store
from optimus.checkpoint.quarantine import quarantined
from optimus.data.audit import audit_run

STEPS, SPIKE = 30, 20
# Armed from step 9; a spike is > 50% above the window's mean: random tokens give ~5x the
# loss, and a tiny model's noisy late steps (+15% in a step) raise no false alarm.
STABILITY = {"warmup_steps": 8, "window": 8, "on_spike": "rewind", "loss_min_rise": 0.5}


def _job(path, run, faults=(), steps=STEPS, **stability):
    job = write_job(path, run, steps=steps, faults=list(faults), async_mode="sync",
                    memory_every=2)
    raw = yaml.safe_load(job.read_text())
    raw["checkpoint"]["interval"] = 5
    raw["stability"] = {**STABILITY, **stability}
    job.write_text(yaml.safe_dump(raw))
    return job


def _events(run) -> list[dict]:
    return [json.loads(t) for t in (run / "events.jsonl").read_text().splitlines()]


def test_a_spike_is_rewound_its_window_skipped_and_the_run_completes(tmp_path):
    run = tmp_path / "run"
    job = _job(tmp_path / "job.yaml", run, [{"kind": "spike", "step": SPIKE}],
               rewind_skip_before=6)  # the window: steps 14..20; resume at or before 13
    out = subprocess.run([sys.executable, "-m", "controller", "run", str(job), "--nodes", "2",
                          "--ranks-per-node", "1", "--spares", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    journal = json.loads((run / "controller.json").read_text())
    assert journal["job"]["state"] == "COMPLETED", journal["job"]
    assert journal["job"]["restarts"] == "0"  # a rewind is no failure
    assert json.loads(journal["job"]["restart_causes"]) == {"rewind": 1}
    assert journal["excluded"] == {}

    lines = metrics(run)
    (verdict,) = [m for m in lines if m.get("event") == "stability"]
    assert (verdict["step"], verdict["verdict"], verdict["action"]) == (SPIKE, "spike", "rewind")
    (rewind,) = [e for e in _events(run) if e["kind"] == "rewind"]
    assert (rewind["step"], rewind["first"], rewind["last"], rewind["to"]) == (
        str(SPIKE), "14", "20", "13")
    (resumed,) = [m for m in lines if m.get("event") == "resume"]
    assert resumed["step"] in (10, 12), resumed  # disk at 10, or the memory snapshot at 12
    # The line the rewind abandoned: its checkpoint of step 15 set aside, none newer made.
    assert [q["step"] for q in quarantined(run / "checkpoints")] == [15]
    (skip,) = [m for m in lines if m.get("event") == "data_skip"]
    assert (skip["step"], skip["start"], skip["end"]) == (14, 13 * 8, 20 * 8)
    (rewinds,) = [json.loads(journal["job"]["rewinds"])]
    assert rewinds[0]["resume_step"] == resumed["step"] and rewinds[0]["by"] == "controller"

    audit = audit_run(run)
    assert audit.ok, audit.problems
    assert audit.unread == [(13 * 8, 20 * 8)] and audit.skipped == []

    # Within noise of a run that never saw the poisoned batch (nor skipped any).
    ref = tmp_path / "ref"
    train_ranks(_job(tmp_path / "ref.yaml", ref, on_spike="warn"), 2)
    clean, rewound = final_loss(ref, STEPS), final_loss(run, STEPS)
    assert abs(rewound - clean) < 0.05 * clean, (rewound, clean)
    assert max(m["loss"] for m in metrics(ref) if "loss" in m and m["step"] > 10) < \
        verdict["value"]  # and the spike was one


def _optimus(*args: str, url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller", *args, "--job", "e2e",
                           "--redis", url], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)


def _ok(*args: str, url: str) -> subprocess.CompletedProcess:
    out = _optimus(*args, url=url)
    assert out.returncode == 0, f"optimus {' '.join(args)}: {out.stdout}{out.stderr}"
    return out


def test_an_operators_chaos_spike_and_rewind_on_a_running_job(redis_server, procs, tmp_path):
    run = tmp_path / "run"
    # Each pause below is asked for once the job is past a step: a 70-step job that ran flat
    # out finished before the second pause reached it under a CPU hog. Paced (0.3 s a step in
    # every rank of the three generations), 84 steps leave the second pause 10 s or more
    # however fast the machine, and the job ends soon after the last command.
    pace = [{"kind": "slow_rank", "rank": r, "step": 0, "seconds": 0.3, "generation": g}
            for r in (0, 1) for g in range(3)]
    # The spike lands 3 steps after the pause, at step 19 or later: in the first steps the loss
    # falls so fast that 6 sigma of the window reached a random batch's loss (~5.9: a quiet
    # run paused at 13 and its spike at 16 stayed under a threshold of 6.08). At 3 sigma the
    # threshold from step 19 on is ~4.2; a tiny model's noisy late steps are held off by
    # `loss_min_rise` (50%).
    job = _job(tmp_path / "job.yaml", run, pace, steps=84, loss_sigma=3.0)
    procs.start("c1", "controller", str(job), "--nodes", "2", "--ranks-per-node", "1",
                "--redis", redis_server.url, "--exit-when-done")
    for i in range(3):
        procs.start(f"agent{i}", "agent", "--job", "e2e", "--node", f"node{i}",
                    "--redis", redis_server.url, "--interval", "0.25")
    store = Store(redis_server.url, "e2e")
    wait_for(lambda: (store.summaries.furthest_step() or 0) >= 16, 180, "step 16")
    # Paused while the commands go out: what they ask for does not race a fast job.
    _ok("job", "pause", "--yes", "--wait", url=redis_server.url)
    at = store.summaries.furthest_step() + 3
    out = _optimus("chaos", "spike", "--at-step", str(at), "--yes", url=redis_server.url)
    assert out.returncode == 0, out.stderr
    assert f"every rank poisons its share of step {at}'s batch" in out.stdout
    _ok("job", "resume", "--yes", url=redis_server.url)
    wait_for(lambda: int(store.job_record().get("generation", 0)) >= 1, 180, "the rewind")
    (auto,) = json.loads(store.job_record()["rewinds"])
    assert (auto["step"], auto["first"], auto["last"], auto["by"]) == (at, at, at, "controller")

    wait_for(lambda: (store.summaries.furthest_step() or 0) >= at + 8, 180, f"step {at + 8}")
    _ok("job", "pause", "--yes", "--wait", url=redis_server.url)
    back = at + 2
    out = _optimus("job", "rewind", "--to", str(back), "--skip-samples", "12", "--reason",
                   "a bad shard", "--yes", "--wait", url=redis_server.url)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"resumes from the newest point at or before step {back} and skips the batches of " \
           f"steps {back + 1}..{back + 2}" in out.stdout  # 12 samples: two batches of 8
    assert "job PAUSED" in out.stdout or "job PAUSING" in out.stdout  # a pause outlasts it
    _ok("job", "resume", "--yes", url=redis_server.url)
    procs.procs["c1"].wait(timeout=300)
    record = store.job_record()
    assert record["state"] == "COMPLETED", record
    hand = json.loads(record["rewinds"])[-1]
    assert (hand["to"], hand["first"], hand["last"], hand["reason"]) == (
        back, back + 1, back + 2, "asked by " + hand["by"] + ": a bad shard")
    assert hand["resume_step"] <= back
    status = json.loads(_optimus("job", "status", "-o", "json", url=redis_server.url).stdout)
    assert (status["rewinds"], status["last_rewind"]["to"]) == (2, back)
    assert status["skips"] == [[at, at], [back + 1, back + 2]]
    audit = audit_run(run)
    assert audit.ok, audit.problems
    # the second window's steps read one batch on already (the first window's)
    assert audit.unread == [((at - 1) * 8, at * 8), ((back + 1) * 8, (back + 3) * 8)], \
        audit.unread
