"""Which pipeline schedules fit which layout, and which stages and layers go where.

Pure Python, no torch: the job validator imports this before any process starts. The rules
are those torch 2.13's `torch.distributed.pipelining` enforces (read from its schedules.py and
confirmed by running every schedule on CPU/gloo against one process, tests/test_pipeline.py):

| schedule                | stages per rank v    | microbatches m                       |
|-------------------------|----------------------|--------------------------------------|
| gpipe                   | 1                    | any                                  |
| 1f1b                    | 1                    | m >= pp                              |
| interleaved_1f1b        | any, 1 included      | m % max(1, m // pp) == 0 (*)         |
| looped_bfs              | any, 1 included      | any                                  |
| interleaved_zero_bubble | any, 1 included      | as interleaved_1f1b (*)              |
| zbv_zero_bubble         | exactly 2 (V shape)  | any                                  |
| dualpipev               | exactly 2 (V shape)  | m >= 2 * pp (the number of stages)   |

(*) m runs in max(1, m // pp) rounds that must divide it: any m <= pp or multiple of pp fits,
so does 10 on pp=4 (2 rounds of 5); 9 on pp=4 does not.
`m` is the pipeline's n_microbatches: microbatches per step per data-parallel replica.
"""

from __future__ import annotations

# The job file's names -> classes of torch.distributed.pipelining.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = frozenset({"gpipe", "1f1b"})  # take one PipelineStage, not a list
V_STYLE = frozenset({"zbv_zero_bubble", "dualpipev"})
# Backward split into input (I) and weight (W) parts: the zero-bubble family.
SPLIT_BACKWARD = frozenset({"interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"})
_ROUNDS = frozenset({"interleaved_1f1b", "interleaved_zero_bubble"})


def is_multi_stage(schedule: str) -> bool:
    """Whether torch's class takes a list of stages (even a list of one)."""
    return schedule not in SINGLE_STAGE


def stage_style(schedule: str) -> str:
    """"v": rank r holds stages r and 2*pp-1-r; "loop": rank r holds r, r+pp, r+2pp, ..."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose among {sorted(SCHEDULES)}")
    return "v" if schedule in V_STYLE else "loop"


def schedule_problem(schedule: str, pp: int, virtual_stages: int,
                     microbatches: int) -> tuple[str, str] | None:
    """None if torch can run `schedule` on this layout, else (what is wrong, how to fix it)."""
    if schedule not in SCHEDULES:
        return (f"unknown schedule {schedule!r}", f"choose among {', '.join(SCHEDULES)}")
    for name, value in (("pp", pp), ("virtual_stages", virtual_stages),
                        ("microbatches", microbatches)):
        if not isinstance(value, int) or value < 1:
            return (f"{name} must be a positive integer, got {value!r}", f"set {name} >= 1")
    v, m = virtual_stages, microbatches
    if schedule in SINGLE_STAGE and v != 1:
        return (f"{schedule} runs one stage per rank, got virtual_stages={v}",
                "set parallel.virtual_stages: 1, or use interleaved_1f1b, looped_bfs or "
                "interleaved_zero_bubble for several stages per rank")
    if schedule in V_STYLE and v != 2:
        return (f"{schedule} needs exactly 2 virtual stages per rank, got {v}",
                "set parallel.virtual_stages: 2")
    if schedule == "1f1b" and m < pp:
        return (f"1f1b needs at least as many microbatches as stages (pp={pp}), got {m}",
                f"set data.microbatches >= {pp}, or use gpipe or interleaved_1f1b")
    if schedule == "dualpipev" and m < 2 * pp:
        return (f"dualpipev needs at least as many microbatches as stages (2 x pp = "
                f"{2 * pp}), got {m}", f"set data.microbatches >= {2 * pp}")
    if schedule in _ROUNDS and not _rounds_fit(m, pp):
        below = next(n for n in range(m, 0, -1) if _rounds_fit(n, pp))
        above = next(n for n in range(m, m + pp + 1) if _rounds_fit(n, pp))
        return (f"{schedule} runs {m} microbatches in {m} // pp={pp} = {m // pp} rounds and "
                f"needs them to divide evenly", f"set data.microbatches to {below} or {above} "
                f"(at most {pp}, or a multiple of {pp}, always works)")
    return None


def _rounds_fit(m: int, pp: int) -> bool:
    return m % max(1, m // pp) == 0


def stage_layers(n_layers: int, num_stages: int) -> list[range]:
    """Each stage's transformer layers: contiguous, sizes differing by at most one.

    When they do not divide evenly the earlier stages take the extra layers (7 on 3: 3, 2, 2).
    The last stage already carries the final norm, the output projection and the loss (for a
    large vocabulary about a layer's worth of compute or more), while the first stage's
    embedding is only a lookup.
    """
    if num_stages < 1 or n_layers < num_stages:
        raise ValueError(f"{n_layers} layers cannot fill {num_stages} pipeline stages")
    base, extra = divmod(n_layers, num_stages)
    out, lo = [], 0
    for stage in range(num_stages):
        hi = lo + base + (stage < extra)
        out.append(range(lo, hi))
        lo = hi
    return out


def stage_ids(pp_rank: int, pp: int, virtual_stages: int, style: str) -> list[int]:
    """The stages pipeline rank `pp_rank` holds, ascending (the order torch's schedules want).

    Of pp * virtual_stages stages: "loop" gives rank r stages r, r + pp, r + 2pp, ...;
    "v" (two per rank) gives r and 2*pp-1-r, so rank 0 holds both the first and last stage.
    """
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pipeline rank {pp_rank} is outside pp={pp}")
    if style == "v":
        if virtual_stages != 2:
            raise ValueError(f"V-style schedules hold 2 stages per rank, not {virtual_stages}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    if style != "loop":
        raise ValueError(f"stage style must be 'loop' or 'v', got {style!r}")
    return [pp_rank + i * pp for i in range(virtual_stages)]
