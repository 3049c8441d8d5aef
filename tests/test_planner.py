"""The planner's memory model against the memory real ranks use.

Every layout runs one training step (forward, backward, AdamW) on 4 gloo ranks, all layouts in
one set of processes, while `PeakMemory` counts the bytes of every live tensor storage: the
quantity `torch.cuda.max_memory_allocated` reports on a GPU (optimus/planner/measure.py says
why it is the same). The prediction of `rank_memory` for each pipeline position must be within
15% of what the ranks at that position measured.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from optimus.config import validate_job
from optimus.planner.memory import PlanLayout, rank_memory
from optimus.runtime.dims import ParallelDims

WORLD, SEQ = 4, 128
DENSE = {"vocab_size": 256, "dim": 128, "n_layers": 4, "n_heads": 4, "ffn_dim": 384,
         "max_seq_len": SEQ}
# A capacity factor of 1 pins the padded expert matmul's size (every expert's group is padded
# to the capacity), so the MoE activations do not depend on how the untrained router happens
# to route.
MOE = {**DENSE, "moe": {"experts": 8, "top_k": 2, "expert_ffn_dim": 128, "capacity_factor": 1.0}}

# name: (model, parallel section, sequences per microbatch, microbatches). Tensor parallel
# without recompute is covered by the odd blocks of "selective" and by the zbv pipeline.
LAYOUTS = {
    "FSDP dp4": (DENSE, {}, 2, 1),
    "FSDP dp4, full recompute": (DENSE, {"activation_checkpoint": "full"}, 2, 1),
    "TP4, op recompute": (DENSE, {"tp": 4, "activation_checkpoint": "op"}, 4, 1),
    "TP2 x dp2, selective recompute": (DENSE, {"tp": 2, "activation_checkpoint": "selective"},
                                       2, 2),
    "PP4 gpipe": (DENSE, {"pp": 4, "schedule": "gpipe"}, 2, 4),
    "PP4 1f1b": (DENSE, {"pp": 4, "schedule": "1f1b"}, 2, 8),
    "PP2 x dp2 interleaved 1f1b": (DENSE, {"pp": 2, "virtual_stages": 2,
                                           "schedule": "interleaved_1f1b"}, 2, 4),
    "PP2 x TP2 zbv zero bubble": (DENSE, {"pp": 2, "tp": 2, "virtual_stages": 2,
                                          "schedule": "zbv_zero_bubble"}, 2, 4),
    "PP2 x dp2 interleaved zero bubble": (DENSE, {"pp": 2, "virtual_stages": 2,
                                                  "schedule": "interleaved_zero_bubble"}, 2, 4),
    "PP2 x dp2 dualpipev": (DENSE, {"pp": 2, "virtual_stages": 2, "schedule": "dualpipev"},
                            1, 4),
    "PP2 x dp2 looped bfs, full recompute": (DENSE, {"pp": 2, "virtual_stages": 2,
                                                     "schedule": "looped_bfs",
                                                     "activation_checkpoint": "full"}, 2, 4),
    "FSDP dp4, parameters gathered a step": (DENSE, {"param_gather": "step"}, 1, 2),
    "PP2 x dp2 1f1b, parameters gathered a step": (DENSE, {"pp": 2, "param_gather": "step"},
                                                   1, 4),
    "MoE EP2, full recompute": (MOE, {"ep": 2, "activation_checkpoint": "full"}, 2, 1),
    "MoE TP2 x EP2": (MOE, {"tp": 2, "ep": 2}, 2, 1),
}


def _raw(model: dict, parallel: dict, microbatch: int, microbatches: int,
         optim: dict | None = None) -> dict:
    dp = WORLD // (parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("cp", 1))
    return {"name": "memory", "model": model,
            "optim": {"steps": 1, "warmup_steps": 0, **(optim or {})},
            "data": {"seq_len": SEQ, "batch_size": microbatch * microbatches * dp,
                     "microbatches": microbatches},
            "parallel": {"device": "cpu", **parallel}}


def _measure(rank: int, world: int, layouts: list[tuple]) -> list[int]:
    """This rank's peak bytes over one step of each layout, in turn."""
    from optimus.config import resolve_layout
    from optimus.optim import build_optimizer
    from optimus.parallel.plan import build_parallel_model
    from optimus.planner.measure import PeakMemory, state_tensors

    cpu = torch.device("cpu")
    peaks = []
    for model, parallel, microbatch, microbatches, *optim in layouts:
        job = validate_job(_raw(model, parallel, microbatch, microbatches, *optim), world=world)
        mesh = resolve_layout(job, world).build_mesh("cpu")
        parts = build_parallel_model(job, mesh, cpu)
        optimizer = build_optimizer(parts.state_view(), job.optim, cpu)
        # AdamW makes its state at its first step: make it now, so one measured step is a
        # steady one (parameters, state, then the step's gradients and activations).
        for p in parts.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        batch = torch.randint(0, 256, (microbatch * microbatches, SEQ + 1),
                              generator=torch.Generator().manual_seed(0))
        microbatch_list = [{"input_ids": x[:, :-1], "labels": x[:, 1:]}
                           for x in batch.split(microbatch)]
        tracker = PeakMemory()
        tracker.track(state_tensors(parts.parts, optimizer))
        tracker.track([batch])
        with tracker:
            parts.set_step_tokens(batch.numel())
            parts.forward_backward(microbatch_list, cpu)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peaks.append(tracker.peak)
        del parts, optimizer, tracker, microbatch_list
        torch.distributed.barrier()
    return peaks


