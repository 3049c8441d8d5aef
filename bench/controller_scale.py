"""The controller at 1,024, 16,384 and 131,072 ranks: simulated agents beating into a real Redis.

Per size (nodes of 12 ranks: 86, 1,366 and 10,923 nodes; the world is nodes x 12), with
supervision heartbeat_interval_s 1 s, heartbeat_timeout_s 2 s, hang_timeout_s 2 s,
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
registers (`Store.register_node`); the job record and plan of generation 0 are written as the
controller writes them (every key of `_plan_next`'s plan: the node list, and a reason naming
the first nodes). Then worker processes, each owning a slice of the nodes, tick every node once per
interval, the nodes' ticks spread evenly over the interval. A node's tick is the traffic of
`Store.agent_tick(node, status, beats, deadline, reset_ranks=False, summary=NodeSummary(...))`:
the status the agent's `_tick` sends (generation, state, live ranks, host, pids), the read of
the plan's stamp (agents read the plan itself only when it changes), 12 rank heartbeats shaped
as `optimus/health.py` sends them plus `received` (each rank
beats at its own phase, so a relayed beat is 0-1 interval old), the deadline min(beat time) +
heartbeat_timeout_s, and the summary the agent's `_summary` makes.

Batched: each worker sends its due nodes' ticks (up to 64 nodes) as one pipeline on one raw
socket, parsing the replies with hiredis, instead of one redis-py pipeline per node: a
`Store.agent_tick` costs 0.2-0.6 ms of client CPU, and 10,923 of them a second do not fit beside
Redis and the controller on two cores. Redis gets the same commands, each node's in its order
(only fewer round trips: its syscall work, hence its CPU, is a slight underestimate of 10,923
separate agents). At start-up the commands are checked byte for byte against those of
`Store.agent_tick` for the same inputs, so a change there stops the benchmark instead of
measuring other traffic.

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
import json
import math
import multiprocessing as mp
import os
import pstats
import re
import shutil
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import hiredis
import redis
from prometheus_client import CollectorRegistry, generate_latest

import controller.store.store as store_module
from controller.cli.run import LocalCluster, start_redis
from controller.control.controller import TICK_S, Controller, settings_for
from controller.control.decide import Settings
from controller.control.decide import names as decide_names
from controller.exporter import JobCollector
from controller.store.store import Store, prefix
from controller.store.summaries import NodeSummary
from optimus.config import validate_job

REPO = Path(__file__).resolve().parents[1]
JOB = "bench-scale"
RPN = 12  # ranks per node
INTERVAL_S, TIMEOUT_S = 1.0, 2.0  # heartbeat interval and timeout
HANG_TIMEOUT_S, HANG_STEP_FACTOR = 2.0, 2.0
STEP_S, FIRST_STEP = 1.0, 1000  # every rank steps once a second, from step 1000
# The phases of a step: (where each ends, as a fraction of the step, name).
PHASES = ((0.05, "data"), (0.40, "forward"), (0.85, "backward"), (0.95, "grad_sync"),
          (1.0, "optim"))
GRAD_SYNC_AT = 0.85
BEAT_FIELDS = ("v", "rank", "local_rank", "pid", "generation", "time", "step", "phase",
               "phase_since", "compute_s", "wait_s", "finite", "seq", "metrics", "received")
TARGET_LOOP_S, TARGET_REDIS_CPU = 1.0, 50.0
MAX_BATCH = 64  # nodes in one pipeline
SETTLE_S = 4.0  # normal running between the two faults
WAIT_S = 30.0  # at most, for a decision
# The control block shared with the workers (doubles).
STOP, STOPPED_AT, STALL_RANK, STALL_STEP, STALL_AT, QUIT = range(6)


def node_name(i: int) -> str:
    return f"node{i}"


def bench_job(run_dir: Path, world: int) -> dict:
    return {
        "name": JOB, "run_dir": str(run_dir),
        "model": {"vocab_size": 264, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 64},
        "optim": {"steps": 1_000_000, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5},
        "data": {"source": "synthetic", "seq_len": 64, "batch_size": world, "microbatches": 1},
        "supervision": {"heartbeat_interval_s": INTERVAL_S, "heartbeat_timeout_s": TIMEOUT_S,
                        "hang_timeout_s": HANG_TIMEOUT_S, "hang_step_factor": HANG_STEP_FACTOR,
                        "restart_backoff_s": 0.0, "max_restarts": 1000},
    }


# --- one node's tick ----------------------------------------------------------------------------

def tick_commands(p: str, node: str, status: tuple, beats: list[str], deadline: float,
                  summary: NodeSummary, now: float) -> list[tuple]:
    """The commands of `Store.agent_tick` for one node (reset_ranks False, a deadline, a
    summary); `check_commands` holds them to agent_tick's own."""
    ranks = [x for lr, beat in enumerate(beats) for x in (str(lr), beat)]
    return [("ZADD", p + "agents", now, node),
            status,  # ("HSET", agent:<node>, field, text, ...): the same every tick
            ("HSET", f"{p}ranks:{node}", *ranks),
            ("ZADD", p + "beats", deadline, node),
            ("ZADD", p + "steps", summary.max_step, node),
            ("ZADD", p + "paused", summary.paused, node),
            ("ZADD", p + "oldest", summary.oldest_beat, node),
            ("ZADD", p + "minsteps", summary.min_step, node),
            ("ZADD", p + "outside", summary.outside, node),
            ("ZADD", p + "compute", summary.compute_s, node),
            ("SREM", p + "nonfinite", node),
            ("GET", p + "plan:stamp"),
            ("LPOP", f"{p}commands:{node}", 100),
            ("HEXISTS", p + "nodes", node),
            ("GET", p + "control")]


