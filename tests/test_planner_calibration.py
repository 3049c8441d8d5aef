"""The planner against every run it is checked on (issue 61): the error table, the targets it
meets and the misses it names; the machines and stacks behind it; and the rest of issue 32's
calibration work (the float32 loss counted in bf16, the allocator headroom, op-level recompute
priced, fix advice the planner has checked).

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
from bench.planner_calibration import LLAMA3_8B, RUNS, machines, predict  # noqa: E402

# The error table (docs/planner.md prints it, with sources): what the model predicts for every
# run of bench/planner_runs.py, in its unit (tokens/s or TFLOP/s per device), and its error
# against the published (or, for our own runs, measured) figure.
PREDICTED = {
    # calibration: one run per machine sets its sustained
    "Mula-1B, 1 H200, compiled, the plain loop": 69293,  # -0.0%
    "Llama 3.1 8B, FSDP 8, op recompute": 5759,  # -0.1%
    "GPT 175B, tp 8 x pp 12 x dp 16": 29.82,  # +0.1%
    "GPT 1008B, tp 8 x pp 64 on 3072": 163.0,  # +0.0%
    # our own runs: the element-wise model's check; where Optimus's stack factor comes from
    "Mula-1B, 1 H200, eager, the plain loop": 57076,  # +10.9%
    "Mula-1B, 1 H200, compiled, optimus": 56682,  # +1.4%
    "Mula-1B, 1 H200, eager, optimus": 53309,  # +11.0%
    # Megatron-core, DGX H100: on h100-ndr, the H200's sustained
    "Llama 3 70B, tp 4 x pp 4 x cp 2, v 5, 64 H100": 959.2,  # -0.6%
    "Mixtral 8x7B, ep 8 x pp 4, v 8, 64 H100": 479.3,  # +2.4%
    # torchtitan, Grand Teton H100 (500 W)
    "Llama 3.1 8B, FSDP 8, op recompute, compiled": 6444,  # -3.4%
    "Llama 3.1 8B, FSDP 128, op recompute": 5688,  # +1.5%
    "Llama 3.1 8B, FSDP 8 x cp 1 at 32,768, full, compiled + float8": 3041,  # -21.8%
    "Llama 3.1 8B, FSDP 4 x cp 2 at 65,536, full, compiled + float8": 1991,  # -21.6%
    "Llama 3.1 8B, FSDP 2 x cp 4 at 131,072, full, compiled + float8": 1182,  # +10.4%
    "Llama 3.1 8B, FSDP 1 x cp 8 at 262,144, full, compiled + float8": 652.9,  # +19.1%
    # torchtitan, A100 (2024)
    "Llama 3 8B, FSDP 64, op recompute": 2995,  # +0.7%
    "Llama 3 8B, FSDP 64, selective (every 2nd block)": 2708,  # -6.7%
    "Llama 3 70B, FSDP 64, full recompute": 305.8,  # -7.6%
    "Llama 2 13B, FSDP 64, no recompute": 1843,  # -14.8%
    "Llama 2 13B, FSDP 64, selective (every 2nd block)": 1773,  # -7.4%
    "Llama 2 13B, FSDP 64, op recompute": 1832,  # -3.8%
    "Llama 2 70B, FSDP 64, op recompute": 187.1,  # -47.3%
    "Llama 2 70B, FSDP 64, full recompute": 328.8,  # -6.8%
    # seed 001 (Megatron-LM 2021, A100): Table 2, then Table 1
    "GPT 175B, tp 8 x pp 12 x dp 16 (PTD)": 151.8,  # +7.7%
    "GPT 175B, ZeRO-3 on 384, microbatch 4": 205.7,  # +42.9%
    "GPT 175B, ZeRO-3 on 768, microbatch 2": 102.7,  # +16.7%
    "GPT 175B, ZeRO-3 on 1536, microbatch 1": 50.47,  # +14.7%
    "GPT 1.7B, tp 1 x pp 1 on 32": 166.9,  # +21.8%
    "GPT 3.6B, tp 2 x pp 1 on 64": 157.2,  # +13.9%
    "GPT 7.5B, tp 4 x pp 1 on 128": 143.5,  # +1.0%
    "GPT 18.4B, tp 8 x pp 1 on 256": 134.6,  # -0.3%
    "GPT 39.1B, tp 8 x pp 2 on 512": 146.4,  # +6.1%
    "GPT 76.1B, tp 8 x pp 4 on 1024": 152.8,  # +9.1%
    "GPT 145.6B, tp 8 x pp 8 on 1536": 158.1,  # +6.9%
    "GPT 310.1B, tp 8 x pp 16 on 1920": 164.0,  # +5.8%
    "GPT 529.6B, tp 8 x pp 35 on 2520": 163.4,  # +0.2%
}
# The checks outside the 20% target, and why (docs/planner.md): each needs what the model
# does not have yet, not a factor fitted to it.
MISSES = {
    # FSDP's gathers of 70B parameters at the profile's 25 GB/s per GPU, exposed; torchtitan's
    # network is not given
    "Llama 2 70B, FSDP 64, op recompute",
    # the bandwidth DeepSpeed's ZeRO-3 reached in 2021 over 48 nodes, not the overlap
    "GPT 175B, ZeRO-3 on 384, microbatch 4",
    # Megatron-LM 2021 materialised the attention scores: memory-bound work not priced
    "GPT 1.7B, tp 1 x pp 1 on 32",
    # float8 matmuls, which the model prices only from a GEMM sweep's float8 rates
    "Llama 3.1 8B, FSDP 8 x cp 1 at 32,768, full, compiled + float8",
    "Llama 3.1 8B, FSDP 4 x cp 2 at 65,536, full, compiled + float8",
}


def test_the_error_table_is_pinned_and_meets_its_targets():
    assert [r.name for r in RUNS] == list(PREDICTED)
    errors = {}
    for run in RUNS:
        got, _ = predict(run)
        assert got == pytest.approx(PREDICTED[run.name], rel=0.003), run.name
        errors[run.name] = got / run.published - 1
    calibration = [r.name for r in RUNS if r.use == "calibrates"]
    checks = [r.name for r in RUNS if not r.use]
    # one calibration run per machine, each within 15% (the bisection lands within 0.5%)
    assert sorted(r.machine for r in RUNS if r.use == "calibrates") == [
        "a100-hdr", "h100-gt500", "h200", "max1550-supermuc"]
    assert all(abs(errors[n]) < 0.005 for n in calibration)
    # every check within 20% but the misses named above
    assert {n for n in checks if abs(errors[n]) > 0.20} == MISSES
    # the pair the issue names: the 70B and the 8B on the same die, Megatron's 70B on the
    # H200's calibration within 1%; and the Mixtral within 3%
    assert abs(errors["Llama 3 70B, tp 4 x pp 4 x cp 2, v 5, 64 H100"]) < 0.01
    assert abs(errors["Mixtral 8x7B, ep 8 x pp 4, v 8, 64 H100"]) < 0.03
    # the element-wise model, checked on two compile speed-ups it was not set from: ours
    # (the plain loop eager, +10.9%: it under-counts the eager step) and torchtitan's (-3.4%)
    assert 0.05 < errors["Mula-1B, 1 H200, eager, the plain loop"] < 0.15
    assert abs(errors["Llama 3.1 8B, FSDP 8, op recompute, compiled"]) < 0.05


def test_the_stack_factors_are_inputs_with_sources_not_fits():
    """Only Optimus's factor differs from the plain loop's, and it is our own measurement;
    every other stack is assumed equal to it, and says so."""
    from optimus.planner.stacks import against_ours, stacks

    table = stacks()
    assert table["optimus"].compiled == 0.818 and table["optimus"].eager == 0.934
    assert "measured" in table["optimus"].source
    for name, stack in table.items():
        assert stack.source
        if name != "optimus":
            assert {stack.compiled, stack.eager} <= {1.0, None}, name
            assert name == "plain" or "assumed" in stack.source
    assert against_ours("megatron-core", True) == pytest.approx(1 / 0.818)
    assert {r.stack for r in RUNS} <= set(table)


def test_the_machines_of_the_evidence():
    """The H200 is the H100 SXM's die at the same power: the same sustained, more and faster
    memory. torchtitan's Grand Teton H100s (500 W, HBM2e) are a machine of their own: on it
    the H100 is 1.8x an A100 on the same layout (published runs ~1.9x), and the DGX H100 at
    700 W 1.45x it."""
    h100, table = get_machine("h100-ndr"), machines()
    h200, titan = table["h200"], table["h100-gt500"]
    differs = {k for k, v in h200.model_dump().items() if v != getattr(h100, k)}
    assert differs == {"name", "description", "memory_gib", "hbm_gbps"}
    assert titan.hbm_gbps == 2400 and titan.sustained < h100.sustained
    cfg = validate_job({"name": "l8", "model": LLAMA3_8B,
                        "data": {"seq_len": 8192, "batch_size": 16}}).model
    lay = PlanLayout(ParallelDims(dp=8), microbatch_size=2, seq_len=8192, recompute="op")
    rate = {n: step_time(cfg, lay, table[n], 16, "torchtitan").tokens_per_s_per_device
            for n in ("h100-ndr", "h100-gt500", "a100-hdr")}
    assert rate["h100-gt500"] / rate["a100-hdr"] == pytest.approx(1.80, abs=0.02)
    assert rate["h100-ndr"] / rate["h100-gt500"] == pytest.approx(1.45, abs=0.02)
    assert get_machine("max1550-aurora").sustained == get_machine("max1550-supermuc").sustained


def test_element_wise_bytes_follow_the_block_as_it_runs():
    """Mula-1B's block in bf16 (d 2048, 8 key/value heads of 128, ffn 6144), per token of a
    rank's microbatch, forward: eager 104 d + 48 kv + 10 f bytes (module text of compute.py),
    fused 24 d + 4 kv + 6 f; under tp 2 every width halves (sequence parallel)."""
    from optimus.planner.compute import elementwise_bytes, head_bytes

    cfg = shape_of(validate_job({"name": "m", "model": {
        "vocab_size": 32768, "dim": 2048, "n_layers": 20, "n_heads": 16, "n_kv_heads": 8,
        "ffn_dim": 6144, "max_seq_len": 2048}, "data": {"seq_len": 2048, "batch_size": 4}
    }).model)
    d, kv, f = 2048, 1024, 6144
    assert elementwise_bytes(cfg, 0, 1, 2, False) == 104 * d + 48 * kv + 10 * f
    assert elementwise_bytes(cfg, 0, 1, 2, True) == 24 * d + 4 * kv + 6 * f
    assert elementwise_bytes(cfg, 0, 2, 2, True) == (24 * d + 4 * kv + 6 * f) / 2
    # fp32 has no casts: the norms and RoPE move less, the rest twice the bytes
    assert elementwise_bytes(cfg, 0, 1, 4, False) == 2 * 8 * d + 36 * (d + kv) + 8 * d \
        + 24 * d + 20 * f
    # the loss: the float32 softmax over the vocabulary, forward and backward
    assert head_bytes(cfg, 1, 2, False) == 3 * 20 * d + 28 * 32768
    assert head_bytes(cfg, 1, 2, True) == 3 * 4 * d + 6 * 32768


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
