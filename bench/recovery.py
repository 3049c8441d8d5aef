"""Recovery time per fault: injection -> the controller's decision -> the next generation's
first step, on the tiny CPU job under the whole control plane on this machine.

A private redis-server, a controller and 3 agents (2 nodes x 1 rank + 1 spare), started by the
same code as `optimus run`. For each fault kind, `--trials` times: wait until the generation
has trained 13 steps (past a disk checkpoint: they are every 10), inject the fault through
`optimus chaos`'s path (Redis -> the agent of the node holding rank 1), then read three times
from the run itself:

- injection: the agent's "chaos" event (written just before it acts);
- decision: the controller's "failure" event for that generation;
- next step: the first step rank 0 logs in metrics.jsonl after the decision (log_every 1).

The excluded node is then put back (as an operator would with a repaired node; a killed node's
agent is restarted first), so every trial has a spare. The reference, measured in the same
run, is a first start: the first generation's plan to its first logged step. Targets: decision
p99 <= 5 s for a dead or frozen rank; fault to next step <= 30 s.

The whole measurement runs once per mode (`--modes`), each `<start>-<recovery>`:
- start `warm`: each agent forks its ranks from a process that imported the trainer once
  (controller/node/spawn.py); `standby`: each agent keeps a process per device past its imports
  (and its device context, on a GPU) that the next generation's rank becomes; `cold`
  (OPTIMUS_WARM_START=0): every rank is a fresh `python -m optimus train`;
- recovery `memory`: in-memory snapshots (`checkpoint.memory_every`, auto unless
  `--memory-every`), replicated to a buddy node, the next generation resumes from the newest
  usable one; `disk`: snapshots off, it resumes from the newest disk checkpoint (every 10 steps);
- and `-inprocess` at the end (`warm-memory-inprocess`): `supervision.restart: in_process`, the
  ranks the fault did not touch wait in process for the next generation
  (optimus/supervision/inprocess.py);
  without it, `process`: every rank restarts as a new one (how Optimus restarted before);
- `replica`: replicas that carry on (bench/recovery_replicas.py): a killed rank's replica
  leaves the quorum, the others step on, a standby in its place is healed from a peer; on
  `optimus train` with the quorum written at once (no controller: its decision is not in it);
  `replica-control`: the same under the whole control plane (bench/recovery_control.py): the
  controller's decision, the agent's relaunch and the rejoin are in it.
Per trial it also records the steps lost (the last step the failed generation logged, minus the
step the next one resumed from) and where the next generation's state came from. The last lines
compare every mode's fault-to-next-step medians with the first mode's (the reference:
`cold-disk`, how Optimus recovered before in-memory snapshots and warm starts).

    .venv/bin/python bench/recovery.py [--trials 5] [--faults kill_rank,freeze_rank,kill_node]
                                       [--modes cold-disk,warm-disk,warm-memory,
                                                warm-memory-inprocess]
                                       [--memory-every auto]

Settings (printed): heartbeat every 0.5 s, timeout 3 s; a frozen rank's decision cannot come
sooner than the timeout, so it scales with `supervision.heartbeat_timeout_s` (30 s by default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from controller.cli.run import LocalCluster, start_redis
from controller.node.spawn import WARM_ENV
from controller.store.store import Store

REPO = Path(__file__).resolve().parents[1]
INTERVAL_S, TIMEOUT_S = 0.5, 3.0
STARTS = {"warm": "fork", "standby": "standby", "cold": "0"}  # -> OPTIMUS_WARM_START
TRIAL_STEPS = 13  # a fault comes once the generation has logged this many steps
TARGET_DECISION_S, TARGET_NEXT_STEP_S = 5.0, 30.0


def bench_job(run_dir: Path, memory_every: int | str = 0, restart: str = "process") -> dict:
    return {
        "name": "bench-recovery", "seed": 1234, "run_dir": str(run_dir),
        "model": {"vocab_size": 264, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 64},
        "optim": {"steps": 1_000_000, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5},
        "data": {"source": "synthetic", "seq_len": 64, "batch_size": 8, "microbatches": 1},
        "checkpoint": {"interval": 10, "keep_last": 2, "memory_every": memory_every},
        "supervision": {"log_every": 1, "heartbeat_interval_s": INTERVAL_S,
                        "heartbeat_timeout_s": TIMEOUT_S, "restart_backoff_s": 0.0,
                        "restart_backoff_max_s": 0.0, "failure_grace_s": 1.0,
                        "max_restarts": 1000, "stop_grace_s": 30.0, "restart": restart},
    }


class Run:
    def __init__(self, tmp: Path, memory_every: int | str, restart: str = "process"):
        self.run_dir = tmp / "run"
        self.job_file = tmp / "job.yaml"
        self.job_file.write_text(yaml.safe_dump(bench_job(self.run_dir, memory_every, restart)))
        (self.run_dir / "control").mkdir(parents=True)
        self.cluster = LocalCluster(self.run_dir / "control")
        self.url = start_redis(self.cluster)
        self.store = Store(self.url, "bench-recovery")
        # Secrets by environment, as `optimus run` hands them over: the URL's password, and the
        # agents' snapshot secret (without one an agent serves no snapshots: no memory restart).
        self.env = {"REDIS_URL": self.url, "OPTIMUS_SNAPSHOT_SECRET": secrets.token_hex(32)}
        self.cluster.start("controller", [sys.executable, "-m", "controller", "controller",
                                          str(self.job_file), "--nodes", "2",
                                          "--ranks-per-node", "1"],
                           env={"REDIS_URL": self.url})
        for i in range(3):
            self.start_agent(f"node{i}")

    def start_agent(self, node: str) -> None:
        self.cluster.start(f"agent-{node}", [sys.executable, "-m", "controller", "agent",
                                             "--job", "bench-recovery", "--node", node,
                                             "--interval", str(INTERVAL_S)], env=self.env)

    def events(self, kind: str) -> list[dict]:
        return [e for _, e in self.store.events(count=100_000) if e["kind"] == kind]

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                rows.append(json.loads(line))
        return rows

    def steps(self) -> list[tuple[float, int]]:
        return [(r["time"], r["step"]) for r in self.rows() if "loss" in r]

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise RuntimeError(f"timed out after {timeout} s waiting for {what}; logs in "
                           f"{self.run_dir}")

    def running_generation(self) -> dict | None:
        plan = self.store.plan()
        record = self.store.job_record()
        if plan and plan["action"] == "run" and record.get("state") == "RUNNING":
            return plan
        return None

    def trial(self, fault: str) -> dict:
        plan = self.wait(self.running_generation, 120, "a running generation")
        gen = plan["generation"]
        issued = plan["issued"]
        # 13 steps: past a disk checkpoint (every 10), so that each mode has one to lose to.
        self.wait(lambda: sum(t > issued for t, _ in self.steps()) >= TRIAL_STEPS, 120,
                  f"{TRIAL_STEPS} steps of generation {gen}")
        culprit = plan["nodes"][1]  # holds rank 1
        before = len(self.events("failure"))
        self.store.push_command(culprit, {"kind": fault, "rank": 1, "time": time.time()})
        injected = float(self.wait(lambda: [e for e in self.events("chaos")
                                            if e["node"] == culprit and e["fault"] == fault
                                            and float(e["time"]) > issued], 30,
                                   "the agent to inject")[-1]["time"])
        failure = self.wait(lambda: self.events("failure")[before:], 60, "the decision")[0]
        decided = float(failure["time"])
        # The old generation may still log a step while it stops (a thawed rank saves first):
        # count only steps logged after the next generation's plan.
        new = self.wait(lambda: (p := self.running_generation()) and p["generation"] > gen
                        and p, 120, "the next generation")
        nxt = self.wait(lambda: [t for t, _ in self.steps() if t > new["issued"]], 120,
                        "the next generation's first step")[0]
        rows = self.rows()
        reached = max(r["step"] for r in rows if "loss" in r and r["time"] < new["issued"])
        resume = [r for r in rows if r.get("event") == "resume" and r["time"] > new["issued"]]
        resumed, source = (resume[-1]["step"], resume[-1].get("source", "disk")) if resume \
            else (0, "scratch")
        # Put the culprit back for the next trial, as after a repair.
        if fault == "kill_node":
            self.cluster.procs[f"agent-{culprit}"].wait(timeout=10)
            self.start_agent(culprit)
        self.store.include(culprit)
        launches = [e for e in self.events("launch")
                     if e["message"].startswith(f"generation {new['generation']}:")]
        kept = sum(int(e.get("in_process") or 0) for e in launches)
        return {"decision": decided - injected, "next_step": nxt - injected,
                # A step trained and snapshotted whose log line the fault cut off: none lost.
                "reason": failure["message"], "lost": max(reached - resumed, 0),
                "source": source,
                "resumed": resumed, "in_process": kept,
                "parts": after_the_decision(decided, new, launches, rows, nxt)}

    def cold_start(self) -> float:
        plan = self.wait(self.running_generation, 120, "generation 0")
        first = self.wait(self.steps, 120, "the first step")[0][0]
        return first - plan["issued"]

    def close(self) -> None:
        self.cluster.stop_all()


PARTS = ("plan", "launch", "enter", "rendezvous", "groups", "model", "restore", "data",
         "first_step")


def after_the_decision(decided: float, plan: dict, launches: list[dict], rows: list[dict],
                       first_step: float) -> dict[str, float]:
    """Where the time from the decision to the next generation's first step went, in order:
    the controller's stop and plan (decision -> plan issued), the agents' launch (-> the last
    launch event), the rank's entry (-> rank 0 enters train(): a new process's start, or a
    waiting rank's pickup of its word), rank 0's own laps (its "start" event), and the first
    step (-> its metrics line)."""
    start = [r for r in rows if r.get("event") == "start" and r["time"] > plan["issued"]]
    if not start or not launches:
        return {}
    laps = start[-1]
    launched = max(float(e["time"]) for e in launches)
    parts = {"plan": plan["issued"] - decided, "launch": launched - plan["issued"],
             "enter": laps["entered"] - launched}
    parts.update({k: laps.get(f"{k}_s", 0.0) for k in PARTS[3:-1]})
    parts["first_step"] = first_step - laps["time"]
    return parts


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--faults", default="kill_rank,freeze_rank,kill_node")
    parser.add_argument("--modes", default="cold-disk,warm-disk,warm-memory",
                        help="<warm|standby|cold>-<memory|disk>[-inprocess], replica "
                             "(bench/recovery_replicas.py) or replica-control "
                             "(bench/recovery_control.py), comma-separated; the first is the "
                             "reference of the ratios")
    parser.add_argument("--memory-every", default="auto",
                        help="checkpoint.memory_every for the memory modes")
    args = parser.parse_args()
    faults = args.faults.split(",")
    modes = args.modes.split(",")
    for mode in modes:
        if mode in ("replica", "replica-control"):
            continue
        start, _, recovery = mode.partition("-")
        recovery, _, restart = recovery.partition("-")
        if start not in STARTS or recovery not in ("memory", "disk") or restart not in (
                "", "inprocess"):
            parser.error(f"mode {mode!r}: write <{'|'.join(STARTS)}>-<memory|disk>"
                         "[-inprocess], e.g. warm-memory-inprocess, or replica")
    every = args.memory_every if args.memory_every == "auto" else int(args.memory_every)
    print(f"2 nodes x 1 rank + 1 spare on one machine; heartbeat {INTERVAL_S} s, timeout "
          f"{TIMEOUT_S} s, failure grace 1 s, no backoff; {args.trials} trial(s) per fault",
          flush=True)
    medians: dict[str, dict[str, float]] = {}
    for mode in modes:
        if mode == "replica":  # replicas that carry on: bench/recovery_replicas.py
            from recovery_replicas import measure_replicas

            medians[mode] = {"kill_rank": measure_replicas(args.trials)["kill_to_next_step_s"]}
            continue
        if mode == "replica-control":  # ... under the control plane: bench/recovery_control.py
            from recovery_control import measure_control

            os.environ[WARM_ENV] = STARTS["warm"]
            medians[mode] = {"kill_rank": measure_control(args.trials, sys.modules[__name__])}
            continue
        start, recovery, *inprocess = mode.split("-")
        os.environ[WARM_ENV] = STARTS[start]  # the agents inherit it
        medians[mode] = measure(mode, args.trials, faults,
                                every if recovery == "memory" else 0,
                                "in_process" if inprocess else "process")
    reference = modes[0]
    for mode in modes[1:]:
        print(f"\n{mode} / {reference}, fault -> next step medians:")
        for fault in faults:
            if fault not in medians[mode] or fault not in medians[reference]:
                continue  # the replica mode measures a killed rank only
            this, ref = medians[mode][fault], medians[reference][fault]
            print(f"  {fault:12s} {this:.2f} s / {ref:.2f} s = {this / ref:.2f}x")


def measure(mode: str, trials: int, faults: list[str], memory_every: int | str,
            restart: str = "process") -> dict[str, float]:
    """One whole run in `mode`; the fault-to-next-step median per fault."""
    (REPO / "runs").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-recovery-", dir=REPO / "runs"))
    run = Run(tmp, memory_every, restart)
    print(f"\n{mode} starts", flush=True)
    try:
        first = run.cold_start()
        print(f"reference: first start (plan -> first step of generation 0) {first:.2f} s",
              flush=True)
        results: dict[str, list[dict]] = {f: [] for f in faults}
        for trial in range(trials):
            for fault in faults:
                r = run.trial(fault)
                results[fault].append(r)
                print(f"trial {trial + 1} {fault}: decision {r['decision']:.2f} s, next step "
                      f"{r['next_step']:.2f} s (after the decision "
                      f"{r['next_step'] - r['decision']:.2f} s), {r['lost']} step(s) lost "
                      f"(resumed from {r['source']} at step {r['resumed']}), "
                      f"{r['in_process']} rank(s) in process ({r['reason']})", flush=True)
                if r["parts"]:
                    print("  after the decision: " + ", ".join(
                        f"{k} {r['parts'][k]:.2f}" for k in PARTS) + " s", flush=True)
        every = [m for m in run.rows() if m.get("event") == "snapshot"]
        if every:
            print(f"snapshots: {every[0]['message']}")
        print(f"per fault, {mode}, seconds from injection (n={trials} each); reference "
              f"first start {first:.2f} s")
        for fault, rs in results.items():
            d = [r["decision"] for r in rs]
            n = [r["next_step"] for r in rs]
            after = [r["next_step"] - r["decision"] for r in rs]
            d_target = (f"target <= {TARGET_DECISION_S:g} s: "
                        f"{'met' if p99(d) <= TARGET_DECISION_S else 'MISSED'}"
                        if fault != "kill_node" else "no target")
            print(f"  {fault:12s} decision median {statistics.median(d):.2f} p99 {p99(d):.2f} "
                  f"({d_target}); fault -> next step median {statistics.median(n):.2f} p99 "
                  f"{p99(n):.2f} (target <= {TARGET_NEXT_STEP_S:g} s: "
                  f"{'met' if p99(n) <= TARGET_NEXT_STEP_S else 'MISSED'}); "
                  f"next step / first start {statistics.median(n) / first:.2f}x; steps lost "
                  f"median {statistics.median(r['lost'] for r in rs):g} max "
                  f"{max(r['lost'] for r in rs)}; resumed from "
                  f"{', '.join(sorted({r['source'] for r in rs}))}; after the decision "
                  f"median {statistics.median(after):.2f} p99 {p99(after):.2f}; ranks kept "
                  f"in process median {statistics.median(r['in_process'] for r in rs):g}")
            parts = [r["parts"] for r in rs if r["parts"]]
            if parts:
                print(f"  {'':12s} after the decision, medians: " + ", ".join(
                    f"{k} {statistics.median(p[k] for p in parts):.2f}" for k in PARTS) + " s")
        return {fault: statistics.median(r["next_step"] for r in rs)
                for fault, rs in results.items()}
    finally:
        run.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
