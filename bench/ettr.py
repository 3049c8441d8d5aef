"""Effective training time ratio (ETTR: productive time / wall time) of a 131,072-rank run over
30 days, simulated: disk-only checkpoints at several intervals against in-memory snapshots.

Nobody here has 131,072 ranks, so this is a discrete-event simulation whose inputs are what this
project measured on one machine (docs/benchmarks.md), scaled by stated assumptions. Every input
is a field of `Inputs` below with its source: "measured here" (the figure, its command, its
date) or "assumption" (the reasoning). `--inputs` prints them all.

Failures. A Poisson process in wall time, one per kind. The rate per rank is Llama 3's rate per
GPU (466 interruptions in 54 days on 16,384 H100s, Dubey et al. 2024, section 3.3.4), so the
job's rate grows linearly with its node count at 12 ranks a node: MTTF 166.9 min at 16,384
ranks, 20.9 min at 131,072. Kokolis et al. (Meta, "Revisiting Reliability in Large-Scale ML
Research Clusters", 2024) project 0.23 h (about 14 min) at 131,072 GPUs from another fleet;
`--mttf-min 14` runs that rate, and the output gives the memory snapshots' ETTR at it too.
Each failure kind maps to a fault this project measures (bench/recovery.py); the mix is in
`Inputs.mix_*`. A kill_node picks one node at random (it matters for the buddy copies).

Cost of a failure = detection (the measured decision, with the timeout moved to the job's
setting) + restart (the measured warm or cold restart on 3 processes + a rendezvous that grows
with the node count + a cold start's imports) + load of the recovery point (disk: the
checkpoint over the storage's bandwidth; memory: host to device, and a lost node's shard from
its buddy) + the work since the recovery point, which is simulated: training resumes at the
newest usable point, disk (committed `commit_s` after its save started) or memory (usable at
once for a dead or hung rank, whose host survives; after its replication for a lost node).
A second failure during a recovery starts the recovery over. Memory falls back to disk when a
node is lost while its buddy holds the only copy of its own shard: from the buddy's loss until
the next generation's first snapshot has been replicated (nodes pair up: 2i with 2i+1).
Checkpointing also costs steady time: each save or snapshot blocks the loop (staging) and
slows the steps while its background write runs, both measured here per byte.

The memory interval is the one the project would pick: the most frequent whole number of steps
whose snapshots cost <= 2% of the step time and can finish replicating in between; a disk
checkpoint every 60 min stays behind it. The check on the simulation: Young/Daly's optimum
disk interval sqrt(2 * MTTF * C) (C: the cost of one save) against the simulated ETTR at 1/4 to
4 times it.

    .venv/bin/python bench/ettr.py [--seed 0] [--days 30] [--ranks 131072] [--ranks-per-node 12]
        [--trials 10] [--mttf-min M] [--heartbeat-timeout 30] [--hang-timeout 600]
        [--measured FILE.json] [--inputs] [--markdown]

`--measured FILE.json` replaces measured figures: a JSON object whose keys are the names of the
`Inputs` fields marked "measured here", values in seconds or bytes as the field's name says:

    decision_kill_rank_s, decision_freeze_rank_s, decision_kill_node_s: injection to the
        controller's decision, median, warm starts (bench/recovery.py)
    recovery_timeout_s: the heartbeat timeout those decisions ran under
    recovery_grace_s: the failure grace they ran under (SIGTERM -> SIGKILL)
    next_step_{warm,cold}_{kill_rank,freeze_rank,kill_node}_s: injection to the next
        generation's first step, median
    decision_hang_s, hang_threshold_s: a stalled rank's stall to its decision, and the hang
        threshold it ran under (bench/controller_scale.py)
    loop_p99_s: the controller's tick at 131,072 ranks, p99 (bench/controller_scale.py)
    save_bytes, save_blocked_s, save_slowed_s, save_commit_s, load_bytes_per_s: one rank's save
        of save_bytes: time blocked, time the following steps slowed, commit; cold load
        bandwidth with deep_verify (bench/checkpoint.py)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

KINDS = ("kill_rank", "kill_node", "freeze_rank", "hang")
HOUR, DAY = 3600.0, 86400.0
TARGET = 0.95


def measured(value: float, source: str):
    return field(default=value, metadata={"measured": True, "source": source})


def assumed(value: float, source: str):
    return field(default=value, metadata={"measured": False, "source": source})


REC = "bench/recovery.py --trials 3, warm starts, 2026-11-23 21:59 (2-core VM)"
CKPT = "bench/checkpoint.py, process mode, bare-bytes storage, 2026-11-21 08:35 (2-core VM)"
SCALE = "bench/controller_scale.py --sizes ...,131072, 2026-11-21 11:40 (2-core VM)"


@dataclass(frozen=True)
class Inputs:
    # -- measured here (docs/benchmarks.md) --------------------------------------------------
    decision_kill_rank_s: float = measured(0.29, REC)
    decision_freeze_rank_s: float = measured(3.06, REC)
    decision_kill_node_s: float = measured(2.58, REC)
    recovery_timeout_s: float = measured(3.0, REC + ": heartbeat timeout of those runs")
    recovery_grace_s: float = measured(1.0, REC + ": failure grace of those runs")
    next_step_warm_kill_rank_s: float = measured(3.52, REC)
    next_step_warm_freeze_rank_s: float = measured(6.29, REC)
    next_step_warm_kill_node_s: float = measured(4.57, REC)
    next_step_cold_kill_rank_s: float = measured(5.26, REC.replace("warm", "cold"))
    next_step_cold_freeze_rank_s: float = measured(9.80, REC.replace("warm", "cold"))
    next_step_cold_kill_node_s: float = measured(7.97, REC.replace("warm", "cold"))
    decision_hang_s: float = measured(2.77, SCALE + ": stalled rank, 131,072 ranks")
    hang_threshold_s: float = measured(2.0, SCALE + ": hang_timeout_s of that run")
    loop_p99_s: float = measured(0.227, SCALE + ": controller tick p99 at 131,072 ranks")
    save_bytes: float = measured(310_325_523, CKPT + ": bytes of one rank's save")
    save_blocked_s: float = measured(0.026, CKPT + ": last_blocked_s, median")
    save_slowed_s: float = measured(0.443, CKPT + ": steps slowed by the write, per save")
    save_commit_s: float = measured(0.094, CKPT + ": commit (hash, manifest, marker)")
    load_bytes_per_s: float = measured(1.386e9, CKPT + ": cold load with deep_verify")
    # -- failures --------------------------------------------------------------------------
    llama3_interruptions: float = assumed(
        466, "published: Llama 3 (Dubey et al. 2024, 3.3.4), 54 days on 16,384 GPUs, 419 "
             "unexpected (78% hardware) + 47 planned; all 466 counted as failures")
    llama3_days: float = assumed(54, "published: Llama 3, as above")
    llama3_gpus: float = assumed(16384, "published: Llama 3, as above")
    mix_kill_rank: float = assumed(
        0.65, "assumption: GPU faults (faulty GPU, HBM3, SRAM, GPU system processor, thermal, "
              "SDC: ~59% of Llama 3's unexpected interruptions) and software bugs (~13%) end a "
              "rank's process while its host lives; planned interruptions counted here too "
              "(conservative: checkpoint-now would save first)")
    mix_kill_node: float = assumed(
        0.25, "assumption: host and network faults (switch/cable, host maintenance, NIC, "
              "SSD, PSU, chassis, CPU, DRAM: ~22% of Llama 3's), rounded up: the kind that "
              "loses host memory")
    mix_freeze_rank: float = assumed(
        0.05, "assumption: a rank's process stops (its heartbeats stop): half of the hangs")
    mix_hang: float = assumed(
        0.05, "assumption: a collective hangs while heartbeats stay fresh (Llama 3: NCCL "
              "watchdog timeouts 1.7%, plus GPU faults that hang rather than exit)")
    # -- job settings ----------------------------------------------------------------------
    heartbeat_timeout_s: float = assumed(30.0, "the job's setting: the project's default")
    hang_timeout_s: float = assumed(600.0, "the job's setting: the project's default")
    hang_step_factor: float = assumed(10.0, "the job's setting: the project's default")
    failure_grace_s: float = assumed(3.0, "the job's setting: the project's default")
    snapshot_budget: float = assumed(0.02, "the issue: snapshots as often as cost <= 2% step")
    disk_behind_memory_min: float = assumed(60, "the issue: disk every 60 min behind memory")
    # -- the model and the machine at scale --------------------------------------------------
    params: float = assumed(1e12, "assumption: a 1T dense model, the size 131k ranks train")
    state_bytes_per_param: float = assumed(
        12, "measured here: fp32 weights + AdamW exp_avg + exp_avg_sq, as saved")
    tokens_per_step: float = assumed(16.8e6, "assumption: Llama 3 405B's final batch, 16M")
    tflops_per_rank: float = assumed(
        100, "assumption: achieved bf16 TFLOP/s per rank (a Max 1550 tile or a quarter of "
             "an H100's 400 in Llama 3); step = 6 * params * tokens / (ranks * this)")
    staging_bytes_per_s: float = assumed(
        11.9e9, "measured here on the CPU (save_bytes / save_blocked_s); assumed the same "
                "for a device-to-host copy (PCIe 4/5: 16-32 GB/s per device)")
    storage_write_bytes_per_s: float = assumed(
        2e12, "published: Llama 3's Tectonic storage, 2 TB/s sustained (7 TB/s peak); "
              "assumed no faster at 131k ranks")
    storage_read_bytes_per_s: float = assumed(2e12, "as storage_write_bytes_per_s")
    buddy_bytes_per_s: float = assumed(
        2.5e9, "assumption: one TCP stream between two nodes, ~20 Gb/s of a 200 Gb/s NIC")
    rendezvous_s_per_1k_nodes: float = assumed(
        3.0, "assumption: rendezvous and communicator setup grow linearly with nodes; "
             "33 s at 10,923 nodes (measured here only at 3 processes)")
    cold_import_s_per_1k_nodes: float = assumed(
        5.0, "assumption: a cold start imports torch and the trainer from a shared file "
             "system, metadata load linear in nodes: 55 s at 10,923 nodes")


def load_measured(inputs: Inputs, path: Path) -> Inputs:
    """`inputs` with the measured figures in the JSON file at `path` (keys: field names)."""
    known = {f.name for f in fields(Inputs) if f.metadata["measured"]}
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise SystemExit(f"--measured {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"--measured {path}: not JSON ({e}); expected an object such as "
                         '{"decision_kill_rank_s": 0.3}') from None
    if not isinstance(data, dict):
        raise SystemExit(f"--measured {path}: expected a JSON object of figures, got "
                         f"{type(data).__name__}")
    unknown = sorted(set(data) - known)
    if unknown:
        raise SystemExit(f"--measured {path}: unknown key(s) {', '.join(unknown)}; the known "
                         f"keys are {', '.join(sorted(known))}")
    bad = [k for k, v in data.items()
           if isinstance(v, bool) or not isinstance(v, int | float) or v < 0]
    if bad:
        raise SystemExit(f"--measured {path}: {', '.join(bad)} must be numbers >= 0")
    return replace(inputs, **{k: float(v) for k, v in data.items()})


@dataclass(frozen=True)
class Costs:
    """What the simulation charges, derived from `Inputs` at one scale."""

    nodes: int
    rate_per_s: dict[str, float]  # failures per wall second, per kind
    step_s: float
    state_bytes: float
    shard_bytes: float  # one rank's share of the training state
    detect_s: dict[str, float]
    restart_s: dict[tuple[str, str], float]  # (kind, "warm" | "cold")
    load_disk_s: float
    load_memory_s: dict[str, float]
    save_cost_s: float  # a save's or snapshot's cost to the loop: blocked + slowed steps
    commit_s: float  # a disk save's start to its commit
    replicate_s: float  # a snapshot's start to its copy on the buddy node

    @property
    def mttf_s(self) -> float:
        return 1.0 / sum(self.rate_per_s.values())


def costs(i: Inputs, ranks: int, ranks_per_node: int, mttf_min: float | None = None) -> Costs:
    nodes = math.ceil(ranks / ranks_per_node)
    per_rank = i.llama3_interruptions / (i.llama3_days * DAY) / i.llama3_gpus
    total = 1.0 / (mttf_min * 60.0) if mttf_min else per_rank * ranks
    mix = {k: getattr(i, f"mix_{k}") for k in KINDS}
    rate = {k: total * share / sum(mix.values()) for k, share in mix.items()}
    step = 6.0 * i.params * i.tokens_per_step / (ranks * i.tflops_per_rank * 1e12)
    state = i.params * i.state_bytes_per_param
    shard = state / ranks
    per_byte = shard / i.save_bytes
    hang_threshold = max(i.hang_timeout_s, i.hang_step_factor * step)
    detect = {
        "kill_rank": i.decision_kill_rank_s + i.loop_p99_s,
        "kill_node": i.decision_kill_node_s - i.recovery_timeout_s + i.heartbeat_timeout_s,
        "freeze_rank": i.decision_freeze_rank_s - i.recovery_timeout_s + i.heartbeat_timeout_s,
        "hang": i.decision_hang_s - i.hang_threshold_s + hang_threshold,
    }
    rendezvous = i.rendezvous_s_per_1k_nodes * nodes / 1000
    restart = {}
    for start in ("warm", "cold"):
        for kind in KINDS:
            measured_kind = "freeze_rank" if kind == "hang" else kind  # both stop by the grace
            base = (getattr(i, f"next_step_{start}_{measured_kind}_s")
                    - getattr(i, f"decision_{measured_kind}_s"))
            grace = i.failure_grace_s - i.recovery_grace_s if measured_kind == "freeze_rank" else 0
            cold = i.cold_import_s_per_1k_nodes * nodes / 1000 if start == "cold" else 0.0
            restart[kind, start] = base + grace + rendezvous + cold
    verify = shard / i.load_bytes_per_s
    local = shard / i.staging_bytes_per_s
    return Costs(
        nodes=nodes, rate_per_s=rate, step_s=step, state_bytes=state, shard_bytes=shard,
        detect_s=detect, restart_s=restart,
        load_disk_s=max(state / i.storage_read_bytes_per_s, verify),
        load_memory_s={k: local + (shard * ranks_per_node / i.buddy_bytes_per_s
                                   if k == "kill_node" else 0.0) for k in KINDS},
        save_cost_s=shard / i.staging_bytes_per_s + i.save_slowed_s * per_byte,
        commit_s=state / i.storage_write_bytes_per_s + i.save_commit_s * per_byte,
        replicate_s=local + shard * ranks_per_node / i.buddy_bytes_per_s)


def memory_interval_steps(c: Costs, budget: float) -> int:
    """The most frequent snapshot, in whole steps, within the budget and the replication."""
    return max(1, math.ceil(c.save_cost_s / (budget * c.step_s)),
               math.ceil(c.replicate_s / c.step_s))


def young_daly_s(c: Costs) -> float:
    """sqrt(2 * MTTF * C), never shorter than a save takes to commit (saves do not overlap)."""
    return max(math.sqrt(2.0 * c.mttf_s * c.save_cost_s), c.commit_s)


@dataclass(frozen=True)
class Policy:
    name: str
    disk_s: float | None  # progress seconds between disk saves (saves at multiples of it)
    memory_s: float | None = None  # progress seconds between memory snapshots
    start: str = "warm"


@dataclass(frozen=True)
class Failures:
    times: np.ndarray  # wall seconds, sorted
    kinds: np.ndarray  # index into KINDS
    nodes: np.ndarray  # the node a kill_node takes


def draw_failures(c: Costs, horizon_s: float, rng: np.random.Generator) -> Failures:
    """A Poisson process per kind: their sum's count, uniform times, kinds by their rates."""
    rates = np.array([c.rate_per_s[k] for k in KINDS])
    n = rng.poisson(rates.sum() * horizon_s)
    return Failures(np.sort(rng.uniform(0.0, horizon_s, n)),
                    rng.choice(len(KINDS), n, p=rates / rates.sum()),
                    rng.integers(0, c.nodes, n))