def _plan(model: dict, parallel: dict, microbatch: int, microbatches: int) -> PlanLayout:
    tp, pp, cp = parallel.get("tp", 1), parallel.get("pp", 1), parallel.get("cp", 1)
    dims = ParallelDims(dp=WORLD // (tp * pp * cp), tp=tp, pp=pp, ep=parallel.get("ep", 1),
                        virtual_stages=parallel.get("virtual_stages", 1), cp=cp)
    return PlanLayout(dims, schedule=parallel.get("schedule", "1f1b"), microbatches=microbatches,
                      microbatch_size=microbatch, seq_len=SEQ,
                      recompute=parallel.get("activation_checkpoint", "none"),
                      param_gather=parallel.get("param_gather", "microbatch"), precision="fp32",
                      cp_method=parallel.get("cp_method", "alltoall"))


@pytest.fixture(scope="module")
def measured(request):
    from tests.multiproc import run_ranks

    per_rank = run_ranks(_measure, WORLD, list(LAYOUTS.values()), timeout=240)
    return {name: [peaks[i] for peaks in per_rank] for i, name in enumerate(LAYOUTS)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_memory_model_within_15_percent_of_measured_peak(measured, name):
    model, parallel, microbatch, microbatches = LAYOUTS[name]
    cfg = validate_job(_raw(model, parallel, microbatch, microbatches)).model
    plan = _plan(model, parallel, microbatch, microbatches)
    per_position = WORLD // plan.dims.pp  # ranks are ordered pp outermost (runtime/dims.py)
    for pp_rank in range(plan.dims.pp):
        ranks = measured[name][pp_rank * per_position:(pp_rank + 1) * per_position]
        predicted = rank_memory(cfg, plan, pp_rank).total
        for got in ranks:
            assert predicted == pytest.approx(got, rel=0.15), (
                f"{name}, pp rank {pp_rank}: predicted {predicted / 2**20:.2f} MiB, "
                f"measured {got / 2**20:.2f} MiB")


# --- what QK-norm and the z-loss add -----------------------------------------------------------

# A wide vocabulary makes the loss the step's peak, where the z-loss's float32 logits show.
WIDE = {**DENSE, "vocab_size": 4096}
STABILITY = {  # as LAYOUTS, with the optim section
    "neither": (WIDE, {"tp": 4}, 2, 1, {}),
    "qk_norm": ({**WIDE, "qk_norm": True}, {"tp": 4}, 2, 1, {}),
    "z_loss": (WIDE, {"tp": 4}, 2, 1, {"z_loss": 1e-4}),
}


def test_qk_norm_and_the_z_loss_add_the_memory_the_model_predicts():
    """TP4: QK-norm adds two of q and of k (local heads) per layer and token, and its
    weights; the z-loss one float32 [tokens, vocab / tp]. Predicted and measured growth agree
    within 15% (measured: 5% over, the slack), as do the totals. Without data parallelism the
    loss is the step's peak; with it (TP2 x dp2) the peak is elsewhere, in backward, and the
    z-loss's logits add little to it (4 KB measured): the model counts them at the peak all
    the same, as it does the loss's own logits."""
    from tests.multiproc import run_ranks

    per_rank = run_ranks(_measure, WORLD, list(STABILITY.values()), timeout=240)
    predicted = {}
    for name, (model, parallel, microbatch, microbatches, optim) in STABILITY.items():
        cfg = validate_job(_raw(model, parallel, microbatch, microbatches, optim)).model
        plan = replace(_plan(model, parallel, microbatch, microbatches),
                       z_loss=bool(optim.get("z_loss")))
        predicted[name] = rank_memory(cfg, plan).total
    for peaks in per_rank:
        got = dict(zip(STABILITY, peaks, strict=True))
        for name in STABILITY:
            assert predicted[name] == pytest.approx(got[name], rel=0.15), name
        for name in ("qk_norm", "z_loss"):
            grew = got[name] - got["neither"]
            assert predicted[name] - predicted["neither"] == pytest.approx(grew, rel=0.15), name
            assert grew > 0.03 * got["neither"]  # large enough to be told from noise


# --- `optimus config check` refuses a job that cannot fit -------------------------------------

def _check(*args: str):
    from click.testing import CliRunner

    from optimus.cli import main

    return CliRunner().invoke(main, ["config", "check", "jobs/gpt-1.3b.yaml", "--world", "32",
                                     *args])


def test_config_check_refuses_a_job_that_cannot_fit_naming_the_term_and_a_fix():
    result = _check("--memory-gib", "8")
    assert result.exit_code == 2
    line = result.output.strip()
    assert "\n" not in line  # one line, no traceback
    # 1.3B on 32 ranks with selective recompute, 2048-token microbatches of 2 sequences
    # (64 = 32 x 2 per step): its activations overflow, not its sharded state. (The float32
    # loss is 4.6 GiB of the 19.2.)
    assert "needs 19.2 GiB per rank on a device with 8 GiB: activations 9.7 GiB" in line
    assert "fix: data.microbatches: 16" in line
    # the fix it names does fit, by the same model
    fixed = _check("--memory-gib", "8", "--set", "data.microbatches=16")
    assert fixed.exit_code == 0, fixed.output
    assert "memory: " in fixed.output and "of 8 GiB on a device" in fixed.output
    # parameters kept gathered a step (21.4 GiB): going back to gathering per microbatch
    # (19.2 GiB) is the first fix named
    kept = _check("--memory-gib", "20.5", "--set", "parallel.param_gather=step")
    assert kept.exit_code == 2
    assert "needs 21.4 GiB" in kept.output
    assert "fix: parallel.param_gather: microbatch" in kept.output


def test_config_check_on_a_machine_profile_and_bad_profiles(tmp_path):
    ok = _check("--machine", "a100-hdr")
    assert ok.exit_code == 0, ok.output
    assert "of 76 GiB on a100-hdr (80 GiB less 4 of headroom)" in ok.output
    unknown = _check("--machine", "b300")
    assert unknown.exit_code == 2
    assert "unknown machine profile 'b300'" in unknown.output and "a100-hdr" in unknown.output
    mine = tmp_path / "machines.yaml"
    mine.write_text("tiny:\n  peak_tflops: 10\n  sustained: 0.5\n  memory_gib: 4\n"
                    "  devices_per_node: 4\n  intra_gbps: 10\n  inter_gbps: 1\n")
    small = _check("--machine", "tiny", "--machines", str(mine))
    assert small.exit_code == 2 and "on tiny with 4 GiB" in small.output
    mine.write_text("tiny:\n  peak_tflops: -1\n")
    bad = _check("--machine", "tiny", "--machines", str(mine))
    assert bad.exit_code == 2 and "profile tiny: peak_tflops" in bad.output


# --- the step-time model and the search --------------------------------------------------------

def test_bubble_replays_torch_orders_to_the_known_fractions():
    from optimus.planner.schedules import bubble, in_flight

    # Megatron-LM's (p - 1) / m for 1F1B and GPipe, (p - 1) / (v m) interleaved
    assert bubble("1f1b", 4, 1, 8) == pytest.approx(3 / 8)
    assert bubble("gpipe", 4, 1, 8) == pytest.approx(3 / 8)
    assert bubble("interleaved_1f1b", 4, 2, 8) == pytest.approx(3 / 16)
    assert bubble("zbv_zero_bubble", 4, 2, 8) < bubble("interleaved_1f1b", 4, 2, 8)
    assert bubble("1f1b", 1, 1, 8) == 0.0
    # 1F1B: rank r holds pp - r microbatches; GPipe all of them
    assert [sum(h.values()) for h in in_flight("1f1b", 4, 1, 8)] == [4, 3, 2, 1]
    assert [sum(h.values()) for h in in_flight("gpipe", 4, 1, 8)] == [8] * 4


def test_step_time_of_one_device_is_its_flops_at_the_sustained_rate():
    from optimus.models.counts import flops_per_token
    from optimus.planner.machines import get_machine
    from optimus.planner.memory import PlanLayout
    from optimus.planner.steptime import SHAPE_KNEE, step_time

    cfg = validate_job({"name": "x", "model": DENSE, "data": {"seq_len": SEQ}}).model
    a100 = get_machine("a100-hdr")
    lay = PlanLayout(microbatch_size=4, microbatches=2, seq_len=SEQ, precision="bf16")
    t = step_time(cfg, lay, a100, global_batch=8)
    tokens = 4 * SEQ
    shape = tokens / (tokens + SHAPE_KNEE) * cfg.dim / (cfg.dim + SHAPE_KNEE)
    want = 2 * tokens * flops_per_token(cfg, SEQ) / (312e12 * a100.sustained * shape)
    assert t.compute == pytest.approx(want)
    # one device: no communication, no bubble; the element-wise work of 4 layers and the
    # loss (eager: planner/compute.py) at the A100's memory bandwidth, and what Optimus's
    # step adds to the plain loop's (stacks.yaml, eager 0.934)
    from optimus.planner.compute import elementwise_bytes, head_bytes

    per_token = 3 * 4 * elementwise_bytes(cfg, 0, 1, 2, False) + head_bytes(cfg, 1, 2, False)
    assert t.memory_s == pytest.approx(2 * tokens * per_token / 2039e9)
    assert t.stack_s == pytest.approx((want + t.memory_s) * (1 / 0.934 - 1))
    assert t.total == pytest.approx(want + t.memory_s + t.stack_s)
    assert t.tokens_per_s_per_device == pytest.approx(8 * SEQ / t.total)
    # full recompute adds one forward of the blocks: a third of their FLOPs
    full = step_time(cfg, PlanLayout(microbatch_size=4, microbatches=2, seq_len=SEQ,
                                     recompute="full"), a100, global_batch=8)
    assert 1.2 < full.compute / t.compute < 4 / 3


def test_plan_1t_on_3072_devices():
    """The largest search the papers ask for (its time: bench/planner_papers.py)."""
    from optimus.planner.machines import get_machine
    from optimus.planner.search import plan

    # seed 001's largest model: 1T parameters, h 25600, 128 layers, 160 heads
    job = validate_job({"name": "gpt-1t",
                        "model": {"vocab_size": 51200, "dim": 25600, "n_layers": 128,
                                  "n_heads": 160, "ffn_dim": 102400, "max_seq_len": 2048},
                        "data": {"seq_len": 2048, "batch_size": 3072}})
    fits, seen = plan(job, 3072, get_machine("a100-hdr"), "bf16")
    assert seen > 1000 and fits
    speeds = [c.time.tokens_per_s_per_device for c in fits]
    assert speeds == sorted(speeds, reverse=True)
    assert all(c.memory.total <= 80 * 2**30 for c in fits)
    assert all(c.layout.devices == 3072 and c.layout.dims.tp <= 8 for c in fits)


def test_plan_command_json_and_explain():
    import json

    from click.testing import CliRunner

    from optimus.cli import main

    run = CliRunner().invoke(main, ["plan", "jobs/gpt-1.3b.yaml", "--devices", "32",
                                    "--machine", "a100-hdr", "-o", "json", "--top", "3"])
    assert run.exit_code == 0, run.output
    answer = json.loads(run.output)
    assert answer["devices"] == 32 and len(answer["layouts"]) == 3
    best = answer["layouts"][0]
    assert best["memory_gib"] <= 80
    assert best["step_s"] == pytest.approx(sum(best["step_terms_s"].values()), rel=1e-3)
    explained = CliRunner().invoke(main, ["plan", "jobs/gpt-1.3b.yaml", "--devices", "32",
                                          "--machine", "a100-hdr", "-o", "json",
                                          "--explain", best["layout"]])
    assert explained.exit_code == 0, explained.output
    assert json.loads(explained.output)["step_s"] == pytest.approx(best["step_s"])
    bad = CliRunner().invoke(main, ["plan", "jobs/gpt-1.3b.yaml", "--devices", "32",
                                    "--machine", "a100-hdr", "--explain", "tp8.qq3"])
    assert bad.exit_code == 2 and "cannot read layout 'tp8.qq3'" in bad.output
    none = CliRunner().invoke(main, ["plan", "jobs/gpt-1.3b.yaml", "--devices", "49",
                                     "--machine", "a100-hdr"])
    assert none.exit_code == 2 and "no layout splits this job over 49 devices" in none.output
