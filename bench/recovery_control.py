"""bench/recovery.py's `replica-control` mode: a lost replica under replicas that carry on, under
the whole control plane (controller, agents, Redis; docs/replicas.md), where the `replica` mode
(bench/recovery_replicas.py) names the quorums itself.

Three replicas of the bench's tiny job, one node of one rank each (warm starts); the node is kept
on a failure (flaky_failures high), so each trial's replica restarts on it. Per trial, once the
job has logged 13 steps since the last rejoin: the agent of replica 1's node kills its rank
(`optimus chaos`'s path), and from the run's own record:

- decision: the controller's `replica_lost` event, from the injection (its `chaos` event);
- the survivors' largest gap, in median steps of the 10 before the kill (the time between two
  steps logged by the writer, replica 0): across the kill, to the survivors' first step without
  the lost replica (target <= 2); while it is out (its relaunch shares these two cores with
  them); while it rejoins (the survivors meet it and heal it);
- fault -> next step: from the injection to the first step the survivors trained without it;
- rejoin: from the decision to the quorum that heals it (the ranks' `quorum` event), the heal's
  own time in it, and the relaunch in between;
- steps short: steps trained by two of the three replicas (the audit accounts their samples).
"""

from __future__ import annotations

import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TRIAL_STEPS = 13


def _job(run_dir: Path, bench_job) -> dict:
    job = bench_job(run_dir)
    job["parallel"] = {"replicas": 3}
    job["data"]["batch_size"] = 6
    job["checkpoint"]["memory_every"] = 0
    job["supervision"].update({"on_replica_loss": "continue", "min_replicas": 2,
                               "flaky_failures": 1000, "restart": "process"})
    return job


def measure_control(trials: int, recovery) -> float:
    """`trials` kills of replica 1's rank; prints the figures, returns the median fault ->
    next step (s)."""
    (REPO / "runs").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-replica-", dir=REPO / "runs"))
    run = recovery.Run.__new__(recovery.Run)  # the same parts, on three replica nodes
    run.run_dir, run.job_file = tmp / "run", tmp / "job.yaml"
    run.job_file.write_text(yaml.safe_dump(_job(run.run_dir, recovery.bench_job)))
    (run.run_dir / "control").mkdir(parents=True)
    run.cluster = recovery.LocalCluster(run.run_dir / "control")
    run.url = recovery.start_redis(run.cluster)
    run.store = recovery.Store(run.url, "bench-recovery")
    run.env = {"REDIS_URL": run.url, "OPTIMUS_SNAPSHOT_SECRET": secrets.token_hex(32)}
    run.cluster.start("controller", [sys.executable, "-m", "controller", "controller",
                                     str(run.job_file), "--nodes", "3", "--ranks-per-node", "1"],
                      env={"REDIS_URL": run.url})
    for i in range(3):
        run.start_agent(f"node{i}")
    print("\nreplica-control starts: 3 replicas x 1 node x 1 rank, no spare", flush=True)
    try:
        results = [_trial(run, n) for n in range(trials)]
    finally:
        run.close()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print(f"per kill_rank, replica-control, medians (n={trials}): decision "
          f"{med['decision']:.3f} s; fault -> next step {med['next_step']:.3f} s; survivors' "
          f"largest gap across the kill {med['gap']:.2f} median steps (target <= 2: "
          f"{'met' if med['gap'] <= 2 else 'MISSED'}; max "
          f"{max(r['gap'] for r in results):.2f}; the largest of the 10 steps before each "
          f"kill, no fault: {med['calm']:.2f}), while the replica is out {med['out']:.2f}, "
          f"while it rejoins {med['rejoin']:.2f}; back in the quorum {med['back']:.2f} s after "
          f"the decision (heal {med['heal']:.3f} s); steps short {med['short']:g}; restarts of "
          "the whole job 0", flush=True)
    return med["next_step"]


def _trial(run, n: int) -> dict:
    since = run.store.job_record().get("restarts", "0")
    logged = len(_steps(run))  # the last trial's rejoin settles first: steps without a fault
    run.wait(lambda: len(_steps(run)) >= logged + TRIAL_STEPS, 300, f"{TRIAL_STEPS} steps")
    victim = run.store.plan()["nodes"][1]  # replica 1: not the writer
    lost_before = len(run.events("replica_lost"))
    said = len(run.events("chaos"))
    run.store.push_command(victim, {"kind": "kill_rank", "rank": 1, "time": time.time()})
    injected = float(run.wait(lambda: run.events("chaos")[said:], 30,
                              "the agent to inject")[0]["time"])
    lost = run.wait(lambda: run.events("replica_lost")[lost_before:], 60, "the decision")[0]
    decided = float(lost["time"])
    healed = run.wait(lambda: [r for r in run.rows() if r.get("event") == "quorum"
                               and r.get("healed") == [1] and r["time"] > decided], 120,
                      "replica 1 to be healed")[0]
    back_step = max(s for _, s in _steps(run))
    run.wait(lambda: max(s for _, s in _steps(run)) >= back_step + 3, 60, "steps after")
    rejoined = float(run.wait(lambda: [e for e in run.events("replica_rejoined")
                                       if float(e["time"]) > decided], 30, "the rejoin")[0]["time"])
    rows = [r for r in run.rows() if "loss" in r and "event" not in r]
    times = [r["time"] for r in rows]
    pairs = list(zip(times, times[1:], strict=False))
    calm = [b - a for a, b in pairs if b < injected][-10:]  # the steps before the kill
    usual = statistics.median(calm)
    first = min(r["time"] for r in rows if r["time"] > injected and
                (r.get("data") or {}).get("replicas") == [0, 2])

    def largest(start: float, end: float) -> float:  # of the intervals ending in (start, end]
        return max((b - a for a, b in pairs if start < b <= end), default=0.0) / usual

    short = sum(1 for r in rows if (r.get("data") or {}).get("replicas") == [0, 2]
                and r["time"] > injected)
    record = run.store.job_record()
    assert record.get("generation") == "0", record  # nobody else restarted
    result = {"decision": decided - injected,
              # the first step the survivors trained without it (a row of a step before the
              # fault may be written after it: rows are one step behind)
              "next_step": first - injected,
              "gap": largest(injected, first),  # across the kill: to the first step without it
              "calm": max(calm) / usual,  # the largest of the 10 before it: the steps' own jitter
              "out": largest(first, rejoined),  # while it is out (its relaunch beside them)
              "rejoin": largest(rejoined, healed["time"] + 2 * usual),  # it joins, is healed
              "back": healed["time"] - decided, "heal": healed["heal_s"], "short": short}
    print(f"trial {n + 1} kill_rank: decision {result['decision']:.3f} s, next step "
          f"{result['next_step']:.3f} s, survivors' largest gap across the kill "
          f"{result['gap']:.2f} median steps ({result['gap'] * usual:.3f} s; a step "
          f"{usual * 1e3:.0f} ms; the 10 steps before it: up to {result['calm']:.2f}), while "
          f"it is out {result['out']:.2f}, while it rejoins {result['rejoin']:.2f}; back "
          f"{result['back']:.2f} s after the decision (heal "
          f"{result['heal']:.3f} s), {short} step(s) short; restarts so far {since} -> "
          f"{record.get('restarts')}", flush=True)
    return result


def _steps(run) -> list[tuple[float, int]]:
    return run.steps()
