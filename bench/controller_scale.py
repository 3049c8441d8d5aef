"""The controller at 1,024, 16,384 and 131,072 ranks: simulated agents beating into a real Redis.

Per size (nodes of 12 ranks: 86, 1,366 and 10,923 nodes; the world is nodes x 12), with
supervision heartbeat_interval_s 1 s, heartbeat_timeout_s 2 s, hang_timeout_s 2 s,
hang_step_factor 2:

1. loop: a real `Controller` (a validated job, `settings_for`) calling `tick()` at its own
   cadence (as `Controller.run`: TICK_S between starts) for --duration s while every node
   beats at 1 Hz; median, p99 and max tick time.
2. stale node: one node's ticks stop (its agent beat and its ranks' heartbeats); from its last
   tick to the controller's `failure` event naming it (or a "stop" plan naming it).
3. stalled rank: every rank steps once a second; one rank stops stepping while its heartbeats
   stay fresh (phase "backward", its old step), the others one step later (phase "grad_sync");
   from the stall to the first `suspect`/`failure` event naming the culprit. This needs the hang
   rule: "not available" when `Settings` has no hang_timeout_s.
4. Redis: `INFO memory` used_memory once the job beats; `INFO cpu` (sys + user) over the loop
   window, as % of one core. And the simulator's node ticks per second against the nodes: the
   figures mean something only where it sustains 1 Hz per node (printed either way).

Targets at 131,072 ranks: loop <= 1 s; a stale node decided within 2 heartbeat intervals + one
loop (the loop period measured at that size, p99, at most the 1 s target); Redis <= 50% of one
core. The stalled rank has no target; its expected bound is printed beside it.

How. A private redis-server on loopback per size (no persistence, `start_redis`). Every node
registers (`Store.register_node`); the job record and plan of generation 0 are written as the
controller writes them (every key of `_plan_next`'s plan: the node list, and a reason naming
every node). Then worker processes, each owning a slice of the nodes, tick every node once per
interval, the nodes' ticks spread evenly over the interval. A node's tick is the traffic of
`Store.agent_tick(node, status, beats, deadline, reset_ranks=False, summary=NodeSummary(...))`:
the status the agent's `_tick` sends (generation, state, live ranks, host, pids, and the plan it
runs), 12 rank heartbeats shaped as `optimus/health.py` sends them plus `received`, the deadline
min(beat time) + heartbeat_timeout_s, and the node summary.

Batched: each worker sends its due nodes' ticks (up to 64 nodes) as one pipeline on one raw
socket, parsing the replies with hiredis, instead of one redis-py pipeline per node: a
`Store.agent_tick` costs ~0.2 ms of client CPU, and 10,923 of them a second do not fit beside
Redis and the controller on two cores. Redis gets the same commands, each node's in its order
(only fewer round trips: its syscall work, hence its CPU, is a slight underestimate of 10,923
separate agents). At start-up the commands are checked byte for byte against those of
`Store.agent_tick` for the same inputs, so a change there stops the benchmark instead of
measuring other traffic.

    .venv/bin/python bench/controller_scale.py [--sizes 1024,16384,131072] [--duration 30]
        [--workers N] [--what-if slim-plan]

About duration + 25 s per size, more where the control plane falls behind (~2.5 minutes at
--duration 30 for the two small sizes; see the reply of the run for 131,072). `--what-if
slim-plan` is NOT the real traffic: each agent's status carries the plan without its node list
and reason, and each tick reads a ~200-byte plan stamp instead of the whole plan (what the
controller would face once the plan stops being echoed every tick).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing as mp
import os
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

import controller.store as store_module
from controller.controller import TICK_S, Controller, settings_for
from controller.decide import Settings
from controller.run import LocalCluster, start_redis
from controller.store import NodeSummary, Store, prefix
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
               "phase_since", "compute_s", "wait_s", "finite", "seq", "received")
TARGET_LOOP_S, TARGET_REDIS_CPU = 1.0, 50.0
MAX_BATCH = 64  # nodes in one pipeline
SETTLE_S = 5.0  # normal running before the stall (a fresh controller's step history)
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
                  summary: NodeSummary, now: float, plan_key: str = "plan") -> list[tuple]:
    """The commands of `Store.agent_tick` for one node (reset_ranks False, a deadline, a
    summary); `check_commands` holds them to agent_tick's own."""
    ranks = [x for lr, beat in enumerate(beats) for x in (str(lr), beat)]
    return [("ZADD", p + "agents", now, node),
            status,  # ("HSET", agent:<node>, field, text, ...): the same every tick
            ("HSET", f"{p}ranks:{node}", *ranks),
            ("ZADD", p + "beats", deadline, node),
            ("ZADD", p + "steps", summary.max_step, node),
            ("ZADD", p + "minsteps", summary.min_step, node),
            ("ZADD", p + "outside", summary.outside, node),
            ("ZADD", p + "compute", summary.compute_s, node),
            ("SREM", p + "nonfinite", node),
            ("GET", p + plan_key),
            ("LPOP", f"{p}commands:{node}", 100),
            ("HEXISTS", p + "nodes", node)]