def status_command(p: str, node: str, i: int) -> tuple:
    """HSET agent:<node> with what the agent's `_tick` sends for a generation it runs."""
    pids = json.dumps([pid_of(i * RPN + lr) for lr in range(RPN)])
    return ("HSET", f"{p}agent:{node}", "generation", "0", "state", "running",
            "live_ranks", str(RPN), "host", f"host{i}", "pids", pids,
            "rank_states", json.dumps({"training": RPN}))


def pid_of(rank: int) -> int:
    return 1000 + rank % 4_000_000


def beat_head(rank: int, local_rank: int) -> str:
    return (f'{{"v": 1, "rank": {rank}, "local_rank": {local_rank}, "pid": {pid_of(rank)}, '
            '"generation": 0, ')


def beat_json(head: str, t: float, step: int, phase: str, since: float, compute_s: float,
              wait_s: float, seq: int) -> str:
    """json.dumps of a rank's heartbeat as the agent relays it (checked at start-up)."""
    return (f'{head}"time": {t!r}, "step": {step}, "phase": "{phase}", "phase_since": '
            f'{since!r}, "compute_s": {compute_s!r}, "wait_s": {wait_s!r}, "finite": true, '
            f'"seq": {seq}, "metrics": null, "received": {t + 0.0002!r}}}')


def check_commands(url: str, plan: dict) -> None:
    """Fail unless the simulator sends, byte for byte, what `Store.agent_tick` sends."""
    p, node, now = prefix(JOB), node_name(7), 1.7e9 + 0.123456
    beats = [beat_json(beat_head(7 * RPN + lr, lr), now - 0.3 - lr / 100, FIRST_STEP + 3,
                       "backward", now - 0.5, 0.85, 0.15, 99) for lr in range(RPN)]
    summary = NodeSummary(FIRST_STEP + 3, FIRST_STEP + 3, RPN, False, 0.85, 0,
                          now - 0.3 - (RPN - 1) / 100)
    status = {"generation": 0, "state": "running", "live_ranks": RPN, "host": "host7",
              "pids": [pid_of(7 * RPN + lr) for lr in range(RPN)],
              "rank_states": {"training": RPN}}
    recorded = redis.Redis().pipeline(transaction=False)  # never executed

    class Deferred:  # agent_tick's pipeline: queue into `recorded`, answer as Redis would
        def __getattr__(self, name):
            return getattr(recorded, name)

        def execute(self):
            return [None, None, 1, None]

    store = Store(url, JOB)
    store.r = mock.Mock(pipeline=lambda transaction=True: Deferred())
    with mock.patch.object(store_module, "time", mock.Mock(time=lambda: now)):
        store.agent_tick(node, status, {lr: json.loads(b) for lr, b in enumerate(beats)},
                         now - 0.3 - 0.11 + TIMEOUT_S, False, summary)
    theirs = [hiredis.pack_command(tuple(args)) for args, _ in recorded.command_stack]
    ours = [hiredis.pack_command(c) for c in tick_commands(
        p, node, status_command(p, node, 7), beats,
        now - 0.3 - 0.11 + TIMEOUT_S, summary, now)]
    if theirs != ours:
        diff = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
                    "count")
        raise SystemExit(f"Store.agent_tick no longer sends what this simulator sends (first "
                         f"difference: command {diff}); update tick_commands()")
    if tuple(json.loads(beats[0])) != BEAT_FIELDS:
        raise SystemExit("beat_json() lost a heartbeat field")


