"""Loss spikes and divergence (optimus/stability.py): the rules over a trailing window, one by
one, then real training runs: a poisoned batch (the `spike` fault: random tokens for one step)
is caught on every rank at the same step; `skip_step` leaves the weights bit-equal to the step
before on every layout here and the audit accounts the step's samples as skipped; `warn`
trains on; a healthy run raises no alarm."""

from __future__ import annotations

import json
import random

import pytest
import torch
from test_moe import moe_job
from test_parallel_matrix import base_job

from optimus.config import validate_job
from optimus.config.schema import StabilityConfig
from optimus.data.audit import audit_run
from optimus.stability import StabilityWatch
from optimus.train import train


def watch(**cfg) -> StabilityWatch:
    return StabilityWatch(StabilityConfig(**{"warmup_steps": 0, "window": 10, **cfg}))


def feed(w: StabilityWatch, losses, norms=None, start: int = 1) -> list:
    norms = norms or [1.0] * len(losses)
    return [v for i, (loss, norm) in enumerate(zip(losses, norms, strict=True))
            if (v := w.judge(start + i, loss, norm)) is not None]


# --- the rules ---------------------------------------------------------------------------------

def test_a_noisy_flat_or_falling_loss_raises_nothing():
    rng = random.Random(7)
    flat = [2.0 + rng.gauss(0, 0.02) for _ in range(2000)]
    falling = [0.8 + 5 * 0.99 ** s + rng.gauss(0, 0.05) for s in range(2000)]
    norms = [abs(rng.gauss(1.0, 0.3)) + 0.1 for _ in range(2000)]
    for losses in (flat, falling):
        assert feed(watch(window=50, grad_ratio=10.0), losses, norms) == []


def test_a_loss_spike_is_named_with_its_threshold_and_kept_out_of_the_history():
    w = watch()
    assert feed(w, [2.0, 2.1] * 5) == []  # mean 2.05, std 0.05: band max(0.3, 0.205)
    (v,) = feed(w, [3.0], start=11)
    assert (v.kind, v.rule, v.step, v.action) == ("spike", "loss", 11, "skip_step")
    assert v.value == 3.0 and v.threshold == pytest.approx(2.05 + 0.3)
    assert list(w.losses) == [2.0, 2.1] * 5  # the spike did not widen the band
    assert v.message() == \
        "spike at step 11: the loss 3 > 2.35; the step's update is not applied"
    assert feed(w, [2.3], start=12) == []  # under the band


def test_the_relative_floor_keeps_a_flat_losss_noise_from_being_a_spike():
    w = watch(loss_sigma=6.0, loss_min_rise=0.1)
    assert feed(w, [2.0] * 9 + [2.0001]) == []  # std ~3e-5: 6 sigma is 2e-4
    assert feed(w, [2.19], start=11) == []  # inside 10% of the mean (2.2)
    w = watch(loss_sigma=6.0, loss_min_rise=0.1)
    feed(w, [2.0] * 9 + [2.0001])
    (v,) = feed(w, [2.21], start=11)
    assert v.rule == "loss" and v.threshold == pytest.approx(2.20001, abs=1e-4)


def test_a_gradient_norm_spike_is_judged_against_the_median():
    w = watch(grad_ratio=10.0, loss_sigma=0)
    assert feed(w, [2.0] * 10, [1.0] * 8 + [50.0, 50.0]) == []  # median 1.0
    (v,) = feed(w, [2.0], [10.5], start=11)
    assert (v.rule, v.threshold) == ("grad_norm", 10.0)
    assert feed(w, [2.0], [9.5], start=12) == []


def test_nothing_is_judged_before_the_warmup_and_a_full_window():
    w = watch(warmup_steps=20, window=10)
    assert feed(w, [2.0] * 19 + [50.0]) == []  # step 20: 19 steps of history
    w = watch(warmup_steps=20, window=10)
    assert [v.step for v in feed(w, [2.0] * 20 + [50.0])] == [21]
    w = watch(window=10)
    assert feed(w, [2.0] * 9 + [50.0]) == []  # 9 of 10


def test_spikes_every_step_become_divergence_and_the_history_starts_again():
    w = watch(max_skips=3)
    feed(w, [2.0] * 10)
    verdicts = feed(w, [4.0] * 5, start=11)
    assert [(v.kind, v.step) for v in verdicts] == [("spike", 11), ("spike", 12),
                                                    ("spike", 13), ("divergence", 14)]
    assert verdicts[-1].action == "warn"
    assert list(w.losses) == [4.0] and w.seen == 1  # the new level, from step 15


