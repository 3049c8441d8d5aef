"""Pipeline schedules: the idle (bubble) fraction of torch's schedules, simulated and measured.

(a) For each schedule of `torch.distributed.pipelining` (torch 2.13), take the per-rank action
    list the schedule itself computes (`pipeline_order`, built from stub stages: no process
    group) and play it on a timeline: a rank runs its actions in list order, one at a time,
    each as soon as its inputs exist (F of microbatch i on stage s needs F of i on s-1; B or I
    needs its own F and B/I of i on s+1; W needs its I). Unit costs F=1, B=2, I=W=1;
    communication is free. The idle fraction is Megatron-LM's: (makespan - busy) / busy per
    rank, whose theory is (p-1)/m for 1F1B and (p-1)/(v*m) for interleaved 1F1B. Each row also
    gives its speed against 1F1B on the same total work (a stage's work split into v chunks).
    GPipe and 1F1B run their own loop rather than their `pipeline_order`; they are simulated
    from that loop, and where the two differ (1F1B's, on the last rank) the run says so.
(b) A real p=2 run on CPU (2 spawned processes, gloo, one thread each): a Linear+GELU stack
    under ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B (v=2), m=8, one step of
    each in turn. A rank's busy time is its time in torch's forward_one_chunk /
    backward_one_chunk, its comm time that in torch's point-to-point calls; a step's wall time
    runs from the first rank's start to the last rank's end.

    .venv/bin/python bench/pipeline.py [--quick] [--no-real]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as schedules_module
from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, OVERLAP_F_B, _Action

# name: (torch class, stages per rank to try). Single-stage schedules take v=1 only; the
# V-shaped ones (stage r and 2p-1-r on rank r) exactly 2.
SCHEDULES = {
    "GPipe": ("ScheduleGPipe", (1,)),
    "1F1B": ("Schedule1F1B", (1,)),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", (1, 2, 4)),
    "LoopedBFS": ("ScheduleLoopedBFS", (1, 2, 4)),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", (1, 2, 4)),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", (2,)),
    "DualPipeV": ("ScheduleDualPipeV", (2,)),
}
V_SHAPED = {"ZBVZeroBubble", "DualPipeV"}
TARGETED = {"1F1B", "Interleaved1F1B"}  # the schedules the 2-point target applies to
COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
REAL_SCHEDULES = (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2))


# --- (a) the schedules' own orders, simulated ------------------------------------------------

class StubStage:
    """What a schedule's constructor reads from its stages: enough to compute its order."""

    submod = None

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.stage_index_to_group_rank: dict[int, int] = {}


def schedule_order(name: str, p: int, v: int, m: int) -> dict[int, list]:
    """rank -> action list, as torch's schedule computes it (raises what the schedule raises).

    Multi-stage schedules compute `pipeline_order` in their constructor and run it. The
    single-stage GPipe and 1F1B store `_get_pipeline_order()` there but run their own loop
    (`_step_microbatches`); see `runtime_order`.
    """
    cls = getattr(pipelining, SCHEDULES[name][0])
    n = p * v
    if name in ("GPipe", "1F1B"):
        return cls(StubStage(0, n, p, 0), n_microbatches=m).pipeline_order
    ids = [0, n - 1] if name in V_SHAPED else [k * p for k in range(v)]
    return cls([StubStage(i, n, p, 0) for i in ids], n_microbatches=m).pipeline_order


def runtime_order(name: str, p: int, m: int) -> dict[int, list]:
    """What ScheduleGPipe / Schedule1F1B._step_microbatches run on each rank (torch 2.13).

    GPipe: every forward, then every backward. 1F1B: min(m, p - rank) forwards, then one
    backward and one forward in turn, then the remaining backwards.
    """
    order = {}
    for r in range(p):
        warmup = m if name == "GPipe" else min(m, p - r)
        actions = [_Action(r, FORWARD, i) for i in range(warmup)]
        for i in range(m):
            actions.append(_Action(r, FULL_BACKWARD, i))
            if name == "1F1B" and warmup + i < m:
                actions.append(_Action(r, FORWARD, warmup + i))
        order[r] = actions
    return order


def executed_order(name: str, p: int, v: int, m: int) -> dict[int, list]:
    """The order each rank runs: torch's `pipeline_order`, or for GPipe/1F1B their loop's."""
    if name in ("GPipe", "1F1B"):
        return runtime_order(name, p, m)
    return schedule_order(name, p, v, m)


def differing_ranks(ir: dict[int, list], ran: dict[int, list]) -> list[int]:
    """Ranks whose compute actions in torch's IR differ from what its runtime runs."""
    return [r for r in ran if [str(a) for a in compute_actions(ir[r])] != [str(a) for a in ran[r]]]


