"""bench/recovery.py's `replica` mode: a lost replica under replicas that carry on, measured on
`optimus train` itself (optimus/parallel/replica_mode.py).

Three replicas of tiny-gpt, one rank each, on this machine; the quorum file and store are held
as the controller holds them (bench/replica_train_run.py), and each quorum is written the moment
it is decided: the controller's decision (a dead rank's exit, or a silent one's heartbeat
timeout) is not in these figures; bench/recovery.py measures it for the restart modes. Each
trial kills replica 2's rank (SIGKILL), names the quorum without it, lets the survivors step on,
then names the quorum with a standby started beforehand in its place, which the lowest member
heals; the standby is ready (its log says it waits for a quorum) before the kill, as the
controller keeps one. From the run's own record (the lowest member's metrics.jsonl) per trial:

- the survivors' largest gap: the longest time between two steps from the kill until the
  quorum with the standby is named, in median steps of the time before the kill (target <= 2);
  and the same from then on, while the standby is healed and let in;
- kill -> next step: from the kill to the first step completed after it;
- steps short: steps trained by two of the three replicas (their samples: skipped, accounted
  by `optimus data audit`);
- rejoin: from naming the quorum with the standby to its first step in it; the heal's own time
  (the quorum event's heal_s).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from replica_train_run import Replicas

REPO = Path(__file__).resolve().parents[1]
WARM_STEPS = 12  # steps before the first kill (compiles none; the first saves done)
AFTER_KILL, AFTER_REJOIN = 6, 6  # steps the survivors take alone, and together after


def steps_of(run: Replicas) -> list[dict]:
    return [r for r in run.rows() if "loss" in r and "event" not in r]


def trial(run: Replicas, doomed, quorum: int) -> tuple[dict, object, int]:
    """Kill replica 2's rank `doomed` (a member of quorum `quorum`, its standby waiting for a
    later one), let it rejoin healed; returns the trial's figures, the next standby, the id."""
    standby = run.procs[-1]
    run.wait(lambda: run.ready(standby))  # a standby is ready before it is needed
    before = steps_of(run)
    killed = time.time()
    doomed.kill()
    out = run.quorum([0, 1])
    at = before[-1]["step"]
    run.wait(lambda: steps_of(run)[-1]["step"] >= at + AFTER_KILL)
    named = time.time()
    back = run.quorum([0, 1, 2])
    run.wait(lambda: any(e["quorum"] == back for e in run.events("quorum")))
    rejoined_at = steps_of(run)[-1]["step"]
    run.wait(lambda: steps_of(run)[-1]["step"] >= rejoined_at + AFTER_REJOIN)
    rows = steps_of(run)
    times = [r["time"] for r in rows]
    before_kill = [b - a for a, b in zip(times, times[1:], strict=False)
                   if b <= killed][-20:]
    median = statistics.median(before_kill)

    def largest_gap(since: float, until: float) -> float:
        times = [r["time"] for r in rows if since - median <= r["time"] <= until]
        return max(b - a for a, b in zip(times, times[1:], strict=False))

    gap = largest_gap(killed, named)
    rejoin_gap = largest_gap(named, rows[-1]["time"])
    after_kill = next(r["time"] for r in rows if r["time"] > killed)
    short = [r["step"] for r in rows if r["time"] > killed
             and len((r.get("data") or {}).get("replicas", [0, 1, 2])) == 2]
    rejoin = next(r["time"] for r in rows if r["time"] > named
                  and len((r.get("data") or {}).get("replicas", [])) == 3)
    heal = next(e for e in run.events("quorum") if e["quorum"] == back)
    figures = {"median_step_s": median, "gap_s": gap, "gap_steps": gap / median,
               "rejoin_gap_steps": rejoin_gap / median,
               "kill_to_next_step_s": after_kill - killed, "steps_short": len(short),
               "rejoin_s": rejoin - named, "heal_s": heal["heal_s"], "out": out,
               "healed": heal["healed"], "source": heal["source"]}
    return figures, run.start(2, back), back  # the next trial's spare: past this quorum


def measure_replicas(trials: int) -> dict:
    """The whole replica run; prints each trial and the medians, returns the medians."""
    (REPO / "runs").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-replicas-", dir=REPO / "runs"))
    run = Replicas(tmp, steps=1_000_000, extra=("--set", "checkpoint.interval=0"))
    print("\nreplica starts: 3 replicas x 1 rank of tiny-gpt (optimus train), a standby for "
          "replica 2; each quorum written at once (the controller's decision not included)",
          flush=True)
    try:
        quorum = run.quorum([0, 1, 2])
        run.start(0)
        run.start(1)
        doomed = run.start(2)
        run.start(2, quorum)  # the spare
        run.wait(lambda: len(steps_of(run)) >= WARM_STEPS, timeout_s=600)
        results = []
        for n in range(trials):
            figures, _, quorum = trial(run, doomed, quorum)
            doomed = run.procs[-2]  # the spare that joined is replica 2's rank now
            results.append(figures)
            print(f"trial {n + 1} kill_rank: survivors' largest gap {figures['gap_s']:.3f} s = "
                  f"{figures['gap_steps']:.2f} median steps ({figures['median_step_s']:.3f} s); "
                  f"kill -> next step {figures['kill_to_next_step_s']:.3f} s; "
                  f"{figures['steps_short']} step(s) short; rejoin {figures['rejoin_s']:.3f} s "
                  f"(heal {figures['heal_s']:.3f} s, replica {figures['healed']} from "
                  f"{figures['source']}; the survivors' largest gap then "
                  f"{figures['rejoin_gap_steps']:.2f} median steps)", flush=True)
        medians = {k: statistics.median(r[k] for r in results)
                   for k in ("gap_steps", "gap_s", "kill_to_next_step_s", "steps_short",
                             "rejoin_s", "heal_s", "median_step_s", "rejoin_gap_steps")}
        print(f"per fault, replica, medians of {trials}: survivors' largest gap "
              f"{medians['gap_steps']:.2f} median steps (target <= 2: "
              f"{'met' if medians['gap_steps'] <= 2 else 'MISSED'}); kill -> next step "
              f"{medians['kill_to_next_step_s']:.3f} s; steps short "
              f"{medians['steps_short']:g}; rejoin {medians['rejoin_s']:.3f} s, heal "
              f"{medians['heal_s']:.3f} s, the survivors' largest gap then "
              f"{medians['rejoin_gap_steps']:.2f} median steps", flush=True)
        return medians
    finally:
        run.close()
        shutil.rmtree(tmp, ignore_errors=True)
