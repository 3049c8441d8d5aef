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

from optimus.parallel.schedule_rules import SCHEDULES, V_STYLE

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


@lru_cache(maxsize=4096)
def in_flight(schedule: str, pp: int, v: int, m: int) -> tuple[dict[int, float], ...]:
    """For each pp rank, the largest number of (stage -> microbatches) held at once.

    Returns per rank a dict stage -> microbatches' activations held at that rank's peak
    moment (fractions after an input backward), so stages of unequal size weigh right."""
    if pp == 1:
        return ({0: 1.0},)
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