def compute_actions(actions: list) -> list[_Action]:
    """The compute actions of one rank, in order: Nones (placeholders the runtime skips) and
    REDUCE_GRAD dropped, an overlapped F+B split into its two parts (the runtime runs them one
    after the other)."""
    out = []
    for a in actions:
        if a is None:
            continue
        if a.computation_type == OVERLAP_F_B:
            out.extend(a.sub_actions)
        elif a.computation_type.value in COSTS:
            out.append(a)
    return out


def simulate(order: dict[int, list], costs: dict[str, float] = COSTS,
             rank_costs: dict[int, dict[str, float]] | None = None) -> tuple[float, dict]:
    """Play each rank's list on a timeline; return (makespan, busy time per rank).

    `costs` gives each action kind's duration; `rank_costs`, if given, one such dict per rank.

    Dependencies: F(s,i) after F(s-1,i); B/I(s,i) after F(s,i) and B/I(s+1,i); W(s,i) after
    I(s,i). Each rank runs its next action as soon as its dependencies are done and the rank
    is free. Raises RuntimeError if no rank can move (the order deadlocks).
    """
    queues = {r: compute_actions(acts) for r, acts in order.items()}
    last = max(a.stage_index for q in queues.values() for a in q)
    done: dict[tuple, float] = {}  # ("F"|"X"|"W", stage, microbatch) -> finish time
    clock = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)
    pos = dict.fromkeys(queues, 0)
    moved = True
    while moved:
        moved = False
        for r, queue in queues.items():
            while pos[r] < len(queue):
                a = queue[pos[r]]
                s, kind, i = a.stage_index, a.computation_type.value, a.microbatch_index
                if kind == "F":
                    deps = [("F", s - 1, i)] if s > 0 else []
                elif kind in ("B", "I"):
                    deps = [("F", s, i)] + ([("X", s + 1, i)] if s < last else [])
                else:
                    deps = [("X", s, i)]
                if any(d not in done for d in deps):
                    break
                cost = (rank_costs[r] if rank_costs else costs)[kind]
                end = max([clock[r]] + [done[d] for d in deps]) + cost
                clock[r] = end
                busy[r] += cost
                done[("F" if kind == "F" else "W" if kind == "W" else "X", s, i)] = end
                if kind == "B":
                    done[("W", s, i)] = end
                pos[r] += 1
                moved = True
    stuck = {r: str(queues[r][pos[r]]) for r in queues if pos[r] < len(queues[r])}
    if stuck:
        raise RuntimeError(f"the order deadlocks; ranks wait at {stuck}")
    return max(clock.values()), busy


def idle_fraction(makespan: float, busy: dict) -> float:
    """Megatron's bubble fraction, averaged over ranks: (makespan - busy) / busy."""
    return statistics.fmean((makespan - b) / b for b in busy.values())


def theory(p: int, v: int, m: int) -> float:
    return (p - 1) / (v * m)


def simulate_all(ps, mults) -> tuple[list[dict], list[str], list[dict]]:
    """Rows for every (schedule, p, v, m) the schedule accepts; refusals; IR notes.

    GPipe and 1F1B are simulated from what their runtime runs (`runtime_order`); where
    torch's IR for them differs, the note says on which ranks and whether the IR deadlocks.
    """
    rows, refused, notes = [], [], []
    for p in ps:
        for m in (k * p for k in mults):
            for name, (_, vs) in SCHEDULES.items():
                for v in vs:
                    try:
                        order = schedule_order(name, p, v, m)
                        if name in ("GPipe", "1F1B"):
                            ran = runtime_order(name, p, m)
                            if bad := differing_ranks(order, ran):
                                notes.append(ir_note(name, p, m, order, bad))
                            order = ran
                        makespan, busy = simulate(order)
                    except (ValueError, RuntimeError, AssertionError) as e:
                        refused.append(f"{name} p={p} v={v} m={m}: {str(e).strip()}")
                        continue
                    rows.append({"schedule": name, "p": p, "v": v, "m": m,
                                 # same total work: a chunk costs 1/v of a stage
                                 "makespan": makespan / v,
                                 "idle": idle_fraction(makespan, busy),
                                 "theory": theory(p, v, m)})
    base = {(r["p"], r["m"]): r["makespan"] for r in rows if r["schedule"] == "1F1B"}
    for r in rows:
        r["vs_1f1b"] = base.get((r["p"], r["m"]), float("nan")) / r["makespan"]
    return rows, refused, notes


