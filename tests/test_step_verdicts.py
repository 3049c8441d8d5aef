"""What holds an update back is decided on the device, before the update, and read later: the
device's decision and the host's verdict on the same figures are the same, edge included."""

import json

import pytest
import torch

from optimus.config import validate_job
from optimus.config.schema import StabilityConfig
from optimus.data.audit import audit_run
from optimus.stability import StabilityWatch
from optimus.step import Limits, hold_back
from optimus.supervision.exits import NonFinite
from optimus.train import train


def _held(loss: float, norm: float, limits: Limits) -> bool:
    return bool(hold_back(torch.tensor(loss), torch.tensor(norm), limits))


@pytest.mark.parametrize("norm", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_norm_holds_the_update_back_whatever_the_rules(norm):
    assert _held(1.0, norm, Limits())


def test_the_device_compares_as_the_host_does_at_the_threshold_itself():
    """float32 figures against float64 thresholds: the device's comparison is the host's
    (stability.py `_spike`: float(value) > threshold), not float32's rounding of it."""
    x = float(torch.tensor(2.3456789))  # the float32 value the host reads
    assert not _held(x, 1.0, Limits(loss=x))  # equal: not above
    below = x - 1e-12  # rounds to x in float32: a float32 comparison would say "not above"
    assert float(torch.tensor(below)) == x
    assert _held(x, 1.0, Limits(loss=below)) == (x > below) is True
    assert _held(1.0, x, Limits(grad_norm=below)) and not _held(1.0, x, Limits(grad_norm=x))
    assert _held(float("nan"), 1.0, Limits(loss=5.0))  # the loss rule calls NaN a spike
    assert not _held(float("nan"), 1.0, Limits(grad_norm=5.0))  # the norm rule alone does not


def _armed(**cfg) -> StabilityWatch:
    watch = StabilityWatch(StabilityConfig(warmup_steps=0, window=4, **cfg))
    for step, (loss, norm) in enumerate([(2.0, 1.0), (2.1, 1.1), (1.9, 0.9), (2.0, 1.0)], 1):
        assert watch.judge(step, loss, norm) is None
    return watch


def test_the_limits_are_the_rules_thresholds_where_a_verdict_would_hold_the_update_back():
    watch = _armed(grad_ratio=10.0)
    loss, grad = watch.holds_back()
    assert (loss, grad) == watch._thresholds() and loss is not None and grad == 10.0
    # What the device holds back is what the verdict on the same figures says.
    for value in (loss - 1e-6, loss, loss + 1e-6, 100.0):
        value = float(torch.tensor(value))  # the float32 figure both sides read
        verdict = _armed(grad_ratio=10.0).judge(5, value, 1.0)
        held = _held(value, 1.0, Limits(loss, grad))
        assert held == (verdict is not None and verdict.action == "skip_step"), value
    assert _armed(on_spike="warn").holds_back() == (None, None)  # a warning holds nothing
    assert _armed(on_spike="rewind").holds_back()[0] is not None  # a rewind stops before it
    assert StabilityWatch(StabilityConfig()).holds_back() == (None, None)  # not armed yet


def test_the_spike_after_max_skips_in_a_row_is_a_divergence_and_holds_back_by_its_action():
    watch = _armed(max_skips=2)
    for step in (5, 6):
        assert watch.holds_back()[0] is not None
        assert watch.judge(step, 50.0, 1.0).action == "skip_step"
    assert watch.holds_back() == (None, None)  # the third: a divergence, on_divergence warn
    assert watch.judge(7, 50.0, 1.0).kind == "divergence"
    watch = _armed(max_skips=1, on_divergence="rewind")
    watch.judge(5, 50.0, 1.0)
    assert watch.holds_back()[0] is not None  # the divergence rewinds: held back too


def _job(tmp_path, steps: int, log_every: int, faults=(), **stability) -> object:
    return validate_job({
        "name": "verdicts", "run_dir": str(tmp_path),
        "model": {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1,
                  "max_seq_len": 32},
        "optim": {"steps": steps, "lr": 3e-3, "min_lr": 3e-3, "warmup_steps": 2},
        "data": {"source": "synthetic", "seq_len": 32, "batch_size": 4, "microbatches": 2},
        "checkpoint": {"interval": 0}, "eval": {"every": 0},
        "supervision": {"log_every": log_every}, "parallel": {"device": "cpu"},
        "stability": {"warmup_steps": 6, "window": 4, "grad_ratio": 10.0, **stability},
        "fault_injection": {"faults": list(faults)}}, world=1)


def test_a_spike_at_an_unlogged_step_is_held_back_as_at_a_logged_one(tmp_path):
    """The spike's step (12) is read inside step 13 when unlogged; the update of 12 was held
    back on the device all the same: the weights at the end equal those of a run that read
    every step at its own boundary, and both say the same verdict at the same step."""
    spike = [{"kind": "spike", "step": 12}]
    every = train(_job(tmp_path / "a", 16, 1, spike), keep_state=True)
    later = train(_job(tmp_path / "b", 16, 5, spike), keep_state=True)
    for name, value in every.state.items():
        assert torch.equal(later.state[name], value), name
    for run in ("a", "b"):
        lines = [json.loads(t) for t in (tmp_path / run / "metrics.jsonl").read_text()
                 .splitlines()]
        (event,) = [e for e in lines if e.get("event") == "stability"]
        assert (event["step"], event["action"]) == (12, "skip_step")
        assert audit_run(tmp_path / run).skipped == [12]
    clean = train(_job(tmp_path / "c", 16, 5), keep_state=True)
    assert any(not torch.equal(clean.state[n], v) for n, v in later.state.items())


def test_nan_at_an_unlogged_step_names_that_step_and_this_tile(tmp_path):
    """NaN at step 7 (unlogged): its update is held back on the device, the rank reads it
    inside step 8, before step 8's update, and exits naming step 7 and its own values."""
    nan = [{"kind": "nan_rank", "rank": 0, "step": 7}]
    with pytest.raises(NonFinite) as caught:
        train(_job(tmp_path, 12, 5, nan))
    assert caught.value.step == 7 and caught.value.local
    assert "local loss nan, local gradients NaN/Inf" in str(caught.value)
    lines = [json.loads(t) for t in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(m["step"] for m in lines if "step" in m and "event" not in m) == 6


def test_the_figures_travel_through_two_reused_buffers_read_after_the_step_moved_on():
    """The readback copies each step's figures into one of two host buffers in turn: a step's
    figures read after the next step's copy started are still its own, and no buffer is
    allocated per step."""
    from optimus.step import Readback

    readback = Readback(torch.device("cpu"))
    figures = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    first = readback.start(figures)
    figures.add_(10)  # the device tensor is reused or freed: the copy is what counts
    second = readback.start(figures)
    assert first.read() == [1.0, 2.0, 3.0] and second.read() == [11.0, 12.0, 13.0]
    third = readback.start(figures * 2)
    assert third.host.data_ptr() == first.host.data_ptr() != second.host.data_ptr()
    assert third.read() == [22.0, 24.0, 26.0] and first.event is None  # no event on a CPU