def test_a_sustained_rise_is_divergence_said_once_per_rise():
    w = watch(window=10, divergence_windows=3, divergence_min_rise=0.05, loss_sigma=0)
    rising = [2.0 + 0.004 * s for s in range(60)]  # +0.04 a window
    verdicts = feed(w, rising)
    assert [(v.kind, v.rule, v.step) for v in verdicts] == [("divergence", "trend", 40)]
    assert verdicts[0].value == pytest.approx(2.0 + 0.004 * 34.5)
    w = watch(window=10, divergence_windows=3, divergence_min_rise=0.05, loss_sigma=0)
    assert feed(w, [2.0 + 0.0004 * s for s in range(60)]) == []  # rises, by less than 5%


def test_off_is_off():
    w = watch(enabled=False)
    assert feed(w, [2.0] * 10 + [100.0]) == [] and not w.needs_loss
    assert not watch(loss_sigma=0, divergence_windows=0).needs_loss


def test_the_history_travels_as_json_and_junk_in_it_leaves_the_rules_to_warm_up():
    w = watch(window=10, warmup_steps=12)
    assert w.figures()["loss_threshold"] is None  # not armed
    feed(w, [2.0, 2.1] * 6)
    assert w.figures()["loss_threshold"] == pytest.approx(2.05 + 0.3)
    feed(w, [9.0], start=13)
    assert {k: w.figures()[k] for k in ("spikes", "divergences", "skipped_steps")} == \
        {"spikes": 1, "divergences": 0, "skipped_steps": 1}
    again = watch(window=10, warmup_steps=12)
    again.load_state_dict(w.state_dict())  # as a checkpoint or a snapshot brings it back
    assert again.figures() == w.figures()
    assert [v.step for v in feed(again, [9.0], start=14)] == [14]  # judged at once
    for junk in ("not json", '{"losses": "x"}', '{"losses": [1e999], "norms": []}', "[]"):
        fresh = watch(window=10, warmup_steps=12)
        fresh.load_state_dict({"history": junk})
        assert fresh.seen == 0 and fresh.figures()["spikes"] == 0
        assert feed(fresh, [9.0]) == []  # warming up again


def test_a_rewind_with_no_point_to_go_back_to_is_refused():
    raw = {**base_job(), "stability": {"on_spike": "rewind"},
           "checkpoint": {"interval": 0, "memory_every": 0}}
    with pytest.raises(ValueError, match="stability.on_spike: rewind goes back to a checkpoint"):
        validate_job(raw)
    validate_job({**raw, "checkpoint": {"interval": 10, "memory_every": 0}})


def test_a_spike_fault_takes_no_rank():
    with pytest.raises(ValueError, match="poisons the whole step"):
        validate_job({**base_job(), "fault_injection": {"faults": [
            {"kind": "spike", "step": 3, "rank": 0}]}})


# --- training ----------------------------------------------------------------------------------

SPIKE = 16  # the poisoned step; the rules are armed from step 11


def job(kind: str = "dense", steps: int = SPIKE, action: str = "skip_step", spike: bool = True,
        **parallel) -> dict:
    raw = base_job() if kind == "dense" else moe_job()
    raw["optim"].update(steps=steps, lr=3e-3, min_lr=3e-3)  # the same rates, however long
    raw["parallel"].update(**parallel)
    raw["supervision"] = {"log_every": 1}
    raw["stability"] = {"warmup_steps": 10, "window": 8, "on_spike": action, "grad_ratio": 10.0}
    raw["fault_injection"] = {"faults": [{"kind": "spike", "step": SPIKE}] if spike else []}
    return raw


def _train(rank: int, world_size: int, raw: dict, run_dir: str) -> dict:
    raw = {**raw, "run_dir": run_dir}
    result = train(validate_job(raw, world=world_size), keep_state=True, quiet=rank > 0)
    return {"losses": result.losses, "state": result.state}


def _events(run_dir) -> list[dict]:
    lines = [json.loads(t) for t in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e for e in lines if e.get("event") == "stability"]


@pytest.mark.parametrize("world,kind,parallel", [
    (1, "dense", {}), (2, "dense", {"pp": 2, "schedule": "1f1b"}), (2, "moe", {"ep": 2}),
], ids=["one-process", "PP2", "moe-EP2xDP2"])
def test_skip_step_leaves_the_weights_as_the_step_before_and_the_audit_says_skipped(
        run_ranks, tmp_path, world, kind, parallel):
    before = run_ranks(_train, world, job(kind, SPIKE - 1, **parallel), str(tmp_path / "a"),
                       timeout=240)[0]
    skipped = run_ranks(_train, world, job(kind, **parallel), str(tmp_path / "b"),
                        timeout=240)[0]
    assert skipped["losses"][:SPIKE - 1] == before["losses"]
    assert skipped["losses"][-1] > 1.5 * max(before["losses"][-5:])  # a real spike
    for name, value in before["state"].items():
        assert torch.equal(skipped["state"][name], value), name
    (event,) = _events(tmp_path / "b")
    assert (event["step"], event["verdict"], event["action"]) == (SPIKE, "spike", "skip_step")
    assert event["samples"]["start"] == (SPIKE - 1) * 8 and event["samples"]["end"] == SPIKE * 8
    audit = audit_run(tmp_path / "b")
    assert audit.ok and audit.skipped == [SPIKE]
    assert any(f"step {SPIKE}" in n and "[120, 128)" in n for n in audit.notes), audit.notes