def fixed_failures(times: list[float], kind: str = "kill_rank",
                   nodes: list[int] | None = None) -> Failures:
    """Failures at given wall times, all of one kind (on the given nodes, else node 0)."""
    return Failures(np.asarray(times, float), np.full(len(times), KINDS.index(kind)),
                    np.asarray(nodes if nodes is not None else [0] * len(times), int))


@dataclass
class Outcome:
    ettr: float = 0.0
    failures: int = 0
    lost_s: float = 0.0  # wall time of the work rolled back
    down_s: float = 0.0  # wall time not training: detection, restart, load
    overhead: float = 0.0  # share of the training time spent on checkpoints
    memory_restores: int = 0
    disk_restores: int = 0
    fallbacks: int = 0  # memory configured, but a node and its buddy lost: disk instead


def _newest(every: float | None, pf: float, p0: float, w0: float, f: float, t: float,
            ready_s: float, before: float | None) -> float | None:
    """The newest point (progress) of one kind usable at wall time `t`: taken at a multiple of
    `every` after the segment began (w0, p0) and ready `ready_s` later, or else `before`."""
    if not every:
        return before
    q = math.floor(pf / every + 1e-9) * every
    while q > p0 + 1e-9:
        if w0 + (q - p0) * f + ready_s <= t:
            return q
        q -= every
    return before