def status_command(p: str, node: str, i: int, plan_text: str) -> tuple:
    """HSET agent:<node> with what the agent's `_tick` sends for a generation it runs."""
    pids = json.dumps([pid_of(i * RPN + lr) for lr in range(RPN)])
    return ("HSET", f"{p}agent:{node}", "generation", "0", "state", "running",
            "live_ranks", str(RPN), "host", f"host{i}", "pids", pids, "plan", plan_text)


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
            f'"seq": {seq}, "received": {t + 0.0002!r}}}')


def check_commands(url: str, plan: dict) -> None:
    """Fail unless the simulator sends, byte for byte, what `Store.agent_tick` sends."""
    p, node, now = prefix(JOB), node_name(7), 1.7e9 + 0.123456
    beats = [beat_json(beat_head(7 * RPN + lr, lr), now - 0.3 - lr / 100, FIRST_STEP + 3,
                       "backward", now - 0.5, 0.85, 0.15, 99) for lr in range(RPN)]
    summary = NodeSummary(FIRST_STEP + 3, FIRST_STEP + 3, RPN, False, 0.85)
    status = {"generation": 0, "state": "running", "live_ranks": RPN, "host": "host7",
              "pids": [pid_of(7 * RPN + lr) for lr in range(RPN)], "plan": plan}
    recorded = redis.Redis().pipeline(transaction=False)  # never executed

    class Deferred:  # agent_tick's pipeline: queue into `recorded`, answer as Redis would
        def __getattr__(self, name):
            return getattr(recorded, name)

        def execute(self):
            return [None, None, 1]

    store = Store(url, JOB)
    store.r = mock.Mock(pipeline=lambda transaction=True: Deferred())
    with mock.patch.object(store_module, "time", mock.Mock(time=lambda: now)):
        store.agent_tick(node, status, {lr: json.loads(b) for lr, b in enumerate(beats)},
                         now - 0.3 - 0.11 + TIMEOUT_S, False, summary)
    theirs = [hiredis.pack_command(tuple(args)) for args, _ in recorded.command_stack]
    ours = [hiredis.pack_command(c) for c in tick_commands(
        p, node, status_command(p, node, 7, json.dumps(plan)), beats,
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
    plan_text: str  # the plan as agents hold it (in their status)
    plan_key: str = "plan"  # what they read back each tick


class Agents:
    """Simulated agents of nodes lo..hi-1, in one process: each ticks once per interval, at
    its offset (node i at i / nodes of the interval)."""

    def __init__(self, spec: SimSpec, lo: int, hi: int, control, counters, w: int):
        self.spec, self.lo, self.hi = spec, lo, hi
        self.control, self.counters, self.w = control, counters, w
        self.p = prefix(JOB)
        self.status = [status_command(self.p, node_name(i), i, spec.plan_text)
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
        summary = NodeSummary(max(steps), min(steps), outside, False, self.slowest[i - self.lo])
        return tick_commands(self.p, node_name(i), self.status[i - self.lo], beats,
                             min(times) + TIMEOUT_S, summary, now, self.spec.plan_key)

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

class Driver:
    """The controller's loop as `Controller.run` runs it: tick, then sleep out TICK_S."""

    def __init__(self, store: Store, make):
        self.store, self.make = store, make
        self.ctl = make()
        self.times: list[float] = []
        self.errors = 0
        self.after = "-"

    def tick(self) -> list[dict]:
        """One controller pass; the events written since the last."""
        started = time.monotonic()
        state = self.ctl.tick()
        took = time.monotonic() - started
        self.times.append(took)
        self.errors += state is None
        events = self.store.events(count=100_000, after=self.after)
        if events:
            self.after = events[-1][0]
        time.sleep(max(TICK_S - took, 0.0))
        return [e for _, e in events]

    def fresh(self) -> None:
        """A new controller (no memory of the last), taking over the lease at once."""
        self.ctl.release()
        self.ctl = self.make()


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


@dataclass
class Result:
    ranks: int
    nodes: int
    rate: float = 0.0  # node ticks per second achieved
    late_s: float = 0.0  # the latest any tick ran
    loop: list[float] = field(default_factory=list)
    errors: int = 0
    stale_s: float | None = None
    stale_how: str = ""
    stall_s: float | None = None
    stall_how: str = ""
    memory: int = 0
    redis_cpu: float = 0.0
    controller_cpu: float = 0.0
    sim_cpu: float = 0.0
    false_alarms: list[str] = field(default_factory=list)

    @property
    def sustained(self) -> bool:
        return self.rate >= 0.99 * self.nodes / INTERVAL_S and self.late_s <= 0.25 * INTERVAL_S

    @property
    def loop_period(self) -> float:
        return min(max(TICK_S, p99(self.loop)), TARGET_LOOP_S)


def run_size(ranks: int, duration: float, workers: int, what_if: str | None) -> Result:
    nodes = math.ceil(ranks / RPN)
    world = nodes * RPN
    res = Result(ranks, nodes)
    (REPO / "runs").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=REPO / "runs"))
    cluster = LocalCluster(tmp)
    ctx = mp.get_context("fork")
    control = ctx.Array("d", 8, lock=False)
    control[STOP] = -1
    procs: list = []
    try:
        url = start_redis(cluster)
        store = Store(url, JOB)
        job = validate_job(bench_job(tmp / "run", world), world=world)
        settings = settings_for(job, str(tmp / "job.yaml"), [], nodes, RPN)
        node_names = [node_name(i) for i in range(nodes)]
        for i, node in enumerate(node_names):
            store.register_node(node, {"host": f"host{i}", "health": "ok", "devices": RPN})
        now = time.time()
        reason = f"generation 0 on {', '.join(node_names)} from scratch"
        plan = {**settings.launch, "generation": 0, "action": "run", "nodes": node_names,
                "ranks_per_node": RPN, "world_size": settings.world_size,
                "master_addr": "host0", "master_port": 0, "resume_step": None,
                "grace_s": settings.failure_grace_s,
                "heartbeat_timeout_s": settings.heartbeat_timeout_s,
                "startup_timeout_s": settings.startup_timeout_s, "reason": reason, "issued": now,
                "exits_from": store.last_exit_id()}
        record = {"state": "RUNNING", "reason": reason, "name": JOB, "nodes": nodes,
                  "ranks_per_node": RPN, "created": now, "restarts": 0, "generation": 0}

        def restore() -> None:
            """Undo a decision: generation 0 runs again on every node, nobody excluded."""
            for node in store.excluded():
                store.include(node)
            extra = tuple(k for k in store.job_record() if k not in record)
            store.update_job(record, delete=extra)
            store.set_plan(plan)

        restore()
        plan_text, plan_key = json.dumps(plan), "plan"
        check_commands(url, plan)
        if what_if == "slim-plan":
            plan_text = json.dumps({k: v for k, v in plan.items() if k not in ("nodes", "reason")})
            plan_key = "plan_stamp"
            store.r.set(store.k(plan_key), json.dumps(
                {k: plan[k] for k in ("generation", "action", "issued", "world_size")}))

        t0 = time.time() + 0.5
        spec = SimSpec(url, nodes, t0, plan_text, plan_key)
        workers = workers or max(1, min(4, math.ceil(nodes / 3000)))
        counters = ctx.Array("d", 2 * workers, lock=False)
        cuts = [nodes * w // workers for w in range(workers + 1)]
        procs = [ctx.Process(target=simulate, args=(spec, cuts[w], cuts[w + 1], control,
                                                    counters, w), daemon=True)
                 for w in range(workers)]
        for proc in procs:
            proc.start()
        time.sleep(max(t0 - time.time(), 0) + 2.5 * INTERVAL_S)  # every node beat twice
        driver = Driver(store, lambda: Controller(store, job, settings))

        def tick() -> list[dict]:
            if any(proc.exitcode is not None for proc in procs):
                raise SystemExit(f"a simulator worker died; see above ({ranks} ranks)")
            return driver.tick()

        def alarm(e: dict) -> None:
            res.false_alarms.append(f"{e['kind']}: {e['message'][:160]}")
            if e["kind"] == "failure":
                restore()

        # 1 and 4: the steady loop, Redis, the simulator's rate.
        print(f"  {nodes} nodes registered, job RUNNING, {workers} simulator worker(s); "
              f"measuring the loop for {duration:g} s", flush=True)
        info = store.r.info("cpu")
        redis0 = info["used_cpu_sys"] + info["used_cpu_user"]
        for w in range(workers):
            counters[2 * w + 1] = 0.0
        ticks0, ctl0 = sum(counters[0::2]), time.process_time()
        sim0 = sum(cpu_s(proc.pid) for proc in procs)
        started = time.monotonic()
        while time.monotonic() - started < duration:
            for e in tick():
                if e["kind"] in ("failure", "suspect"):
                    alarm(e)
        wall = time.monotonic() - started
        info = store.r.info("cpu")
        res.redis_cpu = 100 * (info["used_cpu_sys"] + info["used_cpu_user"] - redis0) / wall
        res.rate = (sum(counters[0::2]) - ticks0) / wall
        res.late_s = max(counters[1::2])
        res.controller_cpu = 100 * (time.process_time() - ctl0) / wall
        res.sim_cpu = 100 * (sum(cpu_s(proc.pid) for proc in procs) - sim0) / wall
        res.memory = store.r.info("memory")["used_memory"]
        res.loop, res.errors = list(driver.times), driver.errors

        # 2: a stale node.
        victim = node_name(nodes // 2)
        control[STOPPED_AT] = 0.0
        control[STOP] = nodes // 2
        deadline = time.monotonic() + WAIT_S
        while res.stale_s is None and time.monotonic() < deadline:
            for e in tick():
                if e["kind"] == "failure" and mentions(e, victim) and res.stale_s is None:
                    res.stale_s, res.stale_how = float(e["time"]), e["message"]
                elif e["kind"] in ("failure", "suspect"):
                    alarm(e)
            current = store.plan()
            if (res.stale_s is None and current and current["action"] == "stop"
                    and mentions({"message": current.get("reason", "")}, victim)):
                res.stale_s, res.stale_how = current["issued"], f"stop plan: {current['reason']}"
        if res.stale_s is not None:
            while not control[STOPPED_AT]:
                time.sleep(0.01)
            res.stale_s -= control[STOPPED_AT]
        control[STOP] = -1
        time.sleep(1.5 * INTERVAL_S)  # the victim beats again before anyone looks
        restore()
        driver.fresh()

        # 3: a stalled rank, its peers waiting for it in a collective.
        if not any(f.name == "hang_timeout_s" for f in dataclasses.fields(Settings)):
            res.stall_how = "not available: controller/decide.py has no hang rule yet"
            return res
        settle = time.monotonic()
        while time.monotonic() - settle < SETTLE_S:
            for e in tick():
                if e["kind"] in ("failure", "suspect"):
                    alarm(e)
        culprit_node = nodes // 3
        culprit = culprit_node * RPN + 5
        at = time.time()
        control[STALL_RANK], control[STALL_STEP] = culprit, FIRST_STEP + (at - t0) // STEP_S
        control[STALL_AT] = at
        deadline = time.monotonic() + WAIT_S
        while res.stall_s is None and time.monotonic() < deadline:
            for e in tick():
                if e["kind"] not in ("failure", "suspect"):
                    continue
                if mentions(e, node_name(culprit_node), culprit) and res.stall_s is None:
                    res.stall_s, res.stall_how = float(e["time"]) - at, e["message"]
                elif res.stall_s is None:
                    res.stall_how += f" [first, naming another: {e['kind']}: {e['message']}]"
        if res.stall_s is None:
            res.stall_how = f"no event named the culprit within {WAIT_S:g} s" + res.stall_how
        return res
    finally:
        control[QUIT] = 1
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        cluster.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


# --- report -------------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(r: Result) -> None:
    need = r.nodes / INTERVAL_S
    print(f"  simulator: {r.rate:,.0f} node ticks/s of {need:,.0f} needed "
          f"({100 * r.rate / need:.1f}%), latest tick {1000 * r.late_s:.0f} ms behind "
          f"schedule: " + ("sustained 1 Hz per node" if r.sustained else "did NOT sustain 1 Hz "
                           "per node: the figures below do not describe a 1 Hz cluster"))
    med, tail, top = statistics.median(r.loop), p99(r.loop), max(r.loop)
    print(f"  controller loop: tick median {1000 * med:.1f} ms, p99 {1000 * tail:.1f} ms, max "
          f"{1000 * top:.1f} ms over {len(r.loop)} ticks ({r.errors} hit a Redis error) "
          f"(target <= {TARGET_LOOP_S:g} s: {verdict(top <= TARGET_LOOP_S)})")
    limit = 2 * INTERVAL_S + r.loop_period
    if r.stale_s is None:
        print(f"  stale node: no decision within {WAIT_S:g} s (target <= {limit:.2f} s: MISSED)")
    else:
        print(f"  stale node: decided {r.stale_s:.2f} s after its last tick (target <= 2 x "
              f"{INTERVAL_S:g} s + one loop {r.loop_period:.2f} s = {limit:.2f} s: "
              f"{verdict(r.stale_s <= limit)}); {r.stale_how[:150]}")
    bound = STEP_S + max(HANG_TIMEOUT_S, HANG_STEP_FACTOR * STEP_S) + 2 * INTERVAL_S \
        + r.loop_period
    if r.stall_s is None:
        print(f"  stalled rank: {r.stall_how[:300]}")
    else:
        print(f"  stalled rank: first event naming the culprit {r.stall_s:.2f} s after the "
              f"stall (no target; expected <= 1 step + threshold max({HANG_TIMEOUT_S:g}, "
              f"{HANG_STEP_FACTOR:g} x {STEP_S:g} s) + 2 intervals + one loop = {bound:.2f} s: "
              f"{'within' if r.stall_s <= bound else 'OVER'}); {r.stall_how[:150]}")
    print(f"  Redis: used_memory {r.memory / 2**20:,.1f} MiB; CPU {r.redis_cpu:.1f}% of one core "
          f"(target <= {TARGET_REDIS_CPU:g}%: {verdict(r.redis_cpu <= TARGET_REDIS_CPU)}); "
          f"beside it: controller process {r.controller_cpu:.0f}%, simulator "
          f"{r.sim_cpu:.0f}% (2 cores = 200%)")
    if r.false_alarms:
        print(f"  false alarms ({len(r.false_alarms)}, decisions about healthy nodes; failures "
              f"undone): " + " | ".join(r.false_alarms[:3]))


def table(results: list[Result]) -> None:
    print("\n| ranks | nodes | sim ticks/s (needed) | loop median / p99 / max | stale node | "
          "stalled rank | Redis memory | Redis CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        stale = "none" if r.stale_s is None else f"{r.stale_s:.2f} s"
        stall = "n/a" if r.stall_s is None else f"{r.stall_s:.2f} s"
        print(f"| {r.ranks:,} | {r.nodes:,} | {r.rate:,.0f} ({r.nodes:,}) | "
              f"{1000 * statistics.median(r.loop):.0f} / {1000 * p99(r.loop):.0f} / "
              f"{1000 * max(r.loop):.0f} ms | {stale} | {stall} | "
              f"{r.memory / 2**20:,.1f} MiB | {r.redis_cpu:.1f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,16384,131072", help="ranks, comma-separated")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of loop timing")
    parser.add_argument("--workers", type=int, default=0, help="simulator processes (0: auto)")
    parser.add_argument("--what-if", choices=["slim-plan"], default=None,
                        help="NOT the real traffic: see the module docstring")
    args = parser.parse_args()
    if args.duration < 20:
        print(f"note: --duration {args.duration:g} is under the 20 s Redis CPU window asked for")
    print(f"heartbeat every {INTERVAL_S:g} s, timeout {TIMEOUT_S:g} s; hang_timeout_s "
          f"{HANG_TIMEOUT_S:g}, hang_step_factor {HANG_STEP_FACTOR:g}; ranks step every "
          f"{STEP_S:g} s; controller tick every {TICK_S:g} s; {os.cpu_count()} CPU(s)"
          + (f"; WHAT-IF {args.what_if}: not the real agents' traffic" if args.what_if else ""),
          flush=True)
    results = []
    for ranks in (int(s) for s in args.sizes.split(",")):
        print(f"\n== {ranks:,} ranks: {math.ceil(ranks / RPN):,} nodes x {RPN} ==", flush=True)
        began = time.monotonic()
        r = run_size(ranks, args.duration, args.workers, args.what_if)
        report(r)
        print(f"  ({time.monotonic() - began:.0f} s)", flush=True)
        results.append(r)
    table(results)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