def ir_note(name: str, p: int, m: int, order: dict, bad: list[int]) -> dict:
    try:
        simulate(order)
        outcome = "it simulates without deadlock"
    except RuntimeError as e:
        outcome = f"{e}".replace("the order", "it")
    r = bad[-1]
    shown = [str(a) for a in compute_actions(order[r])]
    return {"name": name, "p": p, "m": m, "ranks": bad, "outcome": outcome.split(";")[0],
            "example": f"rank {r}: " + " ".join(shown[:3]) + " ... " + " ".join(shown[-3:])}


def print_simulation(rows: list[dict], refused: list[str], notes: list[dict]) -> None:
    print("(a) torch's own action lists, simulated: F=1, B=2 (I=W=1), communication free.")
    print("    idle = (makespan - busy) / busy; theory = (p-1)/(v*m) (for zero-bubble "
          "schedules: the interleaved-1F1B reference);")
    print("    makespan in units of one stage's forward (a chunk costs 1/v); "
          "x1F1B = makespan(1F1B) / makespan.")
    print(f"{'schedule':<22}{'p':>3}{'v':>3}{'m':>5}{'makespan':>10}{'idle':>9}"
          f"{'theory':>9}{'diff pp':>9}{'x1F1B':>8}")
    for r in rows:
        print(f"{r['schedule']:<22}{r['p']:>3}{r['v']:>3}{r['m']:>5}{r['makespan']:>10.2f}"
              f"{r['idle']:>9.4f}{r['theory']:>9.4f}{100 * (r['idle'] - r['theory']):>+9.2f}"
              f"{r['vs_1f1b']:>7.3f}x")
    if refused:
        print("refused by the schedule (its own message):")
        for line in refused:
            print(f"  {line}")
    for name in dict.fromkeys(n["name"] for n in notes):
        group = [n for n in notes if n["name"] == name]
        last = all(n["ranks"] == [n["p"] - 1] for n in group)
        ex = next((n for n in group if (n["p"], n["m"]) == (4, 8)), group[0])
        print(f"{name}: torch's _get_pipeline_order is not what its _step_microbatches runs, on "
              f"{'the last rank' if last else 'some ranks'} for {len(group)} (p, m) tried; "
              f"e.g. p={ex['p']} m={ex['m']} {ex['example']}; {ex['outcome']}. The rows "
              f"above simulate what it runs.")
    zb = [r for r in rows if "Zero" in r["schedule"] or r["schedule"] == "DualPipeV"]
    above = [r for r in zb if r["idle"] > fill_floor(r["p"], r["v"], r["m"]) + 1e-9]
    print(f"zero-bubble rows at the fill floor (p-1)/(3*v*m) (the last rank cannot start before "
          f"p-1 chunk forwards): {len(zb) - len(above)} of {len(zb)}; above it: "
          + (", ".join(f"{r['schedule']} p={r['p']} v={r['v']} m={r['m']} "
                       f"({r['idle'] / fill_floor(r['p'], r['v'], r['m']):.1f}x)" for r in above)
             or "none"))


def fill_floor(p: int, v: int, m: int) -> float:
    """The least idle fraction any order can have with F = I = W = 1 per chunk: the last rank
    waits p-1 forwards before its first action, and the step ends for all at the same time."""
    return (p - 1) / (3 * v * m)


def print_off_grid(ps) -> None:
    """Interleaved1F1B for m between p and 4p that is not a multiple of p."""
    print("\nInterleaved1F1B off the grid (p < m < 4p, m not a multiple of p):")
    for p in ps:
        for v in (2, 4):
            fine, refused, worst = [], [], 0.0
            for m in (m for m in range(p + 1, 4 * p) if m % p):
                try:
                    makespan, busy = simulate(schedule_order("Interleaved1F1B", p, v, m))
                except ValueError:
                    refused.append(m)
                    continue
                fine.append(m)
                worst = max(worst, abs(idle_fraction(makespan, busy) - theory(p, v, m)))
            print(f"  p={p} v={v}: m={','.join(map(str, fine))} simulated, worst "
                  f"{100 * worst:.2f} pp from theory; refused m={','.join(map(str, refused))}"
                  f" (m must be a multiple of its round count max(1, m // p))")


