"""Effective training time ratio (ETTR: productive time / wall time) of a 131,072-rank run over
30 days, simulated: disk-only checkpoints at several intervals against in-memory snapshots.

Nobody here has 131,072 ranks, so this is a discrete-event simulation whose inputs are what this
project measured on one machine (docs/benchmarks.md), scaled by stated assumptions. Every input
is a field of `Inputs` below with its source: "measured here" (the figure, its command, its
date) or "assumption" (the reasoning). `--inputs` prints them all. `Inputs` and the simulator are in
bench/ettr_model.py.

Failures. A Poisson process in wall time, one per kind. The rate per rank is Llama 3's rate per
GPU (466 interruptions in 54 days on 16,384 H100s, Dubey et al. 2024, section 3.3.4), so the
job's rate grows linearly with its node count at 12 ranks a node: MTTF 166.9 min at 16,384
ranks, 20.9 min at 131,072. Kokolis et al. (Meta, "Revisiting Reliability in Large-Scale ML
Research Clusters", 2024) project 0.23 h (about 14 min) at 131,072 GPUs from another fleet;
`--mttf-min 14` runs that rate, and the output gives the memory snapshots' ETTR at it too.
Each failure kind maps to a fault this project measures (bench/recovery.py); the mix is in
`Inputs.mix_*`. A kill_node picks one node at random (it matters for the buddy copies).

Cost of a failure = detection (the measured decision, with the timeout moved to the job's
setting; a lost node's with two of the job's beats and two unanswered probes of its host) +
restart (the measured warm or cold restart on 3 processes + a rendezvous that grows with the
node count + a cold start's imports) + load of the recovery point (disk: the checkpoint over the
storage's bandwidth; memory: host to device, and a lost node's shard from its buddy) + the work
since the recovery point, which is simulated: training resumes at the
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
        [--trials 10] [--mttf-min M] [--heartbeat-timeout 30] [--hang-floor 30]
        [--measured FILE.json] [--inputs] [--markdown]

`--measured FILE.json` replaces measured figures: a JSON object whose keys are the names of the
`Inputs` fields marked "measured here", values in seconds or bytes as the field's name says:

    decision_kill_rank_s, decision_freeze_rank_s, decision_kill_node_s: injection to the
        controller's decision, median, warm starts (bench/recovery.py)
    recovery_timeout_s, recovery_interval_s: the heartbeat timeout and interval those
        decisions ran under
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
import statistics
import sys
from dataclasses import fields, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from bench.ettr_model import (  # noqa: E402
    DAY,
    KINDS,
    Costs,
    Inputs,
    Outcome,
    Policy,
    costs,
    draw_failures,
    fixed_failures,  # noqa: F401 (re-exported for tests/test_ettr.py)
    load_measured,
    memory_interval_steps,
    policies,
    run_trials,
    simulate,  # noqa: F401 (re-exported for tests/test_ettr.py)
    young_daly_s,
)
from bench.ettr_replicas import ReplicaInputs, ettr_replicas, replica_costs  # noqa: E402
from bench.ettr_spares import table  # noqa: E402

# ETTR to reach: at the configured MTTF (ByteRobust's 97%), and at Kokolis et al.'s 14 min.
TARGET, TARGET_14 = 0.97, 0.95
# With replicas that carry on (bench/ettr_replicas.py), at the configured MTTF and at 14 min.
TARGET_REPLICAS, TARGET_REPLICAS_14 = 0.99, 0.98


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
        f"a disk save costs the loop {c.save_cost_s:.3f} s ({c.save_cost_s / c.step_s:.1%} of "
        f"a step), a memory snapshot {c.snapshot_s:.4f} s ({c.snapshot_s / c.step_s:.2%}); a "
        "disk save commits after "
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


# A snapshot's cost as a disk save's was (bench/checkpoint.py's staging and slowed steps), before
# the copy and the write ran behind the next step.
SNAPSHOTS_BEFORE = {"snapshot_loop_s": 0.026, "snapshot_slowed_s": 0.443,
                    "snapshot_bytes": 310_325_523}

def process_restarts(i: Inputs) -> dict:
    """Every rank of the next generation a new process (a warm fork), as before in-process
    restart: the measured time after the decision of that mode, on the same decisions."""
    return {f"next_step_warm_{k}_s": getattr(i, f"decision_{k}_s")
            + getattr(i, f"after_decision_process_{k}_s") for k in ("kill_rank", "kill_node")}


# Variants of the memory-snapshot policy: (label, Inputs changes or a function of the Inputs
# giving them, MTTF in minutes or None).
WHAT_IF = [
    ("as configured above", {}, None),
    ("MTTF 14 min (Kokolis et al.)", {}, 14.0),
    ("the hang bound fixed at 600 s (before the adaptive one)", {"hang_floor_s": 600.0}, None),
    ("ranks restarted as new processes (warm forks: before in-process restart)",
     process_restarts, None),
    ("snapshots copied and written on the loop's path (before they moved behind the step)",
     SNAPSHOTS_BEFORE, None),
    ("the controller kept from the agents (a lost node judged at heartbeat_timeout_s)",
     {"controller_reaches_agents": 0.0}, None),
    ("+ heartbeat_timeout_s 10", {"heartbeat_timeout_s": 10.0}, None),
    ("+ rendezvous 1 s per 1,000 nodes", {"heartbeat_timeout_s": 10.0,
                                          "rendezvous_s_per_1k_nodes": 1.0}, None),
    ("+ a rendezvous that does not grow with nodes (as 8 ranks make theirs here, 0.1 s)",
     {"heartbeat_timeout_s": 10.0, "rendezvous_s_per_1k_nodes": 0.0}, None),
    ("stock NCCL's start at scale (~265 s at 96k GPUs: 33 s per 1,000 nodes)",
     {"rendezvous_s_per_1k_nodes": 265.0 / 8.0}, None),
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
    parser.add_argument("--hang-floor", type=float, default=None,
                        help="supervision.hang_floor_s: the adaptive hang bound's floor")
    parser.add_argument("--measured", type=Path, default=None, help="JSON of measured figures")
    parser.add_argument("--inputs", action="store_true", help="print every input and its source")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--replica-ranks", type=int, default=1024,
                        help="ranks of one data-parallel replica, for the replica mode's table")
    args = parser.parse_args(argv)
    for name in ("days", "ranks", "ranks_per_node", "trials", "mttf_min", "heartbeat_timeout",
                 "hang_floor", "replica_ranks"):
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
    if args.hang_floor:
        i = replace(i, hang_floor_s=args.hang_floor)
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
        vi = replace(i, **(changes(i) if callable(changes) else changes))
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
        f" >= {TARGET_14:.0%} at MTTF 14 min: {ettr14:.1%}, "
        f"{'met' if ettr14 >= TARGET_14 else 'MISSED'}. "
        f"Meeting it at MTTF {c.mttf_s / 60:.1f} min leaves {budget:.0f} s per failure for "
        f"detection, restart, load and lost work.", markup=False, soft_wrap=True)

    spares_table(c, i, ettr, args, console)
    replicas_table(i, results[memory.name][0].overhead, args, console)


def replicas_table(i: Inputs, overhead: float, args, console: Console) -> None:
    """The replica mode (bench/ettr_replicas.py) on the same failure draws, at the configured
    MTTF and at 14 min; and with the silent faults held to the exchange's timeout."""
    r = ReplicaInputs()
    rows, met = [], {}
    for label, mttf, silent_bound in (("as configured", args.mttf_min, False),
                                      ("MTTF 14 min", 14.0, False),
                                      ("as configured, silent faults held to the hang bound "
                                       "(an exchange on a device today)", args.mttf_min, True)):
        c = costs(i, args.ranks, args.ranks_per_node, mttf)
        rc = replica_costs(c, i, r, args.ranks, args.replica_ranks, args.ranks_per_node)
        if silent_bound:  # the exchange let go only by its timeout (NCCL, XCCL today)
            bound = max(i.hang_floor_s, i.hang_step_factor * c.step_s)
            rc = replace(rc, decided_s={k: max(v, bound) if k != "kill_rank" else v
                                        for k, v in rc.decided_s.items()})
        horizon = args.days * DAY
        outcomes = [ettr_replicas(c, rc, draw_failures(c, horizon, np.random.default_rng(
            [args.seed, trial])), horizon, overhead) for trial in range(args.trials)]
        ettr = statistics.mean(e for e, _ in outcomes)
        met[label] = ettr
        rows.append([label, f"{c.mttf_s / 60:.1f} min", f"{rc.replicas}",
                     ", ".join(f"{k} {rc.stall_s(k):.1f}" for k in KINDS),
                     f"{rc.out_s['kill_rank']:.1f} s",
                     f"{statistics.mean(lost for _, lost in outcomes):.1f} s", f"{ettr:.2%}"])
    show(rows, ("replicas that carry on", "MTTF", "replicas", "survivors' stall (s)",
                "a replica out", "lost per failure", "ETTR mean"),
         f"A lost replica costs its share ({args.replica_ranks:,} ranks a replica; "
         "bench/ettr_replicas.py)", args.markdown, console)
    first, second = met["as configured"], met["MTTF 14 min"]
    console.print(
        f"target with replicas: >= {TARGET_REPLICAS:.0%}: {first:.2%}, "
        f"{'met' if first >= TARGET_REPLICAS else 'MISSED'}; >= {TARGET_REPLICAS_14:.0%} at "
        f"MTTF 14 min: {second:.2%}, {'met' if second >= TARGET_REPLICAS_14 else 'MISSED'} "
        "(the model of a mode whose controller side is not built: bench/ettr_replicas.py)",
        markup=False, soft_wrap=True)


def spares_table(c: Costs, i: Inputs, ettr: float, args, console: Console) -> None:
    """Spares run out (bench/ettr_spares.py): waiting for a repair against shrinking, with
    the disk interval of the memory policy above and a shorter one (a shrink resumes from
    disk: the work since that checkpoint is trained again)."""
    rows = []
    for minutes in (i.disk_behind_memory_min, 10.0):
        for r in table(c.nodes, c.mttf_s, minutes * 60.0, c.restart_s["kill_node", "warm"],
                       c.load_disk_s, args.days, args.trials, args.seed):
            rows.append([f"{minutes:g} min", str(r["spares"]), f"{r['repair_h']} h",
                         f"{r['wait']:.2%}", f"{r['shrink']:.2%}",
                         f"{ettr * (1 - r['wait']):.1%}", f"{ettr * (1 - r['shrink']):.1%}"])
    show(rows, ("disk every", "spares", "repair (mean)", "lost: wait", "lost: shrink",
                "ETTR: wait", "ETTR: shrink"),
         f"No spare left (MTTF {c.mttf_s / 60:.1f} min, {c.nodes:,} nodes): "
         "supervision.when_no_spare, time lost beyond the table above", args.markdown, console)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