@dataclass(frozen=True)
class SimSpec:
    url: str
    nodes: int
    t0: float  # the clock every node's tick and every rank's step count from


class Agents:
    """Simulated agents of nodes lo..hi-1, in one process: each ticks once per interval, at
    its offset (node i at i / nodes of the interval)."""

    def __init__(self, spec: SimSpec, lo: int, hi: int, control, counters, w: int):
        self.spec, self.lo, self.hi = spec, lo, hi
        self.control, self.counters, self.w = control, counters, w
        self.p = prefix(JOB)
        self.status = [status_command(self.p, node_name(i), i)
                       for i in range(lo, hi)]
        ranks = range(lo * RPN, hi * RPN)
        self.heads = [beat_head(r, r % RPN) for r in ranks]
        self.offset = [(r * 0.6180339887) % 1.0 * INTERVAL_S for r in ranks]  # when it beats
        self.compute = [0.85 + (r * 7919 % 100) / 10_000 for r in ranks]
        # The agent's summary: the slowest rank's median compute time (each rank's is fixed).
        self.slowest = [max(self.compute[(i - lo) * RPN:(i - lo + 1) * RPN])
                        for i in range(lo, hi)]
        host, port = spec.url.split("//")[1].split("/")[0].split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()

    def run(self) -> None:
        c, n, spec = self.control, self.hi - self.lo, self.spec
        offset = [i / spec.nodes * INTERVAL_S for i in range(self.lo, self.hi)]
        last = [0.0] * n
        cycle, j = 0, 0
        while not c[QUIT]:
            stop = int(c[STOP])
            stall = (int(c[STALL_RANK]), int(c[STALL_STEP]), c[STALL_AT]) if c[STALL_AT] else None
            chunks, count, now = [], 0, time.time()
            while count < MAX_BATCH:
                due = spec.t0 + cycle * INTERVAL_S + offset[j]
                if due > now:
                    break
                i = self.lo + j
                if i == stop:
                    if not c[STOPPED_AT]:
                        c[STOPPED_AT] = last[j]
                else:
                    chunks += [hiredis.pack_command(x) for x in self.commands(i, now, stall)]
                    last[j] = now
                    count += 1
                    late = self.counters[2 * self.w + 1]
                    self.counters[2 * self.w + 1] = max(late, now - due)
                j += 1
                if j == n:
                    j, cycle = 0, cycle + 1
            if count:
                self.send(chunks)
                self.counters[2 * self.w] += count
            else:
                time.sleep(max(due - time.time(), 0.002))

    def commands(self, i: int, now: float, stall: tuple | None) -> list[tuple]:
        beats, times, steps, outside = [], [], [], 0
        base = (i - self.lo) * RPN
        for lr in range(RPN):
            k = base + lr
            off = self.offset[k]
            t = off + (now - off) // INTERVAL_S * INTERVAL_S  # the rank's latest heartbeat
            step, phase, since = self.rank_state(i * RPN + lr, t, stall)
            compute_s = self.compute[k]
            beats.append(beat_json(self.heads[k], t, step, phase, since, compute_s,
                                   round(1.0 - compute_s, 4), int((t - self.spec.t0) + 600)))
            times.append(t)
            steps.append(step)
            outside += phase != "grad_sync"
        summary = NodeSummary(max(steps), min(steps), outside, False, self.slowest[i - self.lo],
                              0, min(times))
        return tick_commands(self.p, node_name(i), self.status[i - self.lo], beats,
                             min(times) + TIMEOUT_S, summary, now)

    def rank_state(self, rank: int, t: float, stall: tuple | None) -> tuple[int, str, float]:
        """(step, phase, phase_since) of a rank at time t."""
        t0 = self.spec.t0
        if stall is not None and t >= stall[2]:
            culprit, at_step, at = stall
            if rank == culprit:
                return at_step, "backward", at
            stuck = t0 + (at_step + 1 - FIRST_STEP + GRAD_SYNC_AT) * STEP_S
            if t >= stuck:  # one step later, the others wait for it in a collective
                return at_step + 1, "grad_sync", stuck
        k, f = divmod(t - t0, STEP_S)
        start = 0.0
        for end, phase in PHASES:
            if f < end * STEP_S:
                return FIRST_STEP + int(k), phase, t0 + k * STEP_S + start * STEP_S
            start = end
        return FIRST_STEP + int(k), PHASES[-1][1], t0 + k * STEP_S + start * STEP_S

    def send(self, chunks: list[bytes]) -> None:
        self.sock.sendall(b"".join(chunks))
        got = 0
        while got < len(chunks):
            reply = self.reader.gets()
            if reply is False:
                data = self.sock.recv(1 << 20)
                if not data:
                    raise ConnectionError("Redis closed the connection")
                self.reader.feed(data)
            elif isinstance(reply, hiredis.ReplyError):
                raise reply
            else:
                got += 1