def print_headline(rows: list[dict]) -> None:
    by = {(r["schedule"], r["p"], r["v"], r["m"]): r for r in rows}
    ps = sorted({r["p"] for r in rows})
    print("\nheadline: idle fraction, simulated (theory)")
    for p in [p for p in (4, 8) if p in ps] or ps:
        ms = sorted({r["m"] for r in rows if r["p"] == p})
        print(f"  p={p:<3}" + "".join(f"{f'm={m}':>22}" for m in ms))
        for name, v in (("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 4)):
            cells = [by.get((name, p, v, m)) for m in ms]
            print(f"  {name + f' v={v}':<20}" + "".join(
                f"{c['idle']:>13.4f} ({c['theory']:.4f})" if c else f"{'-':>22}" for c in cells))
    print("\ninterleaved / 1F1B throughput, same total work (makespan_1F1B / "
          "makespan_interleaved)")
    mults = sorted({r["m"] // r["p"] for r in rows})
    print(f"  {'':<10}" + "".join(f"{f'm={k}p':>9}" for k in mults))
    for v in (2, 4):
        for p in ps:
            cells = [by.get(("Interleaved1F1B", p, v, k * p)) for k in mults]
            print(f"  {f'v={v} p={p}':<10}" + "".join(
                f"{c['vs_1f1b']:>8.3f}x" if c else f"{'-':>9}" for c in cells))
    worst = max((r for r in rows if r["schedule"] in TARGETED),
                key=lambda r: abs(r["idle"] - r["theory"]))
    gap = 100 * abs(worst["idle"] - worst["theory"])
    print(f"\ntarget: 1F1B and Interleaved1F1B within 2 pp of theory: worst {gap:.2f} pp "
          f"({worst['schedule']} p={worst['p']} v={worst['v']} m={worst['m']}) -> "
          f"{'met' if gap <= 2 else 'NOT met'}")
    for v in (2, 4):
        r = by.get(("Interleaved1F1B", 4, v, 8))
        if r:
            print(f"target: p=4 m=8 interleaved v={v} / 1F1B >= 1.10x: {r['vs_1f1b']:.3f}x -> "
                  f"{'met' if r['vs_1f1b'] >= 1.10 else 'NOT met'}")


# --- (b) a real p=2 run on CPU ---------------------------------------------------------------

def stage_module(stage_id: int, layers: int, dim: int) -> nn.Module:
    torch.manual_seed(1000 + stage_id)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.GELU())])


def timed(fn, kind: str, log: dict):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            log[kind].append(time.perf_counter() - started)
    return wrapper


def build_run(rank: int, world: int, name: str, v: int, m: int, cfg: dict, log: dict):
    """This rank's stages of a `world * v`-stage pipeline under the named schedule, their
    compute timed into `log`; returns a function that runs one step."""
    num_stages = world * v
    stage_ids = [rank + k * world for k in range(v)]
    stages = []
    for sid in stage_ids:
        module = stage_module(sid, cfg["layers"] // num_stages, cfg["dim"])
        stage = PipelineStage(module, sid, num_stages, torch.device("cpu"))
        stage.forward_one_chunk = timed(stage.forward_one_chunk, "F", log)
        stage.backward_one_chunk = timed(stage.backward_one_chunk, "B", log)
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, "W", log)
        stages.append(stage)
    cls = getattr(pipelining, SCHEDULES[name][0])
    schedule = cls(stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=F.mse_loss)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m * cfg["mb"], cfg["dim"], generator=g)
    y = torch.randn(m * cfg["mb"], cfg["dim"], generator=g)
    args = (x,) if 0 in stage_ids else ()
    kwargs = {"target": y, "losses": []} if num_stages - 1 in stage_ids else {}

    def step():
        schedule.step(*args, return_outputs=False, **kwargs)
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
    return step