def simulate(c: Costs, p: Policy, failures: Failures, horizon_s: float) -> Outcome:
    """Wall time runs through training segments and recoveries; progress (productive seconds)
    grows at 1/f during a segment, f = 1 + checkpoint costs per progress second."""
    f = 1.0 + (c.save_cost_s / p.disk_s if p.disk_s else 0.0) \
        + (c.save_cost_s / p.memory_s if p.memory_s else 0.0)
    w0 = p0 = 0.0  # the running segment: training (re)started at wall w0 from progress p0
    disk0, mem0 = 0.0, None  # newest disk / memory point at or before p0
    windows: dict[int, float] = {}  # node -> wall time its shard has a copy on its buddy again
    out, train = Outcome(), 0.0
    for t, k, node in zip(failures.times, failures.kinds, failures.nodes, strict=True):
        if t >= horizon_s:
            break
        kind = KINDS[k]
        train += max(0.0, t - w0)
        pf = p0 + max(0.0, t - w0) / f
        disk = _newest(p.disk_s, pf, p0, w0, f, t, c.commit_s, disk0)
        ready = c.replicate_s if kind == "kill_node" else 0.0
        mem = _newest(p.memory_s, pf, p0, w0, f, t, ready, mem0)
        if p.memory_s:
            snap = math.floor(p0 / p.memory_s + 1e-9) * p.memory_s + p.memory_s
            closes = w0 + (snap - p0) * f + c.replicate_s
            windows = {n: w if w < math.inf else closes for n, w in windows.items()}
            windows = {n: math.inf for n, w in windows.items() if w > t}  # still open
            if kind == "kill_node":
                if (node ^ 1) in windows and mem is not None and mem >= disk:
                    mem = None
                    out.fallbacks += 1
                windows[int(node)] = math.inf
        from_memory = mem is not None and mem >= disk
        r = mem if from_memory else disk
        out.memory_restores += from_memory
        out.disk_restores += not from_memory
        out.lost_s += (pf - r) * f
        out.failures += 1
        load = c.load_memory_s[kind] if from_memory else c.load_disk_s
        w0, p0 = t + c.detect_s[kind] + c.restart_s[kind, p.start] + load, r
        disk0, mem0 = disk, (r if from_memory else None)
    train += max(0.0, horizon_s - w0)
    progress = p0 + max(0.0, horizon_s - w0) / f
    out.ettr = progress / horizon_s
    out.down_s = horizon_s - train
    out.overhead = 1.0 - 1.0 / f
    return out