def simulate(spec: SimSpec, lo: int, hi: int, control, counters, w: int) -> None:
    Agents(spec, lo, hi, control, counters, w).run()


# --- the controller, driven and watched -------------------------------------------------------

@dataclass
class Result:
    ranks: int
    nodes: int
    rate: float = 0.0  # node ticks per second achieved
    late_s: float = 0.0  # the latest any tick ran
    loop: list[float] = field(default_factory=list)  # wall time of each controller tick
    loop_cpu: list[float] = field(default_factory=list)  # its CPU time (this process)
    errors: int = 0
    stale_s: float | None = None
    stale_how: str = ""
    stall_s: float | None = None
    stall_how: str = ""
    memory: int = 0
    cpu: dict[str, float] = field(default_factory=dict)  # % of one core, over the loop window
    false_alarms: list[str] = field(default_factory=list)
    scrape: list[float] = field(default_factory=list)  # wall time of each /metrics render
    scrape_bytes: int = 0

    @property
    def sustained(self) -> bool:
        return self.rate >= 0.99 * self.nodes / INTERVAL_S and self.late_s <= 0.25 * INTERVAL_S

    @property
    def loop_period(self) -> float:
        """How long after a condition becomes true the controller's event can land: the wait
        for the next tick (ticks start every TICK_S while one takes less) plus that tick's own
        time up to its event (p99). Back-to-back ticks (p99 > TICK_S): up to two ticks."""
        took = p99(self.loop)
        return min(TICK_S + took if took <= TICK_S else 2 * took, TARGET_LOOP_S)


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
            store.register_node(node, {"host": f"host{i}", "health": "ok", "devices": RPN})
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
        while (self.store.sweep([victim]).agent_beats.get(victim) or 0) < resumed:
            time.sleep(0.05)
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


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


