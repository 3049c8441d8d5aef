"""Operators against a live `optimus run` job: every command of `optimus job`, `optimus node` and
`optimus events`, run as a separate process the way an operator runs it, then a real scrape of
the controller's /metrics, and Redis ACLs that keep agents from acting as operators.

The live job (two nodes and a spare) is paused with a checkpoint, resumed, checkpointed on
demand, loses a node to an operator's exclusion, and is stopped; its loss curve must equal,
bit for bit, that of a plain run that was never paused or restarted.
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from cluster import (
    ROOT,
    Processes,
    RedisServer,
    free_port,
    metrics,
    metrics_so_far,
    train_ranks,
    wait_for,
    write_job,
)
from promql import exported_names, metric_names, monitoring_expressions

from controller.store.store import Store
from optimus.checkpoint.manifest import committed_steps
from optimus.checkpoint.quarantine import quarantined
from optimus.files import human_bytes

JOB = "ops"
# The module's job trains on while the tests talk to it (and the last one trains a reference
# as far again): paced by a sleep in each rank's step, in every generation the module makes,
# it costs the CPU of the steps the tests need, not of as many as the machine can run.
PACE = [{"kind": "slow_rank", "rank": r, "step": 0, "seconds": 0.3, "generation": g}
        for r in range(2) for g in range(4)]


def optimus(*args: str, url: str, timeout: float = 120, stdin=None) -> subprocess.CompletedProcess:
    """The `optimus` command, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "controller", *args], cwd=ROOT,
                          env={**os.environ, "REDIS_URL": url}, capture_output=True, text=True,
                          timeout=timeout, stdin=stdin if stdin is not None else subprocess.DEVNULL)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


class Live:
    def __init__(self, tmp: Path):
        self.run = tmp / "run"
        self.job = write_job(tmp / "job.yaml", self.run, name=JOB, steps=10_000,
                             memory_every=2,  # the controller reports the newest usable one
                             peak_tflops=0.05,  # MFU is exported only with a known peak
                             faults=PACE)
        self.port = free_port()
        self.out = tmp / "optimus-run.out"
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "controller", "run", str(self.job), "--nodes", "2",
                 "--spares", "1", "--set", f"monitoring.metrics_port={self.port}",
                 "--set", "eval.every=4", "--set", "eval.batches=1"],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: "redis://" in self.out.read_text(), 60, "the Redis URL")
        # Shown masked; an operator's copy, with the password, is in control/redis.env.
        env = (self.run / "control" / "redis.env").read_text()
        self.url = re.search(r"^export REDIS_URL=(\S+)$", env, re.M).group(1)
        self.store = Store(self.url, JOB)

    def beats(self) -> list[dict]:
        plan = self.store.plan()
        if not plan:
            return []
        return [b for n in plan["nodes"] for b in self.store.rank_beats(n).values()
                if b.get("generation") == plan["generation"]]

    def step(self) -> int:
        return min((b["step"] for b in self.beats()), default=0)

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return r.read().decode()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    job = Live(tmp_path_factory.mktemp("operator"))
    try:
        yield job
    finally:
        job.close()