def policies(c: Costs, i: Inputs) -> list[Policy]:
    mem_steps = memory_interval_steps(c, i.snapshot_budget)
    behind = i.disk_behind_memory_min * 60.0
    rows = [Policy(f"disk every {m} min", m * 60.0) for m in (10, 30, 60, 120)]
    rows.append(Policy("disk, Young/Daly", young_daly_s(c)))
    rows.append(Policy(f"memory every {mem_steps} step(s) + disk {i.disk_behind_memory_min:g}"
                       f" min", behind, mem_steps * c.step_s))
    rows.append(Policy("  same, cold restarts", behind, mem_steps * c.step_s, "cold"))
    return rows


def run_trials(c: Costs, ps: list[Policy], days: float, trials: int,
               seed: int) -> dict[str, list[Outcome]]:
    """Every policy meets the same failures in each trial (common random numbers)."""
    horizon = days * DAY
    results: dict[str, list[Outcome]] = {p.name: [] for p in ps}
    for trial in range(trials):
        fails = draw_failures(c, horizon, np.random.default_rng([seed, trial]))
        for p in ps:
            results[p.name].append(simulate(c, p, fails, horizon))
    return results


def _minutes(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


def describe(c: Costs, i: Inputs, ranks: int, rpn: int, days: float, trials: int) -> list[str]:
    mix = ", ".join(f"{k} {getattr(i, 'mix_' + k):.0%}" for k in KINDS)
    return [
        f"{ranks:,} ranks on {c.nodes:,} nodes of {rpn}, {days:g} days, {trials} trial(s); "
        f"failures every {c.mttf_s / 60:.1f} min on average ({mix})",
        f"model {i.params / 1e12:g}T params, {c.state_bytes / 1e12:.1f} TB of training state "
        f"({c.shard_bytes / 1e6:.1f} MB a rank); step {c.step_s:.2f} s",
        "detection: " + ", ".join(f"{k} {c.detect_s[k]:.1f} s" for k in KINDS),
        "restart (warm / cold): " + ", ".join(
            f"{k} {c.restart_s[k, 'warm']:.1f} / {c.restart_s[k, 'cold']:.1f} s" for k in KINDS),
        f"load: disk {c.load_disk_s:.1f} s, memory {c.load_memory_s['kill_rank']:.3f} s "
        f"(a lost node's shard from its buddy {c.load_memory_s['kill_node']:.2f} s)",
        f"a save or snapshot costs the loop {c.save_cost_s:.3f} s "
        f"({c.save_cost_s / c.step_s:.1%} of a step); a disk save commits after "
        f"{c.commit_s:.1f} s, a snapshot is on the buddy after {c.replicate_s:.2f} s",
    ]


def rows(c: Costs, ps: list[Policy], results: dict[str, list[Outcome]]) -> list[list[str]]:
    out = []
    for p in ps:
        rs = results[p.name]
        e = [r.ettr for r in rs]
        n = sum(r.failures for r in rs)
        spread = statistics.stdev(e) if len(e) > 1 else 0.0
        write = c.state_bytes / (p.disk_s * (1 + rs[0].overhead)) / 1e9 if p.disk_s else 0.0
        out.append([p.name, _minutes(p.disk_s) if p.disk_s else "-",
                    _minutes(p.memory_s) if p.memory_s else "-",
                    f"{statistics.mean(e):.1%} ± {spread:.1%}", f"{min(e):.1%}",
                    f"{n / len(rs):.0f}",
                    f"{sum(r.down_s for r in rs) / max(n, 1):.0f} s",
                    f"{sum(r.lost_s for r in rs) / max(n, 1):.0f} s",
                    f"{rs[0].overhead:.2%}", f"{sum(r.fallbacks for r in rs)}",
                    f"{write:.0f}"])
    return out


HEAD = ("checkpoints", "disk every", "memory every", "ETTR mean ± sd", "min", "failures",
        "down per failure", "lost per failure", "checkpoint overhead", "fallbacks to disk",
        "storage write GB/s")


def show(table_rows: list[list[str]], head: tuple[str, ...], title: str, markdown: bool,
         console: Console) -> None:
    if markdown:
        console.print(f"\n{title}\n", markup=False)
        console.print("| " + " | ".join(head) + " |", markup=False)
        console.print("|" + "---|" * len(head), markup=False)
        for r in table_rows:
            console.print("| " + " | ".join(r) + " |", markup=False, soft_wrap=True)
        return
    table = Table(title=title)
    for h in head:
        table.add_column(h, justify="left" if h == head[0] else "right")
    for r in table_rows:
        table.add_row(*r)
    console.print(table)


def show_inputs(i: Inputs, markdown: bool, console: Console) -> None:
    show([[f.name, f"{getattr(i, f.name):g}",
           ("measured here: " if f.metadata["measured"] else "") + f.metadata["source"]]
          for f in fields(Inputs)], ("input", "value", "source"), "Inputs (bench/ettr.py)",
         markdown, console)


# Variants of the memory-snapshot policy: (label, Inputs changes, MTTF in minutes or None).
WHAT_IF = [
    ("as configured above", {}, None),
    ("MTTF 14 min (Kokolis et al.)", {}, 14.0),
    ("hang_timeout_s 60", {"hang_timeout_s": 60.0}, None),
    ("+ heartbeat_timeout_s 10", {"hang_timeout_s": 60.0, "heartbeat_timeout_s": 10.0}, None),
    ("+ snapshots cost only their copy", {"hang_timeout_s": 60.0, "heartbeat_timeout_s": 10.0,
                                          "save_slowed_s": 0.0}, None),
    ("+ rendezvous 1 s per 1,000 nodes", {"hang_timeout_s": 60.0, "heartbeat_timeout_s": 10.0,
                                          "save_slowed_s": 0.0,
                                          "rendezvous_s_per_1k_nodes": 1.0}, None),
]


def expected_fallbacks(c: Costs, p: Policy, days: float) -> float:
    """Node losses in the run x the chance that the lost node's buddy is lost within its window
    (detection, restart, the first snapshot and its replication): the first order term."""
    rate = c.rate_per_s["kill_node"]
    window = (c.detect_s["kill_node"] + c.restart_s["kill_node", p.start]
              + c.load_memory_s["kill_node"] + (p.memory_s or 0.0) + c.replicate_s)
    return rate * days * DAY * rate * window / c.nodes


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--ranks", type=int, default=131_072)
    parser.add_argument("--ranks-per-node", type=int, default=12)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--mttf-min", type=float, default=None,
                        help="mean time to failure of the whole job instead of Llama 3's rate")
    parser.add_argument("--heartbeat-timeout", type=float, default=None)
    parser.add_argument("--hang-timeout", type=float, default=None)
    parser.add_argument("--measured", type=Path, default=None, help="JSON of measured figures")
    parser.add_argument("--inputs", action="store_true", help="print every input and its source")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    for name in ("days", "ranks", "ranks_per_node", "trials", "mttf_min", "heartbeat_timeout",
                 "hang_timeout"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {value:g}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    console = Console(width=200 if args.markdown else max(Console().width, 150))
    i = Inputs()
    if args.measured:
        i = load_measured(i, args.measured)
    if args.heartbeat_timeout:
        i = replace(i, heartbeat_timeout_s=args.heartbeat_timeout)
    if args.hang_timeout:
        i = replace(i, hang_timeout_s=args.hang_timeout)
    if args.inputs:
        show_inputs(i, args.markdown, console)
    c = costs(i, args.ranks, args.ranks_per_node, args.mttf_min)
    for line in describe(c, i, args.ranks, args.ranks_per_node, args.days, args.trials):
        console.print(line, markup=False)
    ps = policies(c, i)
    results = run_trials(c, ps, args.days, args.trials, args.seed)
    show(rows(c, ps, results), HEAD, "ETTR by checkpoint policy", args.markdown, console)

    yd = young_daly_s(c)
    sweep = [Policy(f"disk every {k:g} x Young/Daly", max(yd * k, c.commit_s))
             for k in (0.25, 0.5, 1, 2, 4)]
    swept = run_trials(c, sweep, args.days, args.trials, args.seed)
    best = max(sweep, key=lambda p: statistics.mean(r.ettr for r in swept[p.name]))
    show([[p.name, _minutes(p.disk_s), f"{statistics.mean(r.ettr for r in swept[p.name]):.2%}"]
          for p in sweep], ("disk only", "interval", "ETTR mean"),
         f"Check: Young/Daly sqrt(2 x MTTF {c.mttf_s / 60:.1f} min x C {c.save_cost_s:.3f} s)"
         f" = {_minutes(yd)}", args.markdown, console)
    console.print(f"simulated best of the sweep: {best.name} ({_minutes(best.disk_s)})",
                  markup=False)

    memory = next(p for p in ps if p.memory_s and p.start == "warm")
    outcomes = {}
    for label, changes, mttf in WHAT_IF:
        vi = replace(i, **changes)
        vc = costs(vi, args.ranks, args.ranks_per_node, mttf or args.mttf_min)
        vp = Policy(label, vi.disk_behind_memory_min * 60.0,
                    memory_interval_steps(vc, vi.snapshot_budget) * vc.step_s)
        rs = run_trials(vc, [vp], args.days, args.trials, args.seed)[label]
        outcomes[label] = (vc, rs)
    show([[label, f"{vc.mttf_s / 60:.1f} min", f"{statistics.mean(r.ettr for r in rs):.1%}",
           f"{sum(r.down_s for r in rs) / sum(r.failures for r in rs):.0f} s",
           f"{rs[0].overhead:.2%}"] for label, (vc, rs) in outcomes.items()],
         ("memory snapshots + disk, warm restarts", "MTTF", "ETTR mean", "down per failure",
          "checkpoint overhead"), "What it takes (each row changes the inputs as it says)",
         args.markdown, console)
    ettr = statistics.mean(r.ettr for r in results[memory.name])
    ettr14 = statistics.mean(r.ettr for r in outcomes[WHAT_IF[1][0]][1])
    budget = (1 - TARGET - results[memory.name][0].overhead) * c.mttf_s
    console.print(
        f"buddy copies: {expected_fallbacks(c, memory, args.days):.1e} fallbacks to disk "
        f"expected per run (node losses x the chance the buddy is lost within the window)",
        markup=False, soft_wrap=True)
    console.print(
        f"target: ETTR >= {TARGET:.0%} with memory snapshots at {args.ranks:,} ranks: "
        f"{ettr:.1%}, {'met' if ettr >= TARGET else 'MISSED'} (MTTF {c.mttf_s / 60:.1f} min);"
        f" at MTTF 14 min: {ettr14:.1%}, {'met' if ettr14 >= TARGET else 'MISSED'}. "
        f"Meeting it at MTTF {c.mttf_s / 60:.1f} min leaves {budget:.0f} s per failure for "
        f"detection, restart, load and lost work.", markup=False, soft_wrap=True)

if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
