"""The planner on today's hardware (issue 32, part 1): calibrated H100 and Max 1550, the
float32 loss counted in bf16, the allocator headroom, op-level recompute priced, and fix advice
the planner has checked.

Pure arithmetic but for the loss's measurement (one process, no ranks); a few seconds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from optimus.config import validate_job
from optimus.planner.machines import get_machine
from optimus.planner.memory import LOSS, PlanLayout, rank_memory, shape_of
from optimus.planner.steptime import op_recompute_bytes, selective_share, step_time
from optimus.runtime.dims import ParallelDims

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.planner_calibration import LLAMA3_8B, RUNS, predict  # noqa: E402

# What the calibrated model predicts for every run of bench/planner_calibration.py (its unit:
# tokens/s or TFLOP/s per device), beside the published figure in RUNS. The first two are the
# calibration runs; docs/planner-checks.md has the table and why the misses miss.
PREDICTED = {  # predicted, and its error against the published figure
    "Llama 3.1 8B, FSDP 8, op recompute": 5757,  # -0.1%
    "GPT 175B, tp 8 x pp 12 x dp 16": 29.7,  # -0.3%
    "Llama 3.1 8B, FSDP 128, op recompute": 5686,  # +1.4%
    "Llama 3 8B, FSDP 64, op recompute": 3077,  # +3.5%
    "Llama 3 8B, FSDP 64, selective (every 2nd block)": 2940,  # +1.3%
    "Llama 3 70B, FSDP 64, full recompute": 318,  # -3.9%
    "Llama 2 13B, FSDP 64, no recompute": 1899,  # -12.2%
    "Llama 2 13B, FSDP 64, selective (every 2nd block)": 1894,  # -1.1%
    "Llama 2 13B, FSDP 64, op recompute": 1887,  # -0.9%
    "Llama 2 70B, FSDP 64, op recompute": 187.2,  # -47.3%
    "Llama 2 70B, FSDP 64, full recompute": 343.4,  # -2.7%
    "GPT 175B, tp 8 x pp 12 x dp 16 (PTD)": 150.9,  # +7.0%
    "GPT 175B, ZeRO-3 on 384, microbatch 4": 204.6,  # +42.1%
    "GPT 175B, ZeRO-3 on 768, microbatch 2": 102.7,  # +16.7%
    "GPT 175B, ZeRO-3 on 1536, microbatch 1": 50.47,  # +14.7%
}


def test_calibrated_runs_land_on_their_figures_and_the_checks_are_pinned():
    assert [r.name for r in RUNS] == list(PREDICTED)
    for run in RUNS:
        got, _ = predict(run)
        assert got == pytest.approx(PREDICTED[run.name], rel=0.005), run.name
        if run.calibrates:  # the one run per device the factor was set from
            assert got == pytest.approx(run.published, rel=0.005), run.name
    # the checks the calibration did not see: within 15% but for the rows
    # docs/planner-checks.md explains (Llama 2 70B op: FSDP exposed on HDR; ZeRO-3 on 384
    # and 768 GPUs: the bandwidth DeepSpeed reached in 2021, not the overlap)
    misses = {r.name for r in RUNS if abs(predict(r)[0] / r.published - 1) > 0.15}
    assert misses == {"Llama 2 70B, FSDP 64, op recompute",
                      "GPT 175B, ZeRO-3 on 384, microbatch 4",
                      "GPT 175B, ZeRO-3 on 768, microbatch 2"}


def test_h100_over_a100_is_no_longer_three_times():
    """Uncalibrated, the H100 (sustained 0.62) came out 2.9x an A100 on the same layout;
    published runs show ~1.9x."""
    cfg = validate_job({"name": "l8", "model": LLAMA3_8B,
                        "data": {"seq_len": 8192, "batch_size": 16}}).model
    lay = PlanLayout(ParallelDims(dp=8), microbatch_size=2, seq_len=8192, recompute="op")
    h100, a100 = (step_time(cfg, lay, get_machine(n), 16).tokens_per_s_per_device
                  for n in ("h100-ndr", "a100-hdr"))
    assert h100 / a100 == pytest.approx(1.65, abs=0.02)
    assert get_machine("max1550-aurora").sustained == get_machine("max1550-supermuc").sustained


def test_the_loss_is_float32_in_bf16_as_the_model_counts():
    """The loss upcasts bf16 logits: its peak is 12 bytes per vocabulary entry per token in
    bf16 as in fp32 (measured here), which the model counts (`LOSS`), not 3 x 2."""
    from optimus.parallel.loss import TokenSumLoss
    from optimus.planner.measure import PeakMemory

    tokens, vocab, dim = 256, 4096, 32
    for dtype in (torch.bfloat16, torch.float32):
        hidden = torch.randn(tokens, dim, dtype=dtype, requires_grad=True)
        head = torch.randn(vocab, dim, dtype=dtype, requires_grad=True)
        labels = torch.randint(0, vocab, (1, tokens))
        loss = TokenSumLoss()
        loss.tokens = tokens
        with PeakMemory() as memory:
            memory.track([hidden, head, labels])
            before = memory.current
            logits = (hidden @ head.t()).unsqueeze(0)
            value = loss(logits, labels)
            del logits
            value.backward()
        assert (memory.peak - before) / (tokens * vocab) == pytest.approx(LOSS, rel=0.01)
    # the model: the last stage's logits term in bf16 is the head's input (bf16) and 12 bytes
    # per vocabulary entry; in fp32 the same 12
    cfg = validate_job({"name": "x", "model": LLAMA3_8B,
                        "data": {"seq_len": 8192, "batch_size": 1}}).model
    lay = PlanLayout(seq_len=8192, recompute="full")
    bf16, fp32 = (rank_memory(cfg, PlanLayout(seq_len=8192, recompute="full", precision=p))
                  for p in ("bf16", "fp32"))
    assert bf16.logits == pytest.approx((4096 * 2 + 12 * 128256) * 8192)
    assert fp32.logits - bf16.logits == pytest.approx(4096 * 2 * 8192)
    # ~+5.9 GiB over the old 3 x 2 bytes on an 8B model's 8,192-token microbatch
    assert (bf16.logits - (4096 + 3 * 128256) * 2 * 8192) / 2**30 == pytest.approx(5.87, abs=0.01)
    assert lay.z_loss is False


def test_op_recompute_is_priced_and_selective_follows_ac_every():
    cfg = validate_job({"name": "x", "model": LLAMA3_8B,
                        "data": {"seq_len": 8192, "batch_size": 2}}).model
    h100 = get_machine("h100-ndr")
    op = PlanLayout(microbatch_size=2, seq_len=8192, recompute="op")
    t = step_time(cfg, op, h100, 2)
    # what a block keeps without recompute less what op keeps (memory.py's table), read and
    # written once in bf16, over 32 layers, at 3,350 GB/s
    d, kv, f, h = 4096, 1024, 14336, 32
    none = 2 * d + 6 * d + 2 * kv + 4 * f + (h + 2)
    kept = 3 * d + 2 * d + 2 * kv + h + 2 * f
    assert op_recompute_bytes(shape_of(cfg), op) == pytest.approx(2 * 2 * 32 * (none - kept))
    assert t.recompute_s == pytest.approx(2 * 8192 * 2 * 2 * 32 * (none - kept) / 3350e9)
    assert t.recompute_s > 0 and t.compute == step_time(
        cfg, PlanLayout(microbatch_size=2, seq_len=8192), h100, 2).compute
    # selective: blocks 0, 3, ..., 30 of 32 with ac_every 3; every other one by default
    assert selective_share(cfg, PlanLayout(recompute="selective", ac_every=3)) == 11 / 32
    assert selective_share(cfg, PlanLayout(recompute="selective")) == 0.5
    every3 = step_time(cfg, PlanLayout(microbatch_size=2, seq_len=8192, recompute="selective",
                                       ac_every=3), h100, 2)
    every2 = step_time(cfg, PlanLayout(microbatch_size=2, seq_len=8192, recompute="selective"),
                       h100, 2)
    assert every3.total < every2.total


def _cli(*args: str):
    from click.testing import CliRunner

    from optimus.cli import main

    return CliRunner().invoke(main, list(args))


def test_headroom_is_kept_shown_and_used_to_decide_what_fits():
    a100 = get_machine("a100-hdr")
    assert a100.usable_gib == 76.0 and get_machine("cpu").usable_gib == 16.0
    run = _cli("plan", "jobs/gpt-1.3b.yaml", "--devices", "32", "--machine", "a100-hdr",
               "-o", "json", "--top", "100")
    answer = json.loads(run.output)
    assert answer["capacity_gib"] == 76.0 and answer["headroom_gib"] == 4.0
    assert all(c["memory_gib"] <= 76.0 for c in answer["layouts"])
    whole = json.loads(_cli("plan", "jobs/gpt-1.3b.yaml", "--devices", "32", "--machine",
                            "a100-hdr", "--memory-gib", "80", "-o", "json").output)
    assert whole["fit"] > answer["fit"]  # layouts between 76 and 80 GiB no longer "fit"
    ok = _cli("config", "check", "jobs/gpt-1.3b.yaml", "--world", "32", "--machine", "a100-hdr")
    assert ok.exit_code == 0, ok.output
    assert "of 76 GiB on a100-hdr (80 GiB less 4 of headroom)" in ok.output


def test_fix_advice_for_accumulated_gradients_is_checked_not_more_devices():
    """1.3B, full recompute, 16 microbatches: the largest term is FSDP2's unsharded gradients,
    which more devices do not shrink. The advice names only changes that fit, by the model."""
    base = ("config", "check", "jobs/gpt-1.3b.yaml", "--world", "32", "--set",
            "parallel.activation_checkpoint=full")
    for memory, extra, fixes in (
            ("4", ["data.microbatches=16"], ["parallel.tp: 4 (dp 8)"]),
            ("5", ["data.microbatches=2", "data.batch_size=64"],
             ["data.microbatches: 1", "parallel.tp: 2 (dp 16)"])):
        sets = [a for x in extra for a in ("--set", x)]
        refused = _cli(*base, *sets, "--memory-gib", memory)
        assert refused.exit_code == 2
        assert "gradients 2.8 GiB" in refused.output and "devices" not in refused.output
        assert refused.output.strip().endswith("fix: " + " or ".join(fixes))
        for fix in fixes:  # each one, applied, passes the same check
            key, value = fix.split(" (")[0].split(": ")
            dp = ["--set", "parallel.dp=" + fix.split("(dp ")[1][:-1]] if "(dp" in fix else []
            applied = _cli(*base, *sets, "--set", f"{key}={value}", *dp, "--memory-gib", memory)
            assert applied.exit_code == 0, (fix, applied.output)


def test_fsdp_overlap_shows_the_first_gather_the_last_reduce_and_each_units_excess():
    from optimus.planner.steptime import _passes, fsdp_exposed

    two = _passes(PlanLayout(ParallelDims(dp=4), microbatches=2))
    assert two == [(2, True, True, False), (1, False, True, False), (1, False, True, True)]
    # every unit's traffic hides under its compute: the first gathers and the last
    # reduce-scatter show all the same (4 gathers of 0.5, one reduce-scatter of 0.8)
    assert fsdp_exposed(1.0, 2.0, 10, 0.5, 0.8, two) == pytest.approx(2.8)
    # gathers of 1.5 against forwards of 1.0: 9 units show 0.5 each, in each forward pass;
    # the last backward carries 2.3 against 2.0
    assert fsdp_exposed(1.0, 2.0, 10, 1.5, 0.8, two) == pytest.approx(
        2 * (1.5 + 9 * 0.5) + 1.5 + (1.5 + 0.8 + 9 * 0.3))
    # kept gathered: one gather pass, one reduce-scatter pass
    kept = _passes(PlanLayout(ParallelDims(dp=4), microbatches=2, param_gather="step"))
    assert fsdp_exposed(1.0, 2.0, 10, 0.5, 0.8, kept) == pytest.approx(1.3)
    # seed 001's ZeRO-3 on 384 A100s: the old model hid all of it; now the first gathers and
    # the last reduce-scatter show
    zero3 = next(r for r in RUNS if r.name == "GPT 175B, ZeRO-3 on 384, microbatch 4")
    _, t = predict(zero3)
    assert 0.3 < t.dp_exposed < 1.0 and t.dp_exposed / t.total < 0.02


def test_more_devices_is_named_only_with_a_count_the_model_checked():
    base = ("config", "check", "jobs/gpt-1.3b.yaml", "--set",
            "parallel.activation_checkpoint=full", "--set", "data.microbatches=64")
    refused = _cli(*base, "--world", "8", "--set", "parallel.dp=8", "--memory-gib", "3")
    assert refused.exit_code == 2 and "gradients 3.3 GiB" in refused.output
    assert "fix: 512 devices (a larger dp shards the state" in refused.output
    # 512 replicas of one sequence: one microbatch, each gradient reduce-scattered when made
    grown = _cli(*base[:-2], "--set", "data.microbatches=1", "--world", "512", "--set",
                 "parallel.dp=512", "--memory-gib", "3")
    assert grown.exit_code == 0, grown.output
    hopeless = _cli(*base, "--world", "8", "--set", "parallel.dp=8", "--memory-gib", "2")
    assert "none of the changes the planner tries fits" in hopeless.output
