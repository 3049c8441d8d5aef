"""Hangs, bad tiles, stragglers and flaky nodes, injected for real into jobs under the control
plane (`optimus run` on a private redis-server the test can read): each is detected, the right
culprit named, and the job recovers on a spare."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import ROOT, metrics, metrics_so_far, wait_for, write_job

from controller.store.store import Store
from optimus.checkpoint.manifest import committed_steps, read_manifest, step_dir, verify
from optimus.checkpoint.quarantine import quarantined

# The last planned fault fires at step 14, after the checkpoint of step 10: two steps more
# let its next generation finish.
STEPS = 16
HANG = {"hang_timeout_s": 4.0, "hang_floor_s": 4.0, "hang_step_factor": 5.0}
# The adaptive bound: a hang once the generation has 2 timed steps is judged by max(4 s, 5 x
# p99 step time), not by the 120 s of its first steps (nor the 600 s default).
ADAPTIVE = {**HANG, "hang_timeout_s": 120.0, "hang_history": 2}
# One OpenMP thread per rank (agents pass their environment on to their ranks): with torch's
# default of one thread per core, two ranks on a 2-core machine spin-wait for each other's
# cores. Nothing asserted here depends on the number of threads.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def run(redis_server, job: Path, *, nodes: int = 2, spares: int = 1,
        timeout: float = 240) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run([sys.executable, "-m", "controller", "run", str(job), "--nodes",
                              str(nodes), "--ranks-per-node", "1", "--spares", str(spares)],
                             cwd=ROOT, env={**os.environ, **ONE_THREAD,
                                            "REDIS_URL": redis_server.url},
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # what it had done by then, to say why
        said = (e.stdout or b"").decode(errors="replace")[-8000:]
        pytest.fail(f"the job did not end within {timeout:g} s; its output:\n{said}")
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:]
    return out


def events(store: Store, kind: str) -> list[dict]:
    return [e for _, e in store.events(count=10_000) if e["kind"] == kind]


def generation_nodes(store: Store, generation: int) -> list[str]:
    (event,) = [e for e in events(store, "generation")
                if e["message"].startswith(f"generation {generation} on ")]
    names = event["message"].split(" on ", 1)[1].split(" from ", 1)[0]
    return names.split(", ")


# Every step of both ranks at least 0.3 s (in the optimizer), so that the controller sees the
# steps one by one whatever the machine's speed: at 0.03 s a step (a quiet fast VM) the agents'
# 0.25 s ticks saw steps 1-7 in one or two moves, and the adaptive bound had no history yet.
PACED = [{"kind": "slow_rank", "rank": r, "step": 1, "seconds": 0.3} for r in (0, 1)]


@pytest.mark.parametrize("fault,culprit_says,stack_says,steps,rule", [
    ({"kind": "stall_rank", "seconds": 3600, "step": 8}, "phase backward", "after_backward",
     STEPS, ADAPTIVE),
    # While the save of step 10 is in flight: rank 0 waits in step 11's record (its peak memory
    # gather, which comes before any save's agreement: a step's record first).
    # Rank 1 ignores SIGUSR1 (as one stuck in the kernel would): py-spy reads its stack. The
    # save never commits (rank 1 never agrees): the next generation starts from scratch. A
    # save has no history: the fixed bound judges it.
    ({"kind": "hang_rank", "step": 11, "deaf": True}, "phase optim", "in_optimizer", 12, HANG),
], ids=["sleep_before_grad_reduction", "blocked_device_sync_while_a_save_is_in_flight"])
def test_a_hang_names_the_rank_holding_the_others_with_its_stack(
        fault, culprit_says, stack_says, steps, rule, redis_server, tmp_path):
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=steps,
                    faults=[{**fault, "rank": 1},
                            *(PACED if rule is ADAPTIVE else [])], **rule)
    run(redis_server, job)
    store = Store(redis_server.url, "e2e")
    culprit = generation_nodes(store, 0)[1]  # holds rank 1
    record = store.job_record()
    assert record["state"] == "COMPLETED" and record["restarts"] == "1", record
    reason = store.excluded()[culprit]["reason"]
    assert reason.startswith("hung: no step past ")
    assert f"rank 1 on {culprit} (local 0)" in reason and culprit_says in reason
    threshold = float(re.search(r"\(threshold ([\d.]+) s\)", reason).group(1))
    if rule is ADAPTIVE:  # the generation had its 2 timed steps by step 8
        assert 4.0 <= threshold < ADAPTIVE["hang_timeout_s"], reason
    (suspect,) = events(store, "suspect")
    assert "holding the others up: rank 1" in suspect["message"]
    failure = events(store, "failure")[0]
    stacks = json.loads(failure["stacks"])
    assert stack_says in stacks["1"]  # the culprit's own Python stack, from the agent
    assert "0" in stacks  # and a sample of the others': rank 0 waits in a collective
    assert culprit not in store.plan()["nodes"]
    # Rank 0 waited in a collective for the culprit; once its agent killed the culprit, that
    # collective failed and rank 0 went on in process: the same PID in generation 1.
    survivor = generation_nodes(store, 0)[0]
    launches = {e["message"].split(":")[0]: e for e in events(store, "launch")
                if e["node"] == survivor}
    assert (launches["generation 1"]["in_process"], launches["generation 1"]["pids"]) == (
        "1", launches["generation 0"]["pids"])
    how = [e["message"] for e in events(store, "stacks")]
    if fault.get("deaf"):
        assert "in max_over_ranks" in stacks["0"]  # the record's gather (see above)
        assert stacks["1"].endswith("(read by py-spy dump --nonblocking: no answer to SIGUSR1 "
                                    "within 1 s)\n")
        assert how == [f"stack of rank 1 on {culprit}: read by py-spy dump --nonblocking: no "
                       "answer to SIGUSR1 within 1 s"]
    else:
        assert how == []  # both answered SIGUSR1 at once


def chaos(url: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "controller", "chaos", *args, "--job", "e2e",
                          "--yes", "--reason", "rehearsal"], cwd=ROOT,
                         env={**os.environ, "REDIS_URL": url}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_chaos_stall_rank_is_a_slow_step_and_chaos_hang_rank_a_hang_with_its_rank_named(
        redis_server, tmp_path):
    run_dir = tmp_path / "run"
    # Paced like PACED, in both generations: the job trains on while the test waits on the
    # control plane, at the CPU of the steps it needs.
    pace = [{**f, "generation": g} for f in PACED for g in (0, 1)]
    job = write_job(tmp_path / "job.yaml", run_dir, steps=10_000, faults=pace, **HANG)
    with open(tmp_path / "run.out", "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "controller", "run", str(job), "--nodes",
                              "2", "--ranks-per-node", "1", "--spares", "1"], cwd=ROOT,
                             env={**os.environ, "REDIS_URL": redis_server.url}, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    store = Store(redis_server.url, "e2e")
    try:
        wait_for(lambda: (plan := store.plan()) and plan["action"] == "run"
                 and store.rank_beats(plan["nodes"][0]).get(0, {}).get("step", 0) >= 3,
                 120, "generation 0 at step 3")
        first, culprit = store.plan()["nodes"]
        log = run_dir / "logs" / "gen_0000" / "rank_00001.log"

        # A stall shorter than the hang threshold (4 s): one slow step, nothing more. Said in
        # advance (the step it fires in), ~10 s of steps ahead at the rate this machine steps
        # now, so that the command (a Python process starting, the agent's next tick) arrives
        # first on a fast machine and a loaded one alike.
        at = store.summaries.furthest_step() + _steps_in(store, 10.0)
        said = chaos(redis_server.url, "stall-rank", "--rank", "1", "--seconds", "2",
                     "--at-step", str(at))
        assert said.strip() == (f"stall-rank sent to the agent of {culprit} (rank 1); it fires "
                                f"in step {at}")
        fired = wait_for(lambda: re.search(r"stalls 2 s before the gradient reduction of step "
                                           r"(\d+)", log.read_text()), 60, "the stall")
        stalled = int(fired.group(1))
        assert stalled == at or f"it fires in step {stalled}" in log.read_text()
        def logged() -> dict[int, dict]:
            return {m["step"]: m for m in metrics_so_far(run_dir) if "loss" in m}
        wait_for(lambda: max(logged(), default=0) >= stalled + 3, 60, "steps after the stall")
        logged = logged()
        assert logged[stalled]["step_time_s"] >= 2.0  # rank 0 waited for it in the clip
        # One slow step, not a slow rank: the stall fired once (what was decided, not how
        # fast a loaded machine runs the steps around it).
        assert log.read_text().count("stalls 2 s before") == 1
        (sent,) = events(store, "chaos")
        assert sent["message"] == (f"chaos on {culprit}: stall_rank 1 (by {_who()}: "
                                   "rehearsal)") and sent["reason"] == "rehearsal"
        assert events(store, "suspect") == [] and events(store, "failure") == []

        # A hang: named, with its stack, excluded; the job goes on on the spare.
        chaos(redis_server.url, "hang-rank", "--rank", "1")
        (failure,) = wait_for(lambda: events(store, "failure"), 60, "the hang's verdict")
        assert f"rank 1 on {culprit} (local 0): step " in failure["message"]
        assert "phase optim" in failure["message"]
        assert failure["message"].endswith(f"node {culprit} excluded")
        assert "in_optimizer" in json.loads(failure["stacks"])["1"]
        assert "hangs in a device sync at step" in log.read_text()
        assert store.job_record()["restart_causes"] == '{"hang": 1}'
        wait_for(lambda: (plan := store.plan())["generation"] == 1 and plan["action"] == "run"
                 and store.rank_beats(plan["nodes"][1]).get(0, {}).get("generation") == 1,
                 120, "generation 1 training")
        assert culprit not in store.plan()["nodes"] and first in store.plan()["nodes"]
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _steps_in(store: Store, seconds: float) -> int:
    """How many steps the job takes in `seconds` at its current rate (25 at least)."""
    step, started = store.summaries.furthest_step(), time.monotonic()
    later = wait_for(lambda: (s := store.summaries.furthest_step()) >= step + 5 and s, 60,
                     "five steps")
    rate = (later - step) / (time.monotonic() - started)
    return max(25, math.ceil(rate * seconds))


def _who() -> str:
    import getpass
    import socket

    return f"{getpass.getuser()}@{socket.gethostname()}"


def test_nan_from_one_rank_names_its_tile(redis_server, tmp_path):
    # NaN at step 14: generation 0 committed step 10 after its nodes passed their health check.
    # Saves in sync mode: step 10 is committed before step 11 begins, however loaded the machine
    # (a save in flight when the NaN came was dropped with its rank: nothing to set aside).
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=STEPS, async_mode="sync",
                    faults=[{"kind": "nan_rank", "rank": 1, "step": 14}])
    run(redis_server, job)
    store = Store(redis_server.url, "e2e")
    culprit = generation_nodes(store, 0)[1]
    # From its heartbeat ("rank 1, step 14") or its exit status, whichever the controller saw
    # first: the same tile either way.
    reason = store.excluded()[culprit]["reason"]
    assert reason.startswith(f"bad tile {culprit}/0 (rank 1")
    assert reason.endswith("its own loss or gradients were NaN/Inf")
    assert list(store.excluded()) == [culprit]  # rank 0 saw NaN arrive: not blamed
    # The failure event names the culprit in fields, for `optimus events -o json` and alerts.
    (failure,) = events(store, "failure")
    assert {k: failure[k] for k in ("generation", "node", "rank", "tile", "cause", "evidence",
                                    "excluded", "saves")} == {
        "generation": "0", "node": culprit, "rank": "1", "tile": f"{culprit}/0",
        "cause": "bad_tile", "evidence": "hard", "excluded": "1", "saves": "0"}
    # Each rank told its own values from what the reduction brought it.
    logs = tmp_path / "run" / "logs" / "gen_0000"
    assert "at step 14, from this rank's own values" in (logs / "rank_00001.log").read_text()
    assert "at step 14, from another rank's values" in (logs / "rank_00000.log").read_text()
    assert store.job_record()["state"] == "COMPLETED"
    # No step was taken on NaN: the run's losses are all finite.
    assert all(m["loss"] == m["loss"] for m in metrics(tmp_path / "run") if "loss" in m)
    # Step 10 was committed after the tile last passed its check: set aside as suspect, and
    # generation 1 started before it (from scratch: nothing was committed before).
    (aside,) = quarantined(tmp_path / "run" / "checkpoints")
    assert (aside["step"], aside["kind"]) == (10, "suspect")
    assert f"after {culprit} last passed its health check" in aside["reason"]
    (moved,) = events(store, "quarantine")
    assert moved["steps"] == "[10]" and culprit in moved["message"]
    # Set aside before generation 1 was planned: in that decision (its message says so) or in
    # an earlier tick (the commit of step 10 landed while the generation was ending).
    order = [e["kind"] for _, e in store.events(count=10_000)
             if e["kind"] == "quarantine" or e["message"].startswith("generation 1 on ")]
    assert order == ["quarantine", "generation"], order
    gen = events(store, "generation")[1]["message"]
    assert gen.startswith("generation 1 on ") and " from scratch" in gen, gen
    assert "set aside" not in gen or "(set aside as suspect: step 10)" in gen, gen
    assert events(store, "loaded")[-1]["message"] == "generation 1 resumed from scratch"


def test_health_checks_on_demand_and_before_each_generation_exclude_bad_tiles(
        redis_server, tmp_path):
    # Generation 0 is paced from step 20 (2.5 s a step): the running node's bad tile is made
    # after step 20 is committed (and after the spare's was found, up to 15 s), and the check
    # must find it while the generation still runs, however fast this machine steps.
    # Saves in the step (sync): a thread-mode save still in flight at the next interval is
    # skipped (on_overlap: skip), and the last generation's step 30 was once (CI, 2026-11-28).
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=40, async_mode="sync",
                    faults=[{"kind": "slow_rank", "rank": 0, "step": 21, "seconds": 2.5,
                             "generation": 0}])
    ckpts = tmp_path / "run" / "checkpoints"
    p = subprocess.Popen([sys.executable, "-m", "controller", "run", str(job), "--nodes", "2",
                          "--ranks-per-node", "1", "--spares", "2"], cwd=ROOT,
                         env={**os.environ, "REDIS_URL": redis_server.url},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    store = Store(redis_server.url, "e2e")
    try:
        # Generation 0 starts once two agents are in; the spares may register later on a
        # loaded machine (each imports torch for its check): wait for all four.
        wait_for(lambda: 10 in committed_steps(ckpts) and len(store.nodes()) == 4, 120,
                 "generation 0's step 10 committed and the two spares registered")
        running, spares = store.plan()["nodes"], sorted(set(store.nodes())
                                                        - set(store.plan()["nodes"]))
        victim, first_spare, last_spare = running[1], spares[0], spares[1]
        # The first spare's tile goes bad quietly: only its next check can tell, and a spare
        # checks itself ahead every 15 s (controller/node/checks.py): it is excluded before
        # any plan names it.
        store.push_command(first_spare, {"kind": "bad_tile", "tile": 0})
        # The victim passes a check on demand (after step 10 was committed), while it runs.
        store.push_command(victim, {"kind": "health_check"})
        passed = wait_for(lambda: [e for e in events(store, "health") if victim in e["message"]],
                          60, "the on-demand check")
        assert passed[0]["message"] == f"health check on demand: {victim} ok"
        ok_at = store.nodes()[victim]["ok_at"]
        wait_for(lambda: 20 in committed_steps(ckpts), 120, "step 20 committed")
        wait_for(lambda: first_spare in store.excluded(), 60, "the spare's idle check")
        # A running node's tile goes bad, and an operator asks for a check.
        store.push_command(victim, {"kind": "bad_tile", "tile": 0})
        out = subprocess.run([sys.executable, "-m", "controller", "health-check", "--job", "e2e",
                              "--node", victim, "--redis", redis_server.url], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        output, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, output[-5000:]
    excluded = store.excluded()
    assert set(excluded) == {victim, first_spare}
    assert excluded[victim]["reason"].startswith(f"bad tile {victim}/0: fixed-seed matmul")
    assert excluded[first_spare]["reason"].startswith(f"bad tile {first_spare}/0: fixed-seed")
    health = [e["message"] for e in events(store, "health")]
    assert any("health check on demand" in m and victim in m and "bad tile" in m for m in health)
    assert f"health check while idle: {first_spare} bad tile {first_spare}/0: fixed-seed" in (
        " ".join(health))
    record = store.job_record()
    assert record["state"] == "COMPLETED", record
    assert store.plan()["nodes"] == [running[0], last_spare]

    # The victim computed wrong: generation 0 stopped without a checkpoint, and step 20,
    # committed after the victim last passed its check, was set aside; step 10, before it, is
    # where generation 1 started. The first spare never computed for the job and was never
    # planned: its bad tile failed no generation.
    failures = events(store, "failure")
    assert [(f["node"], f["cause"], f["saves"]) for f in failures] == [(victim, "bad_tile", "0")]
    assert "it stops without a checkpoint" in failures[0]["message"]
    gen0 = [m for m in metrics(tmp_path / "run") if m.get("event") == "stopped"][:1]
    assert all(m["saved"] is False and m["checkpoint_step"] is None for m in gen0)
    committed_at = {s: read_manifest(step_dir(ckpts, s))["committed_at"] for s in (10,)}
    assert committed_at[10] <= ok_at
    # Step 20; and step 30 too when the machine was slow enough for generation 0 to commit it
    # before the check on demand came back: both were committed after the last passing check.
    aside = sorted(quarantined(ckpts), key=lambda a: a["step"])
    assert [a["step"] for a in aside] in ([20], [20, 30]), aside
    for a in aside:
        assert a["kind"] == "suspect"
        assert read_manifest(Path(a["path"]))["committed_at"] > ok_at
        assert f"after {victim} last passed its health check" in a["reason"]
    generation_1 = events(store, "generation")[1]["message"]
    suspects = ", ".join(str(a["step"]) for a in aside)
    assert f"from the checkpoint of step 10 (set aside as suspect: step {suspects})" in (
        generation_1)
    assert [e["message"] for e in events(store, "loaded")][-1] == (
        "generation 1 resumed from the checkpoint of step 10")
    assert all(verify(step_dir(ckpts, s)) == [] for s in committed_steps(ckpts))
    assert committed_steps(ckpts) == [10, 20, 30, 40]  # 20 afresh; nothing of the stop


def test_a_straggler_is_reported_and_excluded_by_policy(redis_server, tmp_path):
    # Every step from 3 on takes 0.4 s more: 40 steps give the controller (which reads the
    # compute scores every 5 s) over 14 s of slow steps to decide in, from a window of 4.
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=40,
                    faults=[{"kind": "slow_rank", "rank": 1, "step": 3, "seconds": 0.4}],
                    straggler_window=4, straggler_factor=2.5, straggler_action="exclude")
    run(redis_server, job)
    store = Store(redis_server.url, "e2e")
    culprit = generation_nodes(store, 0)[1]
    (report,) = events(store, "straggler")
    assert report["node"] == culprit and "straggler_action=exclude" in report["message"]
    reason = store.excluded()[culprit]["reason"]
    assert reason.startswith(f"node {culprit} is a straggler: compute ")
    assert store.job_record()["state"] == "COMPLETED"
    assert culprit not in store.plan()["nodes"]


def test_a_node_is_excluded_on_its_second_failure_in_the_window(redis_server, tmp_path):
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=STEPS,
                    faults=[{"kind": "kill_rank", "rank": 1, "step": 6, "generation": 0},
                            {"kind": "kill_rank", "rank": 1, "step": 14, "generation": 1}],
                    flaky_failures=2, flaky_window_s=600)
    run(redis_server, job)
    store = Store(redis_server.url, "e2e")
    culprit = generation_nodes(store, 0)[1]
    assert generation_nodes(store, 1) == generation_nodes(store, 0)  # kept after the first
    first, second = (e["message"] for e in events(store, "failure"))
    assert f"node {culprit} kept: failure 1 of 2" in first
    assert f"node {culprit} excluded" in second
    assert culprit not in generation_nodes(store, 2)
    record = store.job_record()
    assert record["state"] == "COMPLETED" and record["restarts"] == "2"


@pytest.mark.timeout(600)
def test_no_false_alarm_on_a_loaded_machine(redis_server, tmp_path):
    # Stragglers are only reported (the default): with a busy process on one of two cores,
    # one rank really is slower, and reporting it is right; excluding its node is not.
    # 40 steps: four straggler windows, each a chance for a false alarm. The hang bound is
    # the adaptive one with a floor of 3 s (10 x the p99 step time, once 8 steps are timed):
    # it follows what the loaded machine does, and must not call a slow step a hang.
    job = write_job(tmp_path / "job.yaml", tmp_path / "run", steps=40,
                    hang_timeout_s=60.0, hang_floor_s=3.0, hang_step_factor=10.0,
                    straggler_window=10, straggler_factor=3.0)
    # A busy process competes with the two ranks for the two cores all along.
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    try:
        run(redis_server, job, spares=0, timeout=500)
    finally:
        for p in load:
            p.kill()
            p.wait()
    store = Store(redis_server.url, "e2e")
    record = store.job_record()
    assert record["state"] == "COMPLETED" and record["restarts"] == "0", record
    assert store.excluded() == {}
    assert [e for _, e in store.events(count=10_000)
            if e["kind"] in ("suspect", "failure")] == []
    steps = [m["step"] for m in metrics(tmp_path / "run") if "loss" in m]
    assert steps == list(range(1, 41))
