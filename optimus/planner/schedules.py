"""Microbatches in flight on each pipeline rank, from torch's own schedule orders.

A rank holds a microbatch's activations for a stage from that stage's forward (F) until its
backward: a full backward (B) frees them all; the zero-bubble schedules split it into an input
backward (I), after which more is held than before (`I_KEEPS`) until the weight backward (W)
frees it all. Which actions a rank runs, and in what order, is what
torch 2.13's `torch.distributed.pipelining` computes for the schedule (its `pipeline_order`,
built here from stub stages without a process group, as bench/pipeline.py does); GPipe and
1F1B run their own loop instead, replayed here (`_loop_order`).
"""

from __future__ import annotations

from functools import lru_cache

from optimus.config.schedule_rules import SCHEDULES, V_STYLE

# What an input backward (I) leaves held, as a share of a stage's activations: it frees nothing
# the weight backward (W) still needs (every linear layer's input) and adds the gradients of
# every linear layer's output, which W needs too: about half a block's saved bytes more
# (3d + 2kv + 2ffn of 8d + 2kv + 4ffn per token; memory.py). Measured on the zero-bubble
# schedules in tests/test_planner.py.
I_KEEPS = 1.5


class _StubStage:
    """What a schedule's constructor reads from its stages: enough to compute its order."""

    submod = None

    def __init__(self, stage_index: int, num_stages: int, group_size: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.stage_index_to_group_rank: dict[int, int] = {}


def _loop_order(schedule: str, pp: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    """GPipe: every forward then every backward; 1F1B: min(m, pp - rank) forwards, then a
    backward and a forward in turn (torch's `_step_microbatches`)."""
    order = {}
    for r in range(pp):
        warmup = m if schedule == "gpipe" else min(m, pp - r)
        actions = [("F", r, i) for i in range(warmup)]
        for i in range(m):
            actions.append(("B", r, i))
            if schedule == "1f1b" and warmup + i < m:
                actions.append(("F", r, warmup + i))
        order[r] = actions
    return order


def _torch_order(schedule: str, pp: int, v: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    from torch.distributed import pipelining  # import torch only when a pipeline is planned

    cls = getattr(pipelining, SCHEDULES[schedule])
    n = pp * v
    ids = [0, n - 1] if schedule in V_STYLE else [k * pp for k in range(v)]
    order = cls([_StubStage(i, n, pp) for i in ids], n_microbatches=m).pipeline_order
    out = {}
    for rank, actions in order.items():
        flat = []
        for a in actions:
            if a is None:
                continue
            for sub in getattr(a, "sub_actions", None) or [a]:
                kind = sub.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    flat.append((kind, sub.stage_index, sub.microbatch_index))
        out[rank] = flat
    return out


# Past this many actions the schedules are not replayed (torch builds its orders in seconds at
# pp=64): closed forms take over (`_closed_in_flight`, and the bubbles below).
SIMULATE_UP_TO = 256


def _closed_in_flight(schedule: str, pp: int, v: int, m: int) -> tuple[dict[int, float], ...]:
    """Microbatches held per stage by each rank, by formula: GPipe and looped BFS hold every
    microbatch; 1F1B pp - rank; interleaved 1F1B (v - 1) x pp + 2 (pp - 1 - rank) + 1 chunks,
    spread over the rank's stages (these three exactly what the replay gives); the zero-bubble
    ones about 2.5 pp chunks (the replay's range, approximately)."""
    out = []
    for rank in range(pp):
        if schedule in ("gpipe", "looped_bfs"):
            chunks = float(m * v)
        elif schedule == "1f1b":
            chunks = float(min(m, pp - rank))
        elif schedule in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"):
            chunks = min(m * v * I_KEEPS, 2.5 * pp)  # replayed at pp=4, v=2: 8.5 to 10.5
        else:
            chunks = float(min(m * v, (v - 1) * pp + 2 * (pp - 1 - rank) + 1))
        ids = ([rank, 2 * pp - 1 - rank] if schedule in V_STYLE
               else [rank + k * pp for k in range(v)])
        out.append({s: chunks / len(ids) for s in ids})
    return tuple(out)


@lru_cache(maxsize=4096)
def in_flight(schedule: str, pp: int, v: int, m: int) -> tuple[dict[int, float], ...]:
    """For each pp rank, the largest number of (stage -> microbatches) held at once.

    Returns per rank a dict stage -> microbatches' activations held at that rank's peak
    moment (more after an input backward), so stages of unequal size weigh right."""
    if pp == 1:
        return ({0: 1.0},)
    if pp * v * m > SIMULATE_UP_TO:
        return _closed_in_flight(schedule, pp, v, m)
    order = (_loop_order(schedule, pp, m) if schedule in ("gpipe", "1f1b")
             else _torch_order(schedule, pp, v, m))
    result = []
    for rank in range(pp):
        held: dict[tuple[int, int], float] = {}
        best, best_total = {}, -1.0
        for kind, stage, mb in order[rank]:
            if kind == "F":
                held[(stage, mb)] = 1.0
            elif kind == "I":
                held[(stage, mb)] = I_KEEPS
            else:  # B or W frees the rest
                held.pop((stage, mb), None)
            total = sum(held.values())
            if total > best_total:
                best_total = total
                best = {}
                for (s, _), share in held.items():
                    best[s] = best.get(s, 0.0) + share
        result.append(best)
    return tuple(result)


# Unit costs of the simulation: a backward costs twice a forward; split, each half of it.
COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@lru_cache(maxsize=4096)
def bubble(schedule: str, pp: int, v: int, m: int) -> float:
    """Idle time over busy time of the slowest rank: (makespan - busy) / busy.

    Each rank runs its actions in list order, one at a time, each as soon as its inputs
    exist: F of microbatch i on stage s needs F of i on s-1; B or I needs its own F and the B
    or I of i on s+1; W its I. Communication is free here (the time model adds it)."""
    if pp == 1:
        return 0.0
    if pp * v * m > SIMULATE_UP_TO:  # the replay's results at small sizes, as formulas
        if schedule in ("gpipe", "1f1b"):
            return (pp - 1) / m
        if schedule in ("interleaved_1f1b", "looped_bfs"):
            return (pp - 1) / (v * m)
        return (pp - 1) / (3 * v * m)
    order = (_loop_order(schedule, pp, m) if schedule in ("gpipe", "1f1b")
             else _torch_order(schedule, pp, v, m))
    last = pp * v - 1
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(order, 0.0)
    position = dict.fromkeys(order, 0)
    busy = {r: sum(COSTS[a[0]] for a in acts) for r, acts in order.items()}
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                kind, stage, mb = actions[position[rank]]
                needs = []
                if kind == "F" and stage > 0:
                    needs = [("F", stage - 1, mb)]
                elif kind in ("B", "I"):
                    needs = [("F", stage, mb)]
                    if stage < last:
                        needs.append(("B", stage + 1, mb) if ("B", stage + 1, mb) in done
                                     else ("I", stage + 1, mb))
                elif kind == "W":
                    needs = [("I", stage, mb)]
                if any(n not in done for n in needs):
                    break
                start = max([clock[rank]] + [done[n] for n in needs])
                clock[rank] = done[(kind, stage, mb)] = start + COSTS[kind]
                position[rank] += 1
                progressed = True
    if any(position[r] < len(order[r]) for r in order):
        raise ValueError(f"{schedule} on pp={pp}, v={v}, m={m}: the order deadlocks")
    makespan = max(clock.values())
    return max((makespan - busy[r]) / busy[r] for r in order)
