"""The simulated fleet of bench/controller_scale.py: its settings (ranks per node, heartbeat
and hang timings, the phases of a step), the commands of one node's tick (`tick_commands`, held
byte for byte to `OwnRecords.agent_tick` by `check_commands`) and `Agents`, the agents of a slice of
the nodes in one worker process (`simulate`), each node ticking once per heartbeat interval.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from unittest import mock
from urllib.parse import unquote, urlsplit

import hiredis
import redis

import controller.store.own as own_module
from controller.store.own import row_text
from controller.store.store import Store, prefix
from controller.store.summaries import NodeSummary

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
MAX_BATCH = 64  # nodes in one pipeline
INFO_TOKEN = 1  # the record token of every simulated node's row (tick_commands)
# The control block shared with the workers (doubles).
STOP, STOPPED_AT, STALL_RANK, STALL_STEP, STALL_AT, QUIT = range(6)


def node_name(i: int) -> str:
    return f"node{i}"


# --- one node's tick ----------------------------------------------------------------------------

def tick_commands(p: str, node: str, status: tuple, beats: list[str], deadline: float,
                  summary: NodeSummary, now: float) -> list[tuple]:
    """The commands of `OwnRecords.agent_tick` for one node (reset_ranks False, a deadline, a
    summary), all under the node's own keys but the plan's stamp, its command list and the
    control word; `check_commands` holds them to agent_tick's own. The row's record token is
    INFO_TOKEN: the controller reads each node's record once, as after a registration."""
    ranks = [x for lr, beat in enumerate(beats) for x in (str(lr), beat)]
    row = row_text({"info": INFO_TOKEN, "beat": now, "deadline": deadline,
                    "max_step": summary.max_step, "min_step": summary.min_step,
                    "outside": summary.outside, "nonfinite": summary.nonfinite,
                    "compute_s": summary.compute_s, "paused": summary.paused,
                    "oldest": summary.oldest_beat, "seq": now})  # the simulator's one clock
    return [status,  # ("HSET", node:<node>:status, field, text, ...): the same every tick
            ("HSET", f"{p}node:{node}:ranks", *ranks),
            ("SET", f"{p}node:{node}:row", row),
            ("GET", p + "plan:stamp"),
            ("LPOP", f"{p}commands:{node}", 100),
            ("EXISTS", f"{p}node:{node}:info"),
            ("GET", p + "control"),
            ("GET", p + "gen:0:align")]  # the status says generation 0


def status_command(p: str, node: str, i: int) -> tuple:
    """HSET node:<node>:status with what the agent's `_tick` sends for a generation it runs."""
    pids = json.dumps([pid_of(i * RPN + lr) for lr in range(RPN)])
    return ("HSET", f"{p}node:{node}:status", "generation", "0", "state", "running",
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
    """Fail unless the simulator sends, byte for byte, what `OwnRecords.agent_tick` sends."""
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
            return [None, None, 1, None, None]

    store = Store(url, JOB)
    store.own.r = mock.Mock(pipeline=lambda transaction=True: Deferred())
    store.own._rows = {node: {"info": INFO_TOKEN}}  # as the simulator's rows carry it
    with mock.patch.object(own_module, "time", mock.Mock(time=lambda: now,
                                                         monotonic=lambda: now)):
        store.own.agent_tick(node, status, {lr: json.loads(b) for lr, b in enumerate(beats)},
                         now - 0.3 - 0.11 + TIMEOUT_S, False, summary)
    theirs = [hiredis.pack_command(tuple(args)) for args, _ in recorded.command_stack]
    ours = [hiredis.pack_command(c) for c in tick_commands(
        p, node, status_command(p, node, 7), beats,
        now - 0.3 - 0.11 + TIMEOUT_S, summary, now)]
    if theirs != ours:
        diff = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
                    "count")
        raise SystemExit(f"OwnRecords.agent_tick no longer sends what this simulator sends (first "
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
        url = urlsplit(spec.url)  # start_redis's: a password even on loopback
        self.sock = socket.create_connection((url.hostname, url.port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()
        if url.password:
            self.send([hiredis.pack_command(("AUTH", unquote(url.username or "default"),
                                             unquote(url.password)))])

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