# --- report -------------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(r: Result) -> None:
    need = r.nodes / INTERVAL_S
    print(f"  simulator: {r.rate:,.0f} node ticks/s of {need:,.0f} needed "
          f"({100 * r.rate / need:.1f}%), latest tick {1000 * r.late_s:.0f} ms behind "
          f"schedule: " + ("sustained 1 Hz per node" if r.sustained else "did NOT sustain 1 Hz "
                           "per node: the figures below do not describe a 1 Hz cluster"))
    if not r.loop:
        return
    top = max(r.loop)
    print(f"  controller loop: tick median {ms(statistics.median(r.loop))}, p99 "
          f"{ms(p99(r.loop))}, max {ms(top)} over {len(r.loop)} ticks (target <= "
          f"{TARGET_LOOP_S:g} s: {verdict(top <= TARGET_LOOP_S)}); CPU per tick median "
          f"{ms(statistics.median(r.loop_cpu))}, max {ms(max(r.loop_cpu))}"
          + (f"; {r.errors} tick(s) hit a Redis error" if r.errors else ""))
    limit = 2 * INTERVAL_S + r.loop_period
    if r.stale_s is None:
        print(f"  stale node: {r.stale_how} (target <= {limit:.2f} s: MISSED)")
    else:
        print(f"  stale node: decided {r.stale_s:.2f} s after its last tick (target <= 2 x "
              f"{INTERVAL_S:g} s + one loop {r.loop_period:.2f} s = {limit:.2f} s: "
              f"{verdict(r.stale_s <= limit)}); {r.stale_how[:160]}")
    bound = STEP_S + max(HANG_TIMEOUT_S, HANG_STEP_FACTOR * STEP_S) + 2 * INTERVAL_S \
        + r.loop_period
    if r.stall_s is None:
        print(f"  stalled rank: {r.stall_how[:300]}")
    else:
        print(f"  stalled rank: first event naming the culprit {r.stall_s:.2f} s after the "
              f"stall (no target; expected <= 1 step + threshold max({HANG_TIMEOUT_S:g}, "
              f"{HANG_STEP_FACTOR:g} x {STEP_S:g} s) + 2 intervals + one loop = {bound:.2f} s: "
              f"{'within' if r.stall_s <= bound else 'OVER'}); {r.stall_how[:160]}")
    print(f"  Redis: used_memory {r.memory / 2**20:,.1f} MiB; CPU {r.cpu['redis']:.1f}% of one "
          f"core (target <= {TARGET_REDIS_CPU:g}%: {verdict(r.cpu['redis'] <= TARGET_REDIS_CPU)})"
          f"; beside it, % of one core: controller process {r.cpu['controller']:.0f}, simulator "
          f"{r.cpu['simulator']:.0f}, other work on this machine {r.cpu['others']:.0f} "
          f"(of {100 * (os.cpu_count() or 1)})")
    if r.scrape:
        print(f"  exporter: /metrics ({r.scrape_bytes:,} bytes) computed from Redis in "
              f"{ms(statistics.median(r.scrape))} median, {ms(max(r.scrape))} max over "
              f"{len(r.scrape)} scrapes (no target; at a 15 s scrape interval that is "
              f"{100 * statistics.median(r.scrape) / 15:.1f}% of a core)")
    if r.false_alarms:
        print(f"  false alarms: {len(r.false_alarms)} decision(s) about healthy nodes (failures "
              f"undone), e.g. " + " | ".join(r.false_alarms[:2]))


def ms(seconds: float) -> str:
    return f"{1000 * seconds:,.0f} ms" if seconds >= 0.1 else f"{1000 * seconds:.1f} ms"


def table(results: list[Result]) -> None:
    print("\n| ranks | nodes | sim ticks/s (needed) | loop median / p99 / max | stale node | "
          "stalled rank | Redis memory | Redis CPU | /metrics median |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        stale = "-" if r.stale_s is None else f"{r.stale_s:.2f} s"
        stall = "-" if r.stall_s is None else f"{r.stall_s:.2f} s"
        loop = " / ".join(ms(f(r.loop)) for f in (statistics.median, p99, max)) if r.loop \
            else "-"
        print(f"| {r.ranks:,} | {r.nodes:,} | {r.rate:,.0f} ({r.nodes:,}) | {loop} | {stale} | "
              f"{stall} | {r.memory / 2**20:,.1f} MiB | {r.cpu.get('redis', 0):.1f}% | "
              f"{ms(statistics.median(r.scrape)) if r.scrape else '-'} |")


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