def test_warn_trains_on_the_spike(run_ranks, tmp_path):
    before = run_ranks(_train, 1, job(steps=SPIKE - 1), str(tmp_path / "a"), timeout=240)[0]
    warned = run_ranks(_train, 1, job(action="warn"), str(tmp_path / "b"), timeout=240)[0]
    (event,) = _events(tmp_path / "b")
    assert event["action"] == "warn" and event["rule"] in ("loss", "grad_norm")
    changed = [n for n, v in before["state"].items() if not torch.equal(warned["state"][n], v)]
    assert changed  # the poisoned batch's update was applied
    assert audit_run(tmp_path / "b").skipped == []


def test_a_resumed_run_judges_at_once_with_the_history_its_checkpoint_carried(run_ranks,
                                                                             tmp_path):
    """Step 12 is saved; the run resumed from it judges step 16 (3 steps after the resume,
    far short of the warm-up of 10) with the history the checkpoint carried."""
    raw = job(steps=12, spike=False)
    raw["checkpoint"] = {"interval": 12}
    run_ranks(_train, 1, raw, str(tmp_path), timeout=240)
    raw = job()
    raw["checkpoint"] = {"interval": 12}
    run_ranks(_train, 1, raw, str(tmp_path), timeout=240)
    lines = [json.loads(t) for t in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines if e.get("event") == "resume"] == [12]
    (event,) = _events(tmp_path)
    assert (event["step"], event["verdict"]) == (SPIKE, "spike")


def test_without_a_controller_a_rewind_stops_the_rank_with_90_and_says_how(tmp_path):
    import os
    import subprocess
    import sys

    import yaml

    raw = job()
    raw.update(run_dir=str(tmp_path / "run"), checkpoint={"interval": 5})
    raw["stability"]["on_spike"] = "rewind"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    out = subprocess.run([sys.executable, "-m", "optimus", "train", str(tmp_path / "job.yaml")],
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if not k.startswith("OPTIMUS_")})
    assert out.returncode == 90, out.stderr[-2000:]
    (line,) = [t for t in out.stdout.splitlines() if t.startswith("rewind-request ")]
    assert json.loads(line.removeprefix("rewind-request "))["step"] == SPIKE
    assert f"error: spike at step {SPIKE}" in out.stderr and "OPTIMUS_SKIP_STEPS" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_healthy_run_raises_no_alarm_over_500_steps_with_the_defaults(run_ranks, tmp_path):
    raw = base_job()
    raw["optim"].update(steps=500, lr=3e-3, warmup_steps=20)
    raw["data"].update(microbatches=1)
    raw["supervision"] = {"log_every": 50}
    run_ranks(_train, 1, raw, str(tmp_path), timeout=600)
    assert _events(tmp_path) == []


def test_skip_windows_read_only_well_formed_windows():
    from optimus.stability import skip_windows
    assert skip_windows("14-16,3-3") == [(3, 3), (14, 16)]
    assert skip_windows("") == skip_windows("x,5-2,0-3,-1-4,7") == []


def _train_skipping(rank: int, world_size: int, raw: dict, run_dir: str) -> list[float]:
    import os

    os.environ["OPTIMUS_SKIP_STEPS"] = "5-6"  # as the agent passes a rewind's window on
    return _train(rank, world_size, raw, run_dir)["losses"]


def test_a_skip_window_reads_on_after_its_batches_and_the_audit_accepts_the_gap(run_ranks,
                                                                                tmp_path):
    run_ranks(_train_skipping, 1, job(steps=8, spike=False), str(tmp_path), timeout=240)
    lines = [json.loads(t) for t in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (skip,) = [e for e in lines if e.get("event") == "data_skip"]
    assert (skip["step"], skip["start"], skip["end"]) == (5, 32, 48)
    reads = {m["step"]: m["data"] for m in lines if "loss" in m}
    assert reads[4]["end"] == 32 and reads[5]["start"] == 48 and reads[8]["end"] == 80
    audit = audit_run(tmp_path)
    assert audit.ok and audit.unread == [(32, 48)], audit.problems


def test_after_a_window_the_learning_rate_is_lowered_for_the_steps_asked(run_ranks, tmp_path):
    raw = job(steps=8, spike=False)
    raw["stability"].update(rewind_lr_factor=0.5, rewind_lr_steps=2)
    run_ranks(_train_skipping, 1, raw, str(tmp_path), timeout=240)
    lines = [json.loads(t) for t in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = {m["step"]: m["lr"] for m in lines if "lr" in m}
    assert [lrs[s] for s in (4, 5, 6, 7)] == [3e-3, 1.5e-3, 1.5e-3, 3e-3]
