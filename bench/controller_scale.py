"""The controller at 1,024, 16,384 and 131,072 ranks: simulated agents beating into a real Redis.

Per size (nodes of 12 ranks: 86, 1,366 and 10,923 nodes; the world is nodes x 12), with
supervision heartbeat_interval_s 1 s, heartbeat_timeout_s 2 s, hang_timeout_s and hang_floor_s 2 s,
hang_step_factor 2:

1. loop: a real `Controller` (a validated job, `settings_for`) calling `tick()` at its own
   cadence (as `Controller.run`: TICK_S from start to start) for --duration s while every node
   beats at 1 Hz; median, p99 and max tick time (wall), and CPU time per tick.
2. stale node: one node's ticks stop (its agent beat and its ranks' heartbeats); from its last
   tick to the controller's `failure` event naming it (or a "stop" plan naming it).
3. stalled rank: every rank steps once a second; one rank stops stepping while its heartbeats
   stay fresh (phase "backward", its old step), the others one step later (phase "grad_sync");
   from the stall to the first `suspect`/`failure` event naming the culprit. This needs the hang
   rule: "not available" when `Settings` has no hang_timeout_s.
4. Redis: `INFO memory` used_memory once the job beats; `INFO cpu` (sys + user) over the loop
   window, as % of one core (beside it the CPU of the controller, of the simulator and of any
   other work on the machine). And the simulator's node ticks per second against the nodes: the
   figures mean something only where it sustains 1 Hz per node; 2 and 3 are skipped below 90%.

Targets at 131,072 ranks: loop <= 1 s; a stale node decided within 2 heartbeat intervals + one
loop (the loop period measured at that size, p99, at most the 1 s target); Redis <= 50% of one
core. The stalled rank has no target; its expected bound is printed beside it. A decision about
a healthy node is a false alarm: it is printed, and a failure is undone (the job RUNNING again on
the same plan, the node included again) so that the measurement goes on.

How. A private redis-server on loopback per size (no persistence, `start_redis`). Every node
registers (`OwnRecords.register_node`); the job record and plan of generation 0 are written as the
controller writes them (every key of `_plan_next`'s plan: the node list, and a reason naming
the first nodes). Then worker processes, each owning a slice of the nodes, tick every node once per
interval, the nodes' ticks spread evenly over the interval. A node's tick is the traffic of
`OwnRecords.agent_tick(node, status, beats, deadline, reset_ranks=False, summary=NodeSummary(...))`:
the status the agent's `_tick` sends (generation, state, live ranks, host, pids), the read of
the plan's stamp (agents read the plan itself only when it changes), 12 rank heartbeats shaped
as `optimus/supervision/heartbeat.py` sends them plus `received` (each rank
beats at its own phase, so a relayed beat is 0-1 interval old), the deadline min(beat time) +
heartbeat_timeout_s, and the summary the agent's `_summary` makes.

Batched: each worker sends its due nodes' ticks (up to 64 nodes) as one pipeline on one raw
socket, parsing the replies with hiredis, instead of one redis-py pipeline per node: an
`OwnRecords.agent_tick` costs 0.2-0.6 ms of client CPU, and 10,923 of them a second do not fit
beside Redis and the controller on two cores. Redis gets the same commands, each node's in its
order (only fewer round trips: its syscall work, hence its CPU, is a slight underestimate of
10,923 separate agents). At start-up the commands are checked byte for byte against those of
`OwnRecords.agent_tick` for the same inputs, so a change there stops the benchmark instead of
measuring other traffic. The simulated agents are in bench/controller_scale_fleet.py, the
figures' report in bench/controller_scale_report.py.

    .venv/bin/python bench/controller_scale.py [--sizes 1024,16384,131072] [--duration 30]
        [--workers N] [--profile]

About 2.5 minutes with the defaults on a 2-core VM: ~45 s for each small size, 60-80 s for
131,072 (where the real agents' traffic cannot be sustained and the controller's first ticks
take longer). `--profile` prints cProfile's top functions over the timed ticks.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import math
import multiprocessing as mp
import os
import pstats
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from controller.cli.run import LocalCluster, start_redis
from controller.control.controller import TICK_S, Controller
from controller.control.decide import Settings
from controller.control.decide import names as decide_names
from controller.control.settings import settings_for
from controller.exporter import JobCollector
from controller.store.store import Store
from optimus.config import validate_job

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.controller_scale_fleet import (  # noqa: E402
    FIRST_STEP,
    HANG_STEP_FACTOR,
    HANG_TIMEOUT_S,
    INTERVAL_S,
    JOB,
    QUIT,
    RPN,
    STALL_AT,
    STALL_RANK,
    STALL_STEP,
    STEP_S,
    STOP,
    STOPPED_AT,
    TIMEOUT_S,
    SimSpec,
    check_commands,
    node_name,
    simulate,
)
from bench.controller_scale_report import Result, report, table  # noqa: E402

SETTLE_S = 4.0  # normal running between the two faults
WAIT_S = 30.0  # at most, for a decision


def bench_job(run_dir: Path, world: int) -> dict:
    return {
        "name": JOB, "run_dir": str(run_dir),
        "model": {"vocab_size": 264, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 64},
        "optim": {"steps": 1_000_000, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5},
        "data": {"source": "synthetic", "seq_len": 64, "batch_size": world, "microbatches": 1},
        "supervision": {"heartbeat_interval_s": INTERVAL_S, "heartbeat_timeout_s": TIMEOUT_S,
                        "hang_timeout_s": HANG_TIMEOUT_S, "hang_floor_s": HANG_TIMEOUT_S,
                        "hang_step_factor": HANG_STEP_FACTOR,
                        "restart_backoff_s": 0.0, "max_restarts": 1000},
    }


# --- the controller, driven and watched -------------------------------------------------------

class Size:
    """One size: its Redis, job, simulated agents and controller; the figures in `res`."""

    def __init__(self, ranks: int, workers: int, profile: cProfile.Profile | None):
        self.nodes = nodes = math.ceil(ranks / RPN)
        self.res = Result(ranks, nodes)
        self.profile = profile
        (REPO / "runs").mkdir(exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=REPO / "runs"))
        self.cluster = LocalCluster(self.tmp)
        ctx = mp.get_context("fork")
        self.control = ctx.Array("d", 8, lock=False)
        self.control[STOP] = -1
        self.procs: list = []
        url = start_redis(self.cluster)
        self.store = store = Store(url, JOB)
        job = validate_job(bench_job(self.tmp / "run", nodes * RPN), world=nodes * RPN)
        settings = settings_for(job, str(self.tmp / "job.yaml"), [], nodes, RPN)
        self.hang_rule = any(f.name == "hang_timeout_s" for f in dataclasses.fields(Settings))
        names = [node_name(i) for i in range(nodes)]
        for i, node in enumerate(names):
            store.own.register_node(node, {"host": f"host{i}", "health": "ok", "devices": RPN})
        # Generation 0 as the controller plans it (decide._plan_next) and records it.
        now = time.time()
        reason = f"generation 0 on {decide_names(names)} from scratch"
        self.plan = {
            **settings.launch, "generation": 0, "action": "run", "nodes": names,
            "ranks_per_node": RPN, "world_size": settings.world_size, "master_addr": "host0",
            "master_port": 0, "resume_step": None, "grace_s": settings.failure_grace_s,
            "heartbeat_timeout_s": settings.heartbeat_timeout_s,
            "startup_timeout_s": settings.startup_timeout_s, "reason": reason, "issued": now,
            "exits_from": store.last_exit_id()}
        self.record = {"state": "RUNNING", "reason": reason, "name": JOB, "nodes": nodes,
                       "ranks_per_node": RPN, "created": now, "restarts": 0, "generation": 0}
        self.restore()
        check_commands(url, self.plan)

        self.t0 = time.time() + 0.5
        spec = SimSpec(url, nodes, self.t0)
        self.workers = workers or max(1, min(4, math.ceil(nodes / 3000)))
        self.counters = ctx.Array("d", 2 * self.workers, lock=False)
        cuts = [nodes * w // self.workers for w in range(self.workers + 1)]
        self.procs = [ctx.Process(target=simulate, daemon=True, args=(
            spec, cuts[w], cuts[w + 1], self.control, self.counters, w))
            for w in range(self.workers)]
        for proc in self.procs:
            proc.start()
        time.sleep(max(self.t0 - time.time(), 0) + 2.5 * INTERVAL_S)  # every node beat twice
        self.ctl = Controller(store, job, settings)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(JobCollector(store, job, leading=lambda: True,
                                       agent_timeout_s=settings.agent_timeout_s))
        self.registry = registry
        self.after = "-"

    def restore(self) -> None:
        """Undo a failure: generation 0 runs on, on every node, nobody excluded (the
        controller's progress record, about generation 0 still, stays)."""
        for node in self.store.excluded():
            self.store.include(node)
        self.store.update_job(self.record, delete=("failure_since", "next_plan_at"))
        self.store.set_plan(self.plan)

    def tick(self, timed: bool = False) -> list[dict]:
        """One pass of the controller's loop as `Controller.run` makes it (tick, then sleep out
        TICK_S); the events written since the last."""
        if any(proc.exitcode is not None for proc in self.procs):
            raise SystemExit(f"a simulator worker died ({self.res.ranks} ranks); see above")
        started, cpu = time.monotonic(), time.process_time()
        if self.profile is not None and timed:
            state = self.profile.runcall(self.ctl.tick)
        else:
            state = self.ctl.tick()
        took = time.monotonic() - started
        if timed:
            self.res.loop.append(took)
            self.res.loop_cpu.append(time.process_time() - cpu)
            self.res.errors += state is None
        events = self.store.events(count=100_000, after=self.after)
        if events:
            self.after = events[-1][0]
        time.sleep(max(TICK_S - took, 0.0))
        return [e for _, e in events]

    def alarm(self, e: dict) -> None:
        """A decision about a healthy node: noted, and a failure undone."""
        if e["kind"] in ("failure", "suspect"):
            self.res.false_alarms.append(f"{e['kind']}: {e['message'][:160]}")
            if e["kind"] == "failure":
                self.restore()

    def steady(self, duration: float) -> None:
        """1 and 4: the loop while all beat; Redis; the simulator's rate; who used the CPU."""
        res, store, counters = self.res, self.store, self.counters
        print(f"  {self.nodes} nodes registered, job RUNNING, {self.workers} simulator "
              f"worker(s); timing the loop for {duration:g} s", flush=True)
        for w in range(self.workers):
            counters[2 * w + 1] = 0.0
        ticks, before, started = sum(counters[0::2]), self.cpu_now(), time.monotonic()
        while time.monotonic() - started < duration:
            for e in self.tick(timed=True):
                self.alarm(e)
        wall = time.monotonic() - started
        after = self.cpu_now()
        res.cpu = {k: 100 * (after[k] - before[k]) / wall for k in before}
        res.cpu["others"] = res.cpu.pop("machine") - sum(res.cpu.values())
        res.rate = (sum(counters[0::2]) - ticks) / wall
        res.late_s = max(counters[1::2])
        res.memory = store.r.info("memory")["used_memory"]

    def scrapes(self, count: int = 10) -> None:
        """The exporter's /metrics body, rendered as a scrape renders it, while all beat."""
        for _ in range(count):
            started = time.monotonic()
            body = generate_latest(self.registry)
            self.res.scrape.append(time.monotonic() - started)
            self.res.scrape_bytes = len(body)
            self.tick()

    def cpu_now(self) -> dict[str, float]:
        """CPU seconds so far: Redis (INFO cpu), this process, the simulator, the machine."""
        info = self.store.r.info("cpu")
        busy = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return {"redis": info["used_cpu_sys"] + info["used_cpu_user"],
                "controller": time.process_time(),
                "simulator": sum(cpu_s(proc.pid) for proc in self.procs),
                "machine": (sum(busy) - busy[3] - busy[4]) / os.sysconf("SC_CLK_TCK")}

    def stale_node(self) -> None:
        """2: one node's ticks stop; its last tick to the decision naming it."""
        res, c = self.res, self.control
        victim = node_name(self.nodes // 2)
        c[STOPPED_AT] = 0.0
        c[STOP] = self.nodes // 2
        deadline = time.monotonic() + WAIT_S
        while res.stale_s is None and time.monotonic() < deadline:
            for e in self.tick():
                if e["kind"] == "failure" and mentions(e, victim) and res.stale_s is None:
                    res.stale_s, res.stale_how = float(e["time"]), e["message"]
                else:
                    self.alarm(e)
            plan = self.store.plan()
            if (res.stale_s is None and plan and plan["action"] == "stop"
                    and mentions({"message": plan.get("reason", "")}, victim)):
                res.stale_s, res.stale_how = plan["issued"], f"stop plan: {plan['reason']}"
        if res.stale_s is None:
            res.stale_how = f"no decision within {WAIT_S:g} s"
        else:
            while not c[STOPPED_AT]:
                time.sleep(0.01)
            res.stale_s -= c[STOPPED_AT]
        resumed = time.time()
        c[STOP] = -1
        # The victim beats again (within an interval) before the controller looks again; no
        # longer: a pause past the hang threshold looks like a stall to the next tick.
        while (self.store.summaries.sweep([victim]).agent_beats.get(victim) or 0) < resumed:
            time.sleep(0.05)
            self.ctl.relay.run(self.store.plan())  # its beat reaches `agents` through the relay
        self.restore()

    def stalled_rank(self) -> None:
        """3: one rank stops stepping, heartbeats fresh; the stall to the event naming it."""
        res, c = self.res, self.control
        if not self.hang_rule:
            res.stall_how = "not available: controller/control/decide.py has no hang rule yet"
            return
        settle = time.monotonic()
        while time.monotonic() - settle < SETTLE_S:
            for e in self.tick():
                self.alarm(e)
        node, culprit = self.nodes // 3, self.nodes // 3 * RPN + 5
        at = time.time()
        c[STALL_RANK], c[STALL_STEP] = culprit, FIRST_STEP + (at - self.t0) // STEP_S
        c[STALL_AT] = at
        other = ""
        deadline = time.monotonic() + WAIT_S
        while res.stall_s is None and time.monotonic() < deadline:
            for e in self.tick():
                if e["kind"] not in ("failure", "suspect") or res.stall_s is not None:
                    continue
                if mentions(e, node_name(node), culprit):
                    res.stall_s, res.stall_how = float(e["time"]) - at, e["message"]
                elif not other:
                    other = f"; first decision: {e['kind']}: {e['message']}"
        if res.stall_s is None:
            res.stall_how = f"no event named the culprit within {WAIT_S:g} s{other}"

    def close(self) -> None:
        self.control[QUIT] = 1
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self.cluster.stop_all()
        shutil.rmtree(self.tmp, ignore_errors=True)


def run_size(ranks: int, duration: float, workers: int,
             profile: cProfile.Profile | None) -> Result:
    size = Size(ranks, workers, profile)
    try:
        size.steady(duration)
        size.scrapes()
        if size.res.rate >= 0.9 * size.nodes / INTERVAL_S:
            size.stale_node()
            size.stalled_rank()
        else:
            size.res.stale_how = size.res.stall_how = (
                "not measured: the simulated agents fell behind, so healthy nodes are late too")
        return size.res
    finally:
        size.close()


def mentions(e: dict, node: str, rank: int | None = None) -> bool:
    text = e.get("message", "")
    return (e.get("node") == node or re.search(rf"\b{re.escape(node)}\b", text) is not None
            or (rank is not None and re.search(rf"\brank {rank}\b", text) is not None))


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,16384,131072", help="ranks, comma-separated")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of loop timing")
    parser.add_argument("--workers", type=int, default=0, help="simulator processes (0: auto)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the timed controller ticks and print the top functions")
    args = parser.parse_args()
    if args.duration < 20:
        print(f"note: --duration {args.duration:g} is under the 20 s Redis CPU window asked for")
    print(f"heartbeat every {INTERVAL_S:g} s, timeout {TIMEOUT_S:g} s; hang_timeout_s "
          f"{HANG_TIMEOUT_S:g}, hang_step_factor {HANG_STEP_FACTOR:g}; ranks step every "
          f"{STEP_S:g} s; controller tick every {TICK_S:g} s; {os.cpu_count()} CPU(s)",
          flush=True)
    results = []
    for ranks in (int(s) for s in args.sizes.split(",")):
        print(f"\n== {ranks:,} ranks: {math.ceil(ranks / RPN):,} nodes x {RPN} ==", flush=True)
        began = time.monotonic()
        profile = cProfile.Profile() if args.profile else None
        r = run_size(ranks, args.duration, args.workers, profile)
        report(r)
        if profile is not None:
            print(f"  cProfile of the {len(r.loop)} timed controller ticks, by own time:")
            pstats.Stats(profile).sort_stats("tottime").print_stats(12)
            pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
        print(f"  ({time.monotonic() - began:.0f} s)", flush=True)
        results.append(r)
    table(results)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
