"""What an agent makes of its ranks' heartbeats (controller/node/ranks.py): the compute-time
samples a straggler is judged by."""

from __future__ import annotations

from collections import deque
from pathlib import Path

from controller.node.ranks import WARMUP_STEPS, RankProcess, sample_compute, summary


class _Running:
    pid, returncode = 4242, None

    def poll(self):
        return None


def rank(window: int = 4) -> RankProcess:
    return RankProcess(0, 0, _Running(), Path("rank.log"), 0.0, compute=deque(maxlen=window))


def beat(step: int, compute_s: float) -> dict:
    return {"step": step, "compute_s": compute_s, "phase": "forward", "time": 1.0}


def test_a_ranks_warm_up_steps_are_no_sample_and_each_step_counts_once():
    p = rank()
    for step, seconds in [(11, 3.0), (12, 2.0), (12, 2.0), (13, 0.1), (13, 0.5), (14, 0.2)]:
        sample_compute(p, beat(step, seconds))
    assert WARMUP_STEPS == 2
    assert list(p.compute) == [0.1, 0.2]  # steps 11 and 12 warm up; step 13 once
    sample_compute(p, beat(15, 0.0))  # before its first step's end: nothing to time
    sample_compute(p, {"step": 16, "compute_s": "x"})  # not a number
    assert list(p.compute) == [0.1, 0.2]


def test_a_node_is_scored_from_half_a_window_of_samples_past_the_warm_up():
    p = rank(window=4)
    sample_compute(p, beat(1, 9.0))
    sample_compute(p, beat(2, 9.0))
    sample_compute(p, beat(3, 0.3))
    assert summary([p], {0: beat(3, 0.3)}).compute_s is None  # one sample: not yet
    sample_compute(p, beat(4, 0.5))
    assert summary([p], {0: beat(4, 0.5)}).compute_s == 0.4  # the median of 0.3 and 0.5
