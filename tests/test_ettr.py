"""bench/ettr.py's simulator against closed forms: no failures, failures at fixed times, the
exact mean of the work lost to Poisson failures, Young/Daly's optimum, and the buddy copies.

Each test builds `Costs` at the default scale and then sets the few costs it is about, so the
expected value can be written down by hand.
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

_SPEC = importlib.util.spec_from_file_location(
    "ettr", Path(__file__).resolve().parents[1] / "bench" / "ettr.py")
ettr = importlib.util.module_from_spec(_SPEC)
sys.modules["ettr"] = ettr  # dataclasses look their module up by name
_SPEC.loader.exec_module(ettr)

DAY = 86400.0
ZERO = {k: 0.0 for k in ettr.KINDS}


def base(**changes) -> ettr.Costs:
    """The default costs, a snapshot priced as a disk save (as the formulas below take it)."""
    return replace(ettr.costs(ettr.Inputs(), 131_072, 12), **{"snapshot_cost_s": None,
                                                              **changes})


def free(**changes) -> ettr.Costs:
    """Costs where a failure costs nothing but the lost work, and a save nothing but `changes`."""
    c = base(detect_s=dict(ZERO), load_disk_s=0.0, load_memory_s=dict(ZERO), commit_s=0.0,
             replicate_s=0.0, save_cost_s=0.0,
             restart_s={(k, s): 0.0 for k in ettr.KINDS for s in ("warm", "cold")})
    return replace(c, **changes)


def test_mttf_scales_linearly_from_llama3():
    # 54 days / 466 interruptions on 16,384 GPUs = 166.9 min; 8x the ranks: 1/8 of it.
    c = ettr.costs(ettr.Inputs(), 131_072, 12)
    assert c.mttf_s / 60 == pytest.approx(54 * 1440 / 466 / 8, rel=1e-9)
    assert c.mttf_s / 60 == pytest.approx(20.86, abs=0.01)
    assert c.nodes == 10_923
    assert ettr.costs(ettr.Inputs(), 16_384, 8).mttf_s / 60 == pytest.approx(166.9, abs=0.1)
    assert ettr.costs(ettr.Inputs(), 131_072, 12, mttf_min=14).mttf_s == pytest.approx(840)


def test_without_failures_ettr_is_one_minus_checkpoint_overhead():
    none = ettr.fixed_failures([])
    c = free(save_cost_s=3.0)
    disk = ettr.simulate(c, ettr.Policy("d", 600.0), none, 30 * DAY)
    assert disk.ettr == pytest.approx(600 / 603, rel=1e-12)
    assert disk.overhead == pytest.approx(3 / 603, rel=1e-12)
    both = ettr.simulate(c, ettr.Policy("m", 3600.0, 60.0), none, 30 * DAY)
    assert both.ettr == pytest.approx(1 / (1 + 3 / 3600 + 3 / 60), rel=1e-12)


def test_fixed_failures_lose_the_work_since_the_last_commit():
    # A failure every 1000 s, recovery 50 s, a save every 300 s that commits 20 s after it
    # starts, f = 1 + 3/300 = 1.01. The first segment trains 1000 s (990.1 progress s): the
    # save at 900 started at wall 909 and committed at 929, so it resumes at 900. Every later
    # segment trains 950 s (940.6 s of progress from a multiple of 300): the save at +900
    # starts at wall 909 and commits at 929 < 950, so each cycle keeps 900 s.
    c = free(save_cost_s=3.0, commit_s=20.0, detect_s={**ZERO, "kill_rank": 50.0})
    times = [1000.0 * n for n in range(1, 11)]
    out = ettr.simulate(c, ettr.Policy("d", 300.0), ettr.fixed_failures(times), 10_500.0)
    f = 1.01
    progress = 900 + 9 * 900 + (10_500 - 10_050) / f
    assert out.ettr == pytest.approx(progress / 10_500, rel=1e-12)
    assert out.lost_s == pytest.approx((1000 / f - 900) * f + 9 * (950 / f - 900) * f)
    assert out.down_s == pytest.approx(10 * 50.0)
    # With a 60 s commit the +900 save (committed at wall 969) still makes the first,
    # 1000 s segment, but is too late for the 950 s ones: each of those keeps 600 s only.
    late = ettr.simulate(replace(c, commit_s=60.0), ettr.Policy("d", 300.0),
                         ettr.fixed_failures(times), 10_500.0)
    assert late.ettr == pytest.approx((900 + 9 * 600 + 450 / f) / 10_500, rel=1e-12)


def test_poisson_lost_work_matches_its_expected_value():
    # Free recoveries, no save cost: the time X from a restart to the next failure is
    # exponential, and the work lost is X mod I. E[X mod I] = 1/l - I e^(-lI) / (1 - e^(-lI)).
    c = free(rate_per_s={**ZERO, "kill_rank": 1 / 1200.0})
    interval, lam = 600.0, 1 / 1200.0
    horizon = 400 * DAY
    fails = ettr.draw_failures(c, horizon, np.random.default_rng(7))
    out = ettr.simulate(c, ettr.Policy("d", interval), fails, horizon)
    expected = 1 / lam - interval * math.exp(-lam * interval) / (1 - math.exp(-lam * interval))
    assert out.failures > 25_000
    assert out.lost_s / out.failures == pytest.approx(expected, rel=0.02)
    assert expected < interval / 2 - 20  # the closed form, not I/2, is what is checked
    assert out.ettr == pytest.approx(1 - expected * lam, abs=0.01)


def test_young_daly_optimum_is_the_simulated_optimum():
    # Blocking saves of C = 60 s, MTTF 6 h, free restarts: the regime of the formula.
    c = free(save_cost_s=60.0, rate_per_s={**ZERO, "kill_rank": 1 / (6 * 3600.0)})
    tau = ettr.young_daly_s(c)
    assert tau == pytest.approx(math.sqrt(2 * 6 * 3600 * 60))
    horizon = 3000 * DAY
    fails = ettr.draw_failures(c, horizon, np.random.default_rng(3))
    at = {k: ettr.simulate(c, ettr.Policy("d", tau * k), fails, horizon).ettr
          for k in (0.5, 1.0, 2.0)}
    assert at[1.0] > at[0.5] + 0.01
    assert at[1.0] > at[2.0] + 0.01
    # and near the first order model: 1 - C/tau - tau/(2 MTTF)
    assert at[1.0] == pytest.approx(1 - 60 / tau - tau / (2 * 6 * 3600), abs=0.01)


def test_a_higher_failure_rate_lowers_ettr():
    i = ettr.Inputs()
    slow, fast = ettr.costs(i, 131_072, 12), ettr.costs(i, 131_072, 12, mttf_min=10)
    for c, expected_mttf in ((slow, 20.86), (fast, 10.0)):
        assert c.mttf_s / 60 == pytest.approx(expected_mttf, abs=0.01)
    p = ettr.Policy("m", 3600.0, slow.step_s)
    e = [statistics.mean(r.ettr for r in ettr.run_trials(c, [p], 10, 3, 0)["m"])
         for c in (slow, fast)]
    assert e[1] < e[0] - 0.02


def test_memory_snapshots_beat_every_stated_disk_interval():
    i = ettr.Inputs()
    c = ettr.costs(i, 131_072, 12)
    assert ettr.memory_interval_steps(c, i.snapshot_budget) == 1  # 0.138 s of a 7.7 s step
    results = ettr.run_trials(c, ettr.policies(c, i), 10, 3, 0)
    mean = {name: statistics.mean(r.ettr for r in rs) for name, rs in results.items()}
    memory = mean["memory every 1 step(s) + disk 60 min"]
    for minutes in (10, 30, 60, 120):
        assert memory > mean[f"disk every {minutes} min"] + 0.15
    assert memory > mean["  same, cold restarts"]  # warm restarts are worth something
    restores = results["memory every 1 step(s) + disk 60 min"][0]
    assert restores.memory_restores == restores.failures  # no buddy pair lost at 10,923 nodes


def test_a_snapshot_costs_the_loop_its_measured_wait_scaled_by_bytes():
    i = ettr.Inputs()
    c = ettr.costs(i, 131_072, 12)
    assert c.snapshot_s == pytest.approx(
        (i.snapshot_loop_s + i.snapshot_slowed_s) * c.shard_bytes / i.snapshot_bytes)
    assert c.snapshot_s < 0.02 * c.save_cost_s  # behind the step, not on it
    # Priced as a disk save was (its staging and slowed steps), a snapshot costs what it did.
    before = ettr.costs(replace(i, **ettr.SNAPSHOTS_BEFORE), 131_072, 12)
    assert before.snapshot_s == pytest.approx(before.save_cost_s, rel=1e-3)
    none = ettr.fixed_failures([])
    both = ettr.simulate(c, ettr.Policy("m", 3600.0, c.step_s), none, DAY)
    assert both.overhead == pytest.approx(
        1 - 1 / (1 + c.save_cost_s / 3600 + c.snapshot_s / c.step_s), rel=1e-9)


def test_memory_interval_is_the_most_frequent_within_budget():
    c = base(save_cost_s=0.5, step_s=5.0, replicate_s=1.0)
    assert ettr.memory_interval_steps(c, 0.02) == 5  # 0.5 / (5 x 5) = 2%
    assert ettr.memory_interval_steps(replace(c, replicate_s=31.0), 0.02) == 7


def test_losing_a_node_and_its_buddy_falls_back_to_disk():
    # Node 4 is lost at 1000 s; its buddy (5) holds the only copy of node 4's shard until the
    # first snapshot after the restart (at 1000 + 100 recovery + 60 s of steps) is replicated
    # 10 s later. Losing node 5 inside that window sends the job back to disk.
    c = free(detect_s={**ZERO, "kill_node": 100.0}, replicate_s=10.0)
    p = ettr.Policy("m", 600.0, 60.0)
    inside = ettr.fixed_failures([1000.0, 1150.0], "kill_node", [4, 5])
    out = ettr.simulate(c, p, inside, 2000.0)
    assert (out.fallbacks, out.memory_restores, out.disk_restores) == (1, 1, 1)
    # the second failure, 50 s into training from 960, goes back to the disk save at 600 s
    assert out.lost_s == pytest.approx((1000 - 960) + (960 + 50 - 600))
    after = ettr.simulate(c, p, ettr.fixed_failures([1000.0, 1175.0], "kill_node", [4, 5]),
                          2000.0)
    assert (after.fallbacks, after.memory_restores) == (0, 2)
    other = ettr.simulate(c, p, ettr.fixed_failures([1000.0, 1150.0], "kill_node", [4, 6]),
                          2000.0)
    assert other.fallbacks == 0


def test_a_failure_during_recovery_starts_it_over():
    c = free(detect_s={**ZERO, "kill_rank": 100.0})
    out = ettr.simulate(c, ettr.Policy("d", 600.0), ettr.fixed_failures([1000.0, 1030.0]),
                        2000.0)
    assert out.down_s == pytest.approx(30.0 + 100.0)
    assert out.ettr == pytest.approx((600 + (2000 - 1130)) / 2000)


def test_measured_figures_can_be_replaced(tmp_path):
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"decision_kill_rank_s": 1.5, "recovery_timeout_s": 5}))
    i = ettr.load_measured(ettr.Inputs(), path)
    c = ettr.costs(i, 131_072, 12)
    assert c.detect_s["kill_rank"] == pytest.approx(1.5 + 0.227)
    assert c.detect_s["freeze_rank"] == pytest.approx(3.06 - 5 + 30)
    path.write_text(json.dumps({"params": 2e12}))
    with pytest.raises(SystemExit, match="unknown key.*params"):
        ettr.load_measured(ettr.Inputs(), path)
    path.write_text(json.dumps({"save_bytes": "big"}))
    with pytest.raises(SystemExit, match="save_bytes must be numbers"):
        ettr.load_measured(ettr.Inputs(), path)


def test_main_prints_the_table_and_the_target_check(capsys):
    ettr.main(["--days", "2", "--trials", "2", "--ranks", "16384", "--ranks-per-node", "8"])
    out = capsys.readouterr().out
    assert "16,384 ranks on 2,048 nodes of 8" in out
    assert "failures every 166.9 min" in out
    assert "target: ETTR >= 97% with memory snapshots at 16,384 ranks" in out
    assert ">= 95% at MTTF 14 min: " in out
    with pytest.raises(SystemExit):
        ettr.main(["--days", "0"])
    assert "--days must be > 0" in capsys.readouterr().err


def test_the_process_restart_row_puts_that_modes_measured_time_after_the_same_decisions():
    i = ettr.Inputs()
    changes = ettr.process_restarts(i)
    assert changes == pytest.approx({
        "next_step_warm_kill_rank_s": i.decision_kill_rank_s + 0.92,
        "next_step_warm_kill_node_s": i.decision_kill_node_s + 0.72})
    base = ettr.costs(i, 131_072, 12)
    before = ettr.costs(replace(i, **changes), 131_072, 12)
    for kind, after in (("kill_rank", 0.92), ("kill_node", 0.72)):
        assert before.restart_s[kind, "warm"] - base.restart_s[kind, "warm"] == pytest.approx(
            after - (getattr(i, f"next_step_warm_{kind}_s") - getattr(i, f"decision_{kind}_s")))
