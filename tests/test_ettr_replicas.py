"""bench/ettr_replicas.py (the replica mode's ETTR) against what can be written down by hand:
the survivors' mean stall over where in a step a fault falls, the lost replica's share, and no
failure at all."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.ettr_model import KINDS, Inputs, costs, draw_failures, fixed_failures  # noqa: E402
from bench.ettr_replicas import (  # noqa: E402
    ReplicaInputs,
    ettr_replicas,
    replica_costs,
)

DAY = 86400.0


def setup(replica_ranks: int = 1024):
    i = Inputs()
    c = costs(i, 131_072, 12)
    return c, i, replica_costs(c, i, ReplicaInputs(), 131_072, replica_ranks, 12)


def test_the_stall_is_the_wait_past_the_step_the_fault_fell_in():
    c, _, rc = setup()
    s = rc.step_s
    short = replace(rc, decided_s={**rc.decided_s, "kill_rank": s / 4}, reform_s=0.5)
    # d < s: the fault falls at u uniform, the exchange is (1 - u) s later: E[max(0, d - x)]
    # for x uniform on [0, s] is d^2 / 2s.
    assert short.stall_s("kill_rank") == pytest.approx((s / 4) ** 2 / (2 * s) + 0.5)
    long = replace(rc, decided_s={**rc.decided_s, "hang": 3 * s}, reform_s=0.0)
    assert long.stall_s("hang") == pytest.approx(3 * s - s / 2)
    # The same by sampling where the fault falls.
    u = np.random.default_rng(0).uniform(0, 1, 1_000_000)
    for d in (s / 4, 3 * s):
        sampled = np.maximum(0.0, d - (1 - u) * s).mean()
        probe = replace(rc, decided_s={**rc.decided_s, "kill_rank": d}, reform_s=0.0)
        assert probe.stall_s("kill_rank") == pytest.approx(sampled, rel=0.02)


def test_each_failure_costs_its_stall_and_a_replicas_share_of_its_time_out():
    c, _, rc = setup()
    horizon = DAY
    fails = fixed_failures([1000.0, 5000.0, 9000.0], "kill_node")
    ettr, lost = ettr_replicas(c, rc, fails, horizon, overhead=0.0)
    each = rc.stall_s("kill_node") + rc.out_s["kill_node"] / rc.replicas
    assert lost == pytest.approx(each)
    assert ettr == pytest.approx(1 - 3 * each / horizon)
    assert rc.replicas == 128
    # Smaller replicas: more of them, each one's absence a smaller share.
    _, _, small = setup(replica_ranks=256)
    assert small.replicas == 512 and small.out_s["kill_node"] < rc.out_s["kill_node"]


def test_no_failure_leaves_only_the_checkpoint_overhead():
    c, _, rc = setup()
    none = fixed_failures([])
    assert ettr_replicas(c, rc, none, DAY, overhead=0.017)[0] == pytest.approx(0.983)


def test_at_the_default_scale_the_mode_beats_a_world_restart_per_failure():
    c, _, rc = setup()
    fails = draw_failures(c, 30 * DAY, np.random.default_rng(0))
    _, lost = ettr_replicas(c, rc, fails, 30 * DAY, overhead=0.0)
    restart = min(c.detect_s[k] + c.restart_s[k, "warm"] for k in KINDS)
    assert lost < restart  # even the cheapest whole-job restart costs more than the mean here