def real_worker(rank: int, world: int, port: int, out_dir: str, m: int, cfg: dict) -> None:
    """Build every schedule, then run their steps in turn (one step of each per round, so that
    other load on the machine falls on all of them); write each step's timings."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    log: dict[str, list[float]] = {"F": [], "B": [], "W": [], "comm": []}
    # time in the schedules' point-to-point calls: posting sends/receives and waiting on them
    for fn in ("_batch_p2p", "_wait_batch_p2p"):
        setattr(schedules_module, fn, timed(getattr(schedules_module, fn), "comm", log))
    try:
        runs = {f"{name} v={v}": build_run(rank, world, name, v, m, cfg, log)
                for name, v in cfg["schedules"]}
        results: dict[str, list[dict]] = {key: [] for key in runs}
        for i in range(cfg["warmup"] + cfg["steps"]):
            for key, step in runs.items():
                for times in log.values():
                    times.clear()
                dist.barrier()
                started = time.perf_counter()  # CLOCK_MONOTONIC: the same clock in both
                step()
                ended = time.perf_counter()
                if i >= cfg["warmup"]:
                    results[key].append({"start": started, "end": ended,
                                         **{k: sum(t) for k, t in log.items()},
                                         "F_each": list(log["F"]), "B_each": list(log["B"])})
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_real(m: int, cfg: dict) -> None:
    world = 2
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(real_worker, args=(world, free_port(), out_dir, m, cfg), nprocs=world)
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    print(f"\n(b) real p=2 run: 2 processes, gloo on 127.0.0.1, 1 thread each; "
          f"{cfg['layers']} x (Linear {cfg['dim']}x{cfg['dim']} + GELU) split evenly over "
          f"the stages, {m} microbatches of {cfg['mb']} rows, MSE loss;")
    print(f"    {cfg['steps']} steps after {cfg['warmup']} warm-up; medians over steps. "
          f"busy = time in forward_one_chunk + backward_one_chunk; wall = first start to "
          f"last end. load average {os.getloadavg()[0]:.2f}")
    print(f"{'schedule':<20}{'rank':>5}{'wall':>8}{'busy':>8}{'comm':>8}{'other':>8}"
          f"{'F':>7}{'B':>7}{'idle':>8}{'sim':>8}{'sim@meas':>10}{'theory':>8}")
    wall_of, sim_of = {}, {}
    for key in per_rank[0]:
        name, v = key.split(" v=")[0], int(key.split(" v=")[1])
        order = executed_order(name, world, v, m)
        sim_makespan, sim_busy = simulate(order)
        steps = list(zip(*(r[key] for r in per_rank), strict=True))
        walls = [max(s["end"] for s in step) - min(s["start"] for s in step) for step in steps]
        # each rank's median F and B: the same order replayed with the times measured
        measured = {r: {k: statistics.median(t for step in steps for t in step[r][f"{k}_each"])
                        for k in ("F", "B")} for r in range(world)}
        for c in measured.values():
            c["I"] = c["W"] = c["B"] / 2
        meas_makespan, meas_busy = simulate(order, rank_costs=measured)
        for rank in range(world):
            busy = [step[rank]["F"] + step[rank]["B"] + step[rank]["W"] for step in steps]
            comm = [step[rank]["comm"] for step in steps]
            other = [w - b - c for w, b, c in zip(walls, busy, comm, strict=True)]
            idle = statistics.median((w - b) / b for w, b in zip(walls, busy, strict=True))
            print(f"{key:<20}{rank:>5}" + "".join(
                f"{statistics.median(x) * 1e3:>8.1f}" for x in (walls, busy, comm, other))
                  + f"{measured[rank]['F'] * 1e3:>7.2f}{measured[rank]['B'] * 1e3:>7.2f}"
                  f"{idle:>8.4f}{(sim_makespan - sim_busy[rank]) / sim_busy[rank]:>8.4f}"
                  f"{(meas_makespan - meas_busy[rank]) / meas_busy[rank]:>10.4f}"
                  f"{theory(world, v, m):>8.4f}")
        wall_of[key] = statistics.median(walls)
        sim_of[key] = sim_makespan / v
    print("    times in ms per step (F, B: median per action); idle = (wall - busy) / busy; "
          "comm = in torch's p2p calls (post, wait);")
    print("    other = wall - busy - comm: the schedule's own work, and the time before this "
          "rank's step starts or after it ends;")
    print("    sim = the schedule's order simulated with F=1, B=2; sim@meas = the same order "
          "with this rank's median F and B times; medians over steps, so a row's columns "
          "need not add up")
    if "1F1B v=1" in wall_of and "Interleaved1F1B v=2" in wall_of:
        a, b = "1F1B v=1", "Interleaved1F1B v=2"
        print(f"measured step time 1F1B / Interleaved1F1B v=2: {wall_of[a] / wall_of[b]:.3f}x "
              f"(simulated {sim_of[a] / sim_of[b]:.3f}x); load average now "
              f"{os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="p in {2, 4}, m in {p, 2p}")
    parser.add_argument("--no-real", action="store_true", help="skip the real p=2 run")
    args = parser.parse_args()
    ps, mults = ((2, 4), (1, 2)) if args.quick else ((2, 4, 8, 16), (1, 2, 4, 8))
    started = time.perf_counter()
    rows, refused, notes = simulate_all(ps, mults)
    print_simulation(rows, refused, notes)
    print_headline(rows)
    print_off_grid([p for p in ps if p in (4, 8)])
    print(f"(simulation: {time.perf_counter() - started:.1f} s)")
    if not args.no_real:
        cfg = {"schedules": REAL_SCHEDULES, "layers": 8, "dim": 2048, "mb": 16, "warmup": 3,
               "steps": 5 if args.quick else 16}
        run_real(8, cfg)
    print(f"torch {torch.__version__}, total {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
