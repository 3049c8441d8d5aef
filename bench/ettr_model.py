"""The model behind bench/ettr.py: its inputs (`Inputs`, each with its source), the costs they
give at one scale (`Costs`), the checkpoint policies, and the discrete-event simulation of a run's
failures and recoveries (`simulate`, over many trials `run_trials`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from controller.common.probe import FAILS_NEEDED, PROBE_TIMEOUT_S

KINDS = ("kill_rank", "kill_node", "freeze_rank", "hang")
HOUR, DAY = 3600.0, 86400.0


def measured(value: float, source: str):
    return field(default=value, metadata={"measured": True, "source": source})


def assumed(value: float, source: str):
    return field(default=value, metadata={"measured": False, "source": source})


REC = ("bench/recovery.py --trials 3 --modes warm-memory-inprocess, 2026-11-28 05:01 "
       "(2-core VM)")
REC2 = ("bench/recovery.py --trials 3 --faults kill_node,kill_rank --modes "
        "warm-memory-inprocess, 2026-11-29 12:09, a lost node decided by the probe, the warm "
        "process past the ranks' first-use imports (2-core VM)")
REC3 = ("bench/recovery.py --trials 5 --faults kill_rank,kill_node --modes "
        "warm-memory-inprocess, 2026-11-30 08:45, the store's listener awaited, the next "
        "plan's health check ahead, a pulled point launched at once (2-core VM)")
REC4 = ("bench/recovery.py --trials 5 --faults kill_rank,kill_node --modes "
        "warm-memory,warm-memory-inprocess, 2026-11-30 11:54, both modes in one run (2-core VM)")
REC_COLD = "bench/recovery.py --trials 3, cold starts, 2026-11-23 21:59 (2-core VM)"
CKPT = "bench/checkpoint.py, process mode, bare-bytes storage, 2026-11-21 08:35 (2-core VM)"
SNAP = "bench/snapshot_overhead.py, 1 training thread, 2026-11-28 (2-core VM)"
SNAPSHOT_BYTES, SNAPSHOT_LOOP_S, SNAPSHOT_SLOWED_S = 80_306_401, 0.0019, 0.0
GROUPS = "bench/groups.py --trials 5, 2026-11-30 (2-core VM)"
SCALE = "bench/controller_scale.py --sizes ...,131072, 2026-11-21 11:40 (2-core VM)"


@dataclass(frozen=True)
class Inputs:
    # -- measured here (docs/benchmarks.md) --------------------------------------------------
    decision_kill_rank_s: float = measured(0.06, REC3)
    decision_freeze_rank_s: float = measured(3.06, REC)
    decision_kill_node_s: float = measured(1.45, REC3)
    recovery_timeout_s: float = measured(3.0, REC + ": heartbeat timeout of those runs")
    recovery_interval_s: float = measured(0.5, REC2 + ": heartbeat interval of those runs")
    recovery_grace_s: float = measured(1.0, REC + ": failure grace of those runs")
    next_step_warm_kill_rank_s: float = measured(0.91, REC3)
    next_step_warm_freeze_rank_s: float = measured(4.88, REC)
    next_step_warm_kill_node_s: float = measured(2.02, REC3)
    after_decision_process_kill_rank_s: float = measured(
        0.92, REC4 + ": ranks restarted as new processes (warm forks), decision to next step; "
                     "in process the same run: 0.88 s")
    after_decision_process_kill_node_s: float = measured(
        0.72, REC4 + ": as above; in process 0.73 s")
    next_step_cold_kill_rank_s: float = measured(5.26, REC_COLD)
    next_step_cold_freeze_rank_s: float = measured(9.80, REC_COLD)
    next_step_cold_kill_node_s: float = measured(7.97, REC_COLD)
    decision_hang_s: float = measured(2.77, SCALE + ": stalled rank, 131,072 ranks")
    hang_threshold_s: float = measured(2.0, SCALE + ": hang_timeout_s of that run")
    loop_p99_s: float = measured(0.227, SCALE + ": controller tick p99 at 131,072 ranks")
    save_bytes: float = measured(310_325_523, CKPT + ": bytes of one rank's save")
    save_blocked_s: float = measured(0.026, CKPT + ": last_blocked_s, median")
    save_slowed_s: float = measured(0.443, CKPT + ": steps slowed by the write, per save")
    save_commit_s: float = measured(0.094, CKPT + ": commit (hash, manifest, marker)")
    load_bytes_per_s: float = measured(1.386e9, CKPT + ": cold load with deep_verify")
    snapshot_bytes: float = measured(SNAPSHOT_BYTES, SNAP + ": bytes of one rank's snapshot")
    snapshot_loop_s: float = measured(
        SNAPSHOT_LOOP_S, SNAP + ": the loop's wait per snapshot (its references and the fence; "
                                "the copy, write and checksum run behind the next step)")
    snapshot_slowed_s: float = measured(
        SNAPSHOT_SLOWED_S, SNAP + ": the step's slow-down with one every step beyond that wait "
                                  "(measured below zero, within the noise: taken as 0)")
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
    heartbeat_interval_s: float = assumed(1.0, "the job's setting: the project's default")
    probe_timeout_s: float = assumed(
        PROBE_TIMEOUT_S, "the controller's (controller/common/probe.py): a lost host answers "
                         "nothing, so each probe of its silent agent waits this out")
    probe_fails: float = assumed(FAILS_NEEDED, "the controller's: failed probes in a row that "
                                               "make a silent node lost")
    controller_reaches_agents: float = assumed(
        1.0, "assumption: the controller may open the agents' snapshot server ports (Slurm, "
             "PBS; the Helm chart's agents.snapshotPort); 0 where a firewall keeps it out: "
             "a lost node is then judged at heartbeat_timeout_s")
    hang_timeout_s: float = assumed(600.0, "the job's setting: the project's default (the "
                                           "bound of a generation's first steps and of saves)")
    hang_floor_s: float = assumed(
        30.0, "the job's setting: the project's default (the adaptive bound's floor; a hang is "
              "assumed in steady training, past a generation's first hang_history steps)")
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
    rendezvous_floor_s: float = measured(
        0.10, GROUPS + ": 8 gloo ranks on one host, in process: the default group and the "
                       "layout's 5 groups made again; the rendezvous never costs less")
    rendezvous_s_per_1k_nodes: float = assumed(
        3.0, "published, scaled: Meta's NCCLX (Si et al., arXiv 2510.20171) starts its "
             "communicators 11x faster than stock NCCL's ~265 s at 96k GPUs (~24 s); linear "
             "in nodes, 33 s at 10,923 nodes (measured here only at 3 processes)")
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
    save_cost_s: float  # a disk save's cost to the loop: blocked + slowed steps
    commit_s: float  # a disk save's start to its commit
    replicate_s: float  # a snapshot's start to its copy on the buddy node
    snapshot_cost_s: float | None = None  # a memory snapshot's cost to the loop (None: a save's)

    @property
    def snapshot_s(self) -> float:
        return self.save_cost_s if self.snapshot_cost_s is None else self.snapshot_cost_s

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
    hang_threshold = max(i.hang_floor_s, i.hang_step_factor * step)  # detect.stall_threshold
    detect = {
        "kill_rank": i.decision_kill_rank_s + i.loop_p99_s,
        # A lost node (controller/control/detect.py): its agent silent for two beats and two
        # probes of its host unanswered (the measured decision, whose host refused at once,
        # with the job's beats and the probes' timeouts); else the heartbeat timeout.
        "kill_node": (i.decision_kill_node_s - 2 * i.recovery_interval_s
                      + 2 * i.heartbeat_interval_s + i.probe_fails * i.probe_timeout_s
                      if i.controller_reaches_agents else i.heartbeat_timeout_s + i.loop_p99_s),
        "freeze_rank": i.decision_freeze_rank_s - i.recovery_timeout_s + i.heartbeat_timeout_s,
        "hang": i.decision_hang_s - i.hang_threshold_s + hang_threshold,
    }
    rendezvous = max(i.rendezvous_s_per_1k_nodes * nodes / 1000, i.rendezvous_floor_s)
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
        replicate_s=local + shard * ranks_per_node / i.buddy_bytes_per_s,
        snapshot_cost_s=(i.snapshot_loop_s + i.snapshot_slowed_s) * shard / i.snapshot_bytes)


def memory_interval_steps(c: Costs, budget: float) -> int:
    """The most frequent snapshot, in whole steps, within the budget and the replication."""
    return max(1, math.ceil(c.snapshot_s / (budget * c.step_s)),
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
        + (c.snapshot_s / p.memory_s if p.memory_s else 0.0)
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