@pytest.fixture(scope="module")
def followed(live):
    """`optimus events -o json`, following from the start, for the whole module."""
    wait_for(lambda: live.store.job_record().get("state"), 60, "the job in Redis")
    p = subprocess.Popen([sys.executable, "-m", "controller", "events", "--job", JOB, "-o",
                          "json", "-n", "1000"], cwd=ROOT, env={**os.environ,
                                                                "REDIS_URL": live.url},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield p
    if p.poll() is None:
        p.kill()


def sample(scrape: str, metric: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(scrape):
        for s in family.samples:
            if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"{metric}{labels} not exported")


def test_pause_holds_every_rank_at_one_step_after_a_checkpoint_and_resume_goes_on(live,
                                                                                  followed):
    wait_for(lambda: live.step() >= 3, 120, "step 3")
    out = ok(optimus("job", "pause", "--job", JOB, "--checkpoint", "--reason", "maintenance",
                     "--wait", "--timeout", "60", "-o", "json", url=live.url))
    answer = json.loads(out)
    assert answer["event"]["kind"] == "pause" and answer["event"]["reason"] == "maintenance"
    assert answer["now"].startswith("job PAUSED: paused at step ")

    first = live.beats()
    paused_at = first[0]["step"]
    assert len(first) == 2 and {(b["phase"], b["step"]) for b in first} == {("paused",
                                                                             paused_at)}
    time.sleep(2.0)
    later = live.beats()
    assert {(b["phase"], b["step"]) for b in later} == {("paused", paused_at)}
    before = {b["rank"]: b["seq"] for b in first}  # each rank's own count of its beats
    assert all(b["seq"] > before[b["rank"]] for b in later)  # alive, not frozen
    assert paused_at in committed_steps(live.run / "checkpoints")  # saved, then paused
    logged = metrics_so_far(live.run)
    assert max(m["step"] for m in logged if "loss" in m) == paused_at
    assert [m["step"] for m in logged if m.get("event") == "paused"] == [paused_at]

    scrape = live.scrape()  # the exporter sees the pause too
    assert sample(scrape, "optimus_job_state", state="PAUSED") == 1
    assert sample(scrape, "optimus_ranks", state="paused") == 2
    assert sample(scrape, "optimus_step") == paused_at
    # Paused, no rank logs a step: each one's peak memory holds still, and the scrape and the
    # status show the largest of them (each rank's own, from its heartbeat).
    own = {b["rank"]: b["memory"] for b in first}
    allocated = max(m["allocated_bytes"] for m in own.values())
    reserved = max(m["reserved_bytes"] for m in own.values())
    assert sample(scrape, "optimus_memory_peak_allocated_bytes") == allocated
    assert sample(scrape, "optimus_memory_peak_reserved_bytes") == reserved
    status = json.loads(ok(optimus("job", "status", "--job", JOB, "-o", "json", url=live.url)))
    peak = status["peak_memory"]
    assert (peak["allocated_bytes"], peak["reserved_bytes"]) == (allocated, reserved)
    assert own[peak["rank"]]["allocated_bytes"] == allocated
    table = ok(optimus("job", "status", "--job", JOB, url=live.url))
    assert (f"{human_bytes(allocated)} allocated (rank {peak['rank']}), "
            f"{human_bytes(reserved)} reserved") in table

    refused = optimus("job", "pause", "--job", JOB, url=live.url)
    assert refused.returncode != 0
    assert refused.stderr.strip() == "error: pause refused: the job is already paused"

    ok(optimus("job", "resume", "--job", JOB, "--wait", "--timeout", "60", url=live.url))
    wait_for(lambda: live.step() >= paused_at + 3, 60, "steps after the resume")
    assert [m["step"] for m in metrics_so_far(live.run) if m.get("event") == "resumed"] == [
        paused_at]


def _asked(live: Live) -> list[int]:
    """Steps of the checkpoints rank 0 saved because an operator asked."""
    return [m["step"] for m in metrics_so_far(live.run) if m.get("event") == "checkpoint"
            and "asked by an operator" in m["message"]]


def test_checkpoint_now_saves_the_next_step_on_every_rank(live):
    earlier = _asked(live)  # the pause's
    at = live.step()
    out = ok(optimus("job", "checkpoint", "--job", JOB, "--wait", "--timeout", "60",
                     url=live.url))
    saved = int(out.split("checkpoint of step ")[1].split()[0])
    assert saved >= at and saved in committed_steps(live.run / "checkpoints")
    (step,) = wait_for(lambda: _asked(live)[len(earlier):], 30, "the operator's checkpoint")
    assert step >= at
    wait_for(lambda: step in committed_steps(live.run / "checkpoints"), 30, f"step {step}")


def test_a_live_scrape_exports_every_metric_the_dashboard_and_alerts_use(live):
    # The newest usable memory snapshot: read by the controller every 5 s once one is replicated.
    wait_for(lambda: "optimus_memory_snapshot_step " in live.scrape(), 60,
             "a memory snapshot in the scrape")
    newest_before = committed_steps(live.run / "checkpoints")[-1]
    scrape = live.scrape()
    newest_after = committed_steps(live.run / "checkpoints")[-1]
    exported = exported_names(scrape)
    # Absent until the stability rules arm (stability.warmup_steps, then a full window), and
    # the gradient-norm rule is off by default: served in tests/test_trust_display.py.
    # The last recovery's time lost: absent until a restart's generation passed the job's step
    # (served in tests/test_trust_display.py).
    unarmed = {"optimus_stability_loss_threshold", "optimus_stability_grad_norm_threshold",
               "optimus_last_recovery_seconds"}
    for where, expr in monitoring_expressions().items():
        missing = metric_names(expr) - exported - unarmed
        assert not missing, f"{where} uses {sorted(missing)}, which /metrics does not export"
    assert sample(scrape, "optimus_job_state", state="RUNNING") == 1
    assert sample(scrape, "optimus_controller_up") == sample(scrape,
                                                             "optimus_controller_leader") == 1
    assert sample(scrape, "optimus_nodes", state="active") == 2
    assert sample(scrape, "optimus_nodes", state="spare") == 1
    # The job trains on and commits while the scrape runs: the scrape's newest is the folder's
    # newest at some moment between the two listings.
    assert newest_before <= sample(scrape, "optimus_checkpoint_step") <= newest_after
    assert sample(scrape, "optimus_heartbeat_age_seconds_count") == 2  # one per node
    assert sample(scrape, "optimus_heartbeat_age_seconds_bucket", le="5.0") == 2
    assert 0 < sample(scrape, "optimus_mfu_ratio") < 1
    assert sample(scrape, "optimus_tokens") > 0
    validations = [m["val_loss"] for m in metrics_so_far(live.run) if m.get("event") == "eval"]
    assert sample(scrape, "optimus_validation_loss") in validations
    assert sample(scrape, "optimus_heartbeat_overdue_nodes") == 0
    assert sample(scrape, "optimus_rewinds_total") == sample(scrape,
                                                             "optimus_loss_spikes_total") == 0
    status = json.loads(ok(optimus("job", "status", "--job", JOB, "-o", "json", url=live.url)))
    # Generation 0 takes the first two nodes to register: which two is a race.
    assert status["state"] == "RUNNING" and status["nodes"] == live.store.plan()["nodes"]
    assert len(status["nodes"]) == 2 and status["generation"] == 0
    assert status["step"] >= sample(scrape, "optimus_step")
    snapshot = sample(scrape, "optimus_memory_snapshot_step")
    # Against the step read after the scrape: one scrape reads the furthest step before the
    # snapshot's record, and a fast job takes steps between the two (CI: 136 against 133).
    assert snapshot > 0 and snapshot % 2 == 0 and snapshot <= status["step"]
    # The controller reads the newest usable snapshot every 5 s. A read can find none usable for
    # a moment: each node pushes its newest complete point and skips older ones, so under load
    # the two nodes' replicated points may not meet (docs/checkpoints.md, "Replication"). Then
    # the status has none until the next read; the scrape had one.
    later = wait_for(lambda: (s := json.loads(ok(optimus(
        "job", "status", "--job", JOB, "-o", "json", url=live.url))))["memory_snapshot"] and s,
        30, "a usable memory snapshot in the status")
    assert snapshot <= later["memory_snapshot"] <= later["step"]


def test_an_excluded_node_leaves_with_a_checkpoint_and_stays_out_until_included(live):
    first, second = live.store.plan()["nodes"]  # generation 0's, in node-rank order
    (spare,) = {"node0", "node1", "node2"} - {first, second}
    # On a terminal, the command asks first; "n" changes nothing.
    main, secondary = pty.openpty()
    try:
        os.write(main, b"n\n")
        asked = optimus("node", "exclude", second, "--job", JOB, "--reason", "ECC errors",
                        url=live.url, stdin=secondary)
    finally:
        os.close(main)
        os.close(secondary)
    assert asked.returncode == 1 and f"Exclude node {second} from job ops" in asked.stdout
    assert "Aborted" in asked.stderr and live.store.excluded() == {}

    missing = optimus("node", "exclude", second, "--job", JOB, url=live.url)
    assert missing.returncode == 2 and "Missing option '--reason'" in missing.stderr
    before = committed_steps(live.run / "checkpoints")[-1]
    out = ok(optimus("node", "exclude", second, "--job", JOB, "--reason", "ECC errors",
                     "--yes", "--wait", "--timeout", "90", url=live.url))
    assert out.splitlines() == [f"node {second} excluded by {_who()}: ECC errors",
                                f"generation 1 runs without {second}"]
    plan = live.store.plan()
    assert plan["nodes"] == [first, spare] and plan["resume_step"] > before
    stopped = [m for m in metrics(live.run) if m.get("event") == "stopped"]
    assert stopped[-1]["checkpoint_step"] == plan["resume_step"]  # nothing lost in between
    record = live.store.job_record()
    assert record["restarts"] == "0" and json.loads(record["restart_causes"]) == {"operator": 1}
    # An operator's exclusion is no evidence against the state: the stop saved, as ever.
    assert stopped[-1].get("saved", True) and "without a checkpoint" not in stopped[-1]["message"]
    assert "suspect" not in record and quarantined(live.run / "checkpoints") == []

    rows = {r["node"]: r for r in json.loads(ok(optimus("node", "list", "--job", JOB, "-o",
                                                        "json", url=live.url)))}
    assert rows[second]["role"] == "excluded"
    assert rows[second]["excluded"]["reason"] == "ECC errors"
    assert rows[second]["excluded"]["by"] == _who()
    assert rows[spare]["role"] == "ranks 1-1"
    again = optimus("node", "exclude", second, "--job", JOB, "--reason", "x", url=live.url)
    assert f"node {second} is already excluded (ECC errors)" in again.stderr
    unknown = optimus("node", "drain", "node9", "--job", JOB, "--yes", url=live.url)
    assert unknown.returncode == 2 and "no node 'node9' in this job" in unknown.stderr

    ok(optimus("node", "include", second, "--job", JOB, url=live.url))
    ok(optimus("node", "drain", first, "--job", JOB, "--yes", "--reason", "kernel update",
               url=live.url))
    rows = {r["node"]: r for r in json.loads(ok(optimus("node", "list", "--job", JOB, "-o",
                                                        "json", url=live.url)))}
    assert rows[second]["role"] == "spare" and rows[second]["excluded"] is None
    assert rows[first]["role"] == "ranks 0-0, draining"  # finishes this generation
    assert live.store.plan()["generation"] == 1


def test_unknown_jobs_are_refused_in_one_line_and_events_print_as_a_table(live):
    result = optimus("job", "status", "--job", "nope", url=live.url)
    assert result.returncode == 2
    assert result.stderr.startswith("error: no job 'nope' in Redis at "
                                    "redis://default:***@127.0.0.1:")
    assert len(result.stderr.strip().splitlines()) == 1
    table = ok(optimus("events", "--job", JOB, "--no-follow", "-n", "3", "--kind", "drain",
                       url=live.url))
    assert len(table.splitlines()) == 1
    assert f"drains by {_who()}: kernel update" in table


def test_stop_saves_and_ends_the_job_and_its_loss_curve_is_an_unpaused_runs(live, followed,
                                                                            tmp_path):
    refused = optimus("job", "stop", "--job", JOB, url=live.url)
    assert refused.returncode == 2 and "Missing option '--reason'" in refused.stderr
    ok(optimus("job", "stop", "--job", JOB, "--reason", "test over", "--yes", "--wait",
               "--timeout", "120", url=live.url))
    assert live.proc.wait(timeout=60) == 0
    lines = metrics(live.run)
    last = max(m["step"] for m in lines if "loss" in m)
    assert committed_steps(live.run / "checkpoints")[-1] == last
    assert len([m for m in lines if m.get("event") == "resume"]) == 1  # the exclusion's restart

    # A plain run, never paused, checkpointed on demand or restarted: the same losses exactly.
    reference = write_job(tmp_path / "job.yaml", tmp_path / "ref", name=JOB, steps=10_000)
    train_ranks(reference, 2, until_step=last, timeout=180)
    expected = {m["step"]: m["loss"] for m in metrics(tmp_path / "ref") if "loss" in m}
    got = {}
    for m in lines:
        if "loss" in m:
            got[m["step"]] = m["loss"]  # a step logged twice (before a restart): the later
    assert [got[s] for s in range(1, last + 1)] == [expected[s] for s in range(1, last + 1)]

    # The audit trail: every operator action, with who, from where and why, as followed live.
    # SIGTERM, not a Ctrl-C: a test run started in the background (no job control) has SIGINT
    # ignored, and its children inherit that. The follower flushes after every batch.
    followed.terminate()
    out, _ = followed.communicate(timeout=30)
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    by_operator = [(e["kind"], e.get("reason", "")) for e in events if e["actor"] != "controller"
                   and not e["actor"].startswith("agent:")]
    assert by_operator == [("pause", "maintenance"), ("resume", ""), ("checkpoint", ""),
                           ("exclude", "ECC errors"), ("include", ""),
                           ("drain", "kernel update"), ("stop", "test over")]
    assert all(e["host"] and e["actor"] == _who().split("@")[0]
               for e in events if e["kind"] in ("pause", "exclude", "stop"))
    kinds = [e["kind"] for e in events]
    assert kinds.index("paused") < kinds.index("resumed") < kinds.index("stopped")


def _who() -> str:
    import getpass
    import socket

    return f"{getpass.getuser()}@{socket.gethostname()}"


# --- access control -------------------------------------------------------------------------------

def test_agents_credentials_cannot_act_as_an_operator(tmp_path):
    """The ACL users of deploy/redis-users.acl run a whole job; the agent's cannot pause it.
    The job may shrink (min_nodes 1): excluding one of its two nodes, with no spare, goes on
    on the other with half the data-parallel degree."""
    secrets = {"controller": "c-pw", "agent": "a-pw", "operator": "o-pw"}
    acl = (ROOT / "deploy" / "redis-users.acl").read_text()
    for user, password in secrets.items():
        acl = acl.replace(f"CHANGE-ME-{user}", password)
    (tmp_path / "users.acl").write_text(acl)
    server = RedisServer(tmp_path, "--aclfile", str(tmp_path / "users.acl"))
    procs = Processes(tmp_path)
    url = {u: f"redis://optimus-{u}:{p}@127.0.0.1:{server.port}/0" for u, p in secrets.items()}
    try:
        run = tmp_path / "run"
        # Generation 0 paced by a sleep in rank 0 (rank 1 waits for it in every step: 1.5 s a
        # step, 60 s for its 40), so that it still runs when the operator's checkpoint and
        # exclusion come, however fast this machine steps; generation 1 (faults fire in
        # generation 0 only) just finishes. A fault for rank 1 would keep the world from
        # shrinking to one rank.
        job = write_job(tmp_path / "job.yaml", run, name="acl", steps=40, min_nodes=1,
                        faults=[{"kind": "slow_rank", "rank": 0, "step": 1, "seconds": 1.5}])
        procs.start("controller", "controller", str(job), "--nodes", "2", "--ranks-per-node",
                    "1", "--redis", url["controller"], "--exit-when-done", "--metrics-port", "0")
        for i in range(2):
            procs.start(f"agent{i}", "agent", "--job", "acl", "--node", f"node{i}", "--redis",
                        url["agent"], "--interval", "0.25")
        operator = Store(url["operator"], "acl")
        wait_for(lambda: operator.job_record().get("state") == "RUNNING", 60, "RUNNING")

        as_agent = optimus("job", "pause", "--job", "acl", "--yes", url=url["agent"])
        assert as_agent.returncode == 2 and "NOPERM" in as_agent.stderr
        assert len(as_agent.stderr.strip().splitlines()) == 1
        agent = redis.Redis.from_url(url["agent"])
        for attempt in (lambda: agent.xadd("optimus:{acl}:requests", {"action": "pause"}),
                        lambda: agent.set("optimus:{acl}:control", '{"pause": true}'),
                        lambda: agent.hset("optimus:{acl}:job", "desired", "stop"),
                        lambda: agent.hset("optimus:{acl}:excluded", "node1", "{}"),
                        lambda: agent.set("optimus:{acl}:plan", "{}"),
                        lambda: agent.rpush("optimus:{acl}:commands:node1", "{}")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()

        ok(optimus("job", "checkpoint", "--job", "acl", "--reason", "audit", "--wait",
                   "--timeout", "60", url=url["operator"]))
        out = ok(optimus("node", "exclude", "node1", "--job", "acl", "--reason", "shrink",
                         "--yes", "--wait", "--timeout", "60", url=url["operator"]))
        assert out.splitlines()[-1] == "generation 1 runs without node1"
        plan = operator.plan()
        assert (plan["nodes"], plan["world_size"]) == (["node0"], 1)
        assert "shrunk to 1 of 2 nodes" in plan["reason"]
        with pytest.raises(redis.exceptions.NoPermissionError):  # operators only ask
            redis.Redis.from_url(url["operator"]).hset("optimus:{acl}:job", "state", "FAILED")
        assert procs.procs["controller"].wait(timeout=120) == 0
        assert operator.job_record()["state"] == "COMPLETED"
        resumed = [m for m in metrics(run) if m.get("event") == "resume"]
        assert len(resumed) == 1 and max(m["step"] for m in metrics(run) if "loss" in m) == 40
        kinds = [e["kind"] for _, e in operator.events(count=1000)]
        assert "checkpoint" in kinds and "pause" not in kinds
        # The rank on node0 saved, waited, and trained generation 1's new layout (world 1,
        # half the data-parallel degree) in the same process: a reshard in process.
        launches = [e for _, e in operator.events(count=1000) if e["kind"] == "launch"
                    and e["node"] == "node0"]
        assert [(e["in_process"], e["pids"]) for e in launches] == [
            ("0", launches[0]["pids"]), ("1", launches[0]["pids"])]
    finally:
        procs.stop_all()
        server.stop()


def test_without_redis_the_exporter_answers_with_up_0_and_the_job_name(tmp_path):
    from controller.exporter import serve
    from optimus.config import load_job

    job = load_job(write_job(tmp_path / "job.yaml", tmp_path / "run", name="dark"))
    store = Store(f"redis://127.0.0.1:{free_port()}/0", "dark", timeout_s=0.2, retry_s=0.3)
    port = free_port()
    assert serve(store, job, leading=lambda: False, agent_timeout_s=3.0, port=port)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        scrape = r.read().decode()
    assert sample(scrape, "optimus_controller_up") == 0
    assert sample(scrape, "optimus_controller_leader") == 0
    assert sample(scrape, "optimus_job_info", name="dark") == 1
    assert "optimus_job_state" not in scrape  # nothing made up while Redis is unreadable


def test_resubmit_starts_an_ended_job_again_and_nothing_else(tmp_path):
    from controller.cli.main import _resubmit
    from optimus.config import load_job

    server = RedisServer(tmp_path)
    try:
        job = load_job(write_job(tmp_path / "job.yaml", tmp_path / "run", name="again"))
        store = Store(server.url, "again")
        for state in ("RUNNING", "COMPLETED"):  # running, or finished: left alone
            store.update_job({"state": state, "generation": 3})
            _resubmit(store, job)
            assert store.job_record()["state"] == state
        store.update_job({"state": "FAILED", "reason": "5 restarts used up"})
        store.exclude("node1", "ECC errors", by="ana@desk", mode="exclude")
        _resubmit(store, job)
        assert store.job_record() == {}
        assert store.excluded()["node1"]["reason"] == "ECC errors"  # still out
        (event,) = [e for _, e in store.events() if e["kind"] == "resubmitted"]
        assert event["message"] == ("job again was FAILED; submitted again (--resubmit), from "
                                    "its latest committed checkpoint; still excluded: node1")
    finally:
        server.stop()


def test_the_operator_commands_start_without_torch():
    code = "import sys, controller.cli.main; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
