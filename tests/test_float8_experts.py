"""Float8 grouped experts (training.float8_experts): mxfp8's emulated kernel against float32
through an MoE layer and the plan, uneven and empty groups, the capacity input, the padding,
and the refusals (a dense model, odd dims, devices without the kernels, no torchao)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist

from optimus.config import ConfigError, JobConfig, check_job, validate_job
from optimus.models import build_model
from optimus.models.moe import GroupedExperts, MoE, grouped_mm, padded_grouped_mm
from optimus.parallel.float8 import INSTALL_HINT, check_float8_here, torchao_problem
from optimus.parallel.float8_experts import (
    Float8GroupedMM,
    apply_float8_experts,
    float8_experts_problem,
    pad_groups,
    torchao_experts_problem,
)

if torchao_problem():  # CI installs it (the dev extra); elsewhere: pip install 'optimus[float8]'
    pytest.skip("torchao is not installed", allow_module_level=True)

# e4m3 keeps 3 mantissa bits: on these sizes one float8 grouped GEMM lands 3-4% from float32
# (the relative norm of the difference), an expert SwiGLU (three of them) 6.5% (bf16: 0.6%). A
# wrong expert, transpose or group is 50% or more off.
BOUND = 0.06
SWIGLU_BOUND = 0.1
WRONG = 0.5
EMULATED = Float8GroupedMM("mxfp8", emulated=True)


def _raw(experts: int = 4, expert_ffn_dim: int = 32, moe: dict | None = None,
         **training) -> dict:
    return {"name": "f8x",
            "model": {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4,
                      "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 32,
                      "moe": {"experts": experts, "top_k": 2, "expert_ffn_dim": expert_ffn_dim,
                              "dense_layers": 1, "balance": "bias", **(moe or {})}},
            "optim": {"steps": 2, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1},
            "data": {"seq_len": 32, "batch_size": 2, "microbatches": 1},
            "training": training, "parallel": {"device": "cpu"}}


def _layer(**moe) -> MoE:
    """An MoE layer of a built model (no shared experts: its output is the experts' alone)."""
    return build_model(validate_job(_raw(moe=moe)).model, seed=7).layers["1"].feed_forward


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("capacity_factor", [None, 1.0])  # dropless; [experts, 24, dim]
def test_mxfp8_experts_in_an_moe_layer_track_float32_forward_and_backward(capacity_factor):
    ref = _layer(capacity_factor=capacity_factor)
    ref.expert_bias[3] = -1e3  # chosen only by the bias: expert 3 gets no token
    f8 = copy.deepcopy(ref)
    assert apply_float8_experts(f8, "mxfp8", emulated=True) == 1
    assert ref.experts.matmul is grouped_mm and f8.experts.matmul == EMULATED
    tokens = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(0))
    probe = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for m in (ref, f8):
        x = tokens.clone().requires_grad_()
        out = m(x)
        (out * probe).sum().backward()
        outs.append(out.detach())
        grads.append([x.grad] + [getattr(m.experts, n).grad for n in ("w1", "w3", "w2")])
    load = f8.load.tolist()  # 48 tokens x 2 slots, uneven, none a multiple of 32
    assert load[3] == 0 and sum(load) == 96 and len(set(load[:3])) == 3
    assert load == ref.load.tolist()  # the same routing: the router stays in float32
    assert 1e-2 < _rel(outs[1], outs[0]) < SWIGLU_BOUND  # quantised, within float8's error
    for got, want in zip(grads[1], grads[0], strict=True):
        assert 1e-2 < _rel(got, want) < SWIGLU_BOUND
    for w in grads[1][1:]:  # the empty expert's weights get no gradient
        assert w[3].abs().max() == 0
    wrong = copy.deepcopy(ref)  # the same layer with its experts' weights in another order
    for name in ("w1", "w3", "w2"):
        getattr(wrong.experts, name).data = getattr(ref.experts, name).data.roll(1, 0)
    with torch.no_grad():
        assert _rel(wrong(tokens), outs[0]) > WRONG


def test_uneven_groups_and_an_empty_one_against_a_wrong_transpose_and_wrong_groups():
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([5, 0, 40, 19])  # none a multiple of 32; expert 1 empty
    x = torch.randn(64, 64, generator=g, requires_grad=True)
    w = torch.randn(4, 64, 64, generator=g, requires_grad=True)  # square: a transpose fits
    out = EMULATED(x, w, counts)
    with torch.no_grad():
        ref = padded_grouped_mm(x, w, counts)
        assert _rel(out, ref) < BOUND
        assert _rel(out, padded_grouped_mm(x, w.mT, counts)) > WRONG
        assert _rel(out, padded_grouped_mm(x, w, counts.roll(1))) > WRONG
    probe = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (x, w), probe)
    want = torch.autograd.grad(padded_grouped_mm(x, w, counts), (x, w), probe)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) < BOUND
    assert got[1][1].abs().max() == 0


def test_the_capacity_input_padded_or_aligned_and_under_autocast():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 64, 32, generator=g, requires_grad=True)
    for capacity in (20, 32):  # padded to 32 rows an expert; aligned already
        x = torch.randn(4, capacity, 64, generator=g, requires_grad=True)
        out = EMULATED(x, w, None, capacity)
        assert out.shape == (4, capacity, 32)
        assert _rel(out, torch.bmm(x, w)) < BOUND
        assert _rel(out, torch.bmm(x, w.roll(1, 0))) > WRONG
        probe = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad(out, (x, w), probe)
        want = torch.autograd.grad(torch.bmm(x, w), (x, w), probe)
        for a, b in zip(got, want, strict=True):
            assert _rel(a, b) < BOUND
    with torch.autocast("cpu", dtype=torch.bfloat16):  # one replica's bf16: operands cast
        out = EMULATED(x, w, None, 32)
    assert out.dtype == torch.bfloat16 and _rel(out, torch.bmm(x, w)) < BOUND


def test_compiled_the_float8_gemm_computes_as_eager():
    """training.compile traces the float8 GEMM into the block's graph: torchao's kernel is
    looked up when the GEMM is made, not inside the traced call (where the import broke)."""
    g = torch.Generator().manual_seed(5)
    counts = torch.tensor([5, 0, 40, 19])
    x = torch.randn(64, 64, generator=g, requires_grad=True)
    w = torch.randn(4, 64, 32, generator=g, requires_grad=True)
    compiled = torch.compile(EMULATED, backend="aot_eager", fullgraph=False)
    got = [compiled(x, w, counts)]
    got += torch.autograd.grad(got[0].square().sum(), (x, w))
    want = [EMULATED(x, w, counts)]
    want += torch.autograd.grad(want[0].square().sum(), (x, w))
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_groups_are_padded_to_the_multiple_on_the_device_with_zero_rows():
    x = torch.arange(1.0, 65.0).unsqueeze(1).expand(64, 32)  # row r holds r + 1
    padded, ends, where = pad_groups(x, torch.tensor([5, 0, 40, 19]), 32)
    assert ends.dtype == torch.int32 and ends.tolist() == [32, 32, 96, 128]
    assert padded.shape == (192, 32)  # 64 + 4 x 31, rounded up to 32: no host read
    starts = {0: 0, 5: 32, 45: 96}  # each group's first row lands on its padded start
    assert all(where[row] == start for row, start in starts.items())
    assert torch.equal(padded[where], x)
    assert padded.sum() == x.sum()  # every other row is zero


def test_the_plan_sets_the_float8_matmul_of_every_moe_layer(monkeypatch):
    """build_parallel_model on one process: every layer's experts get the float8 GEMM (the
    emulated one here: a cpu job is refused before the plan), and a step's loss stays near
    bf16-free float32's."""
    if dist.is_initialized():
        pytest.skip("a process group is already running in this test process")
    from optimus.config import resolve_layout
    from optimus.parallel import plan

    monkeypatch.setattr(plan, "apply_float8_experts",
                        lambda part, recipe: apply_float8_experts(part, recipe, emulated=True))
    batch = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(4))
    mb = [{"input_ids": batch[:, :-1], "labels": batch[:, 1:]}]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        losses = []
        for recipe in ("off", "mxfp8"):
            job = validate_job(_raw(float8_experts=recipe), world=1)
            mesh = resolve_layout(job, 1).build_mesh("cpu")
            model = plan.build_parallel_model(job, mesh, torch.device("cpu"))
            experts = [m for p in model.parts for m in p.modules()
                       if isinstance(m, GroupedExperts)]
            want = grouped_mm if recipe == "off" else EMULATED
            assert len(experts) == 1 and all(m.matmul == want for m in experts)
            model.set_step_tokens(64)
            losses.append(float(model.forward_backward(mb, torch.device("cpu"))))
    finally:
        dist.destroy_process_group()
    assert losses[1] != losses[0] and losses[1] == pytest.approx(losses[0], rel=1e-2)


def test_a_dense_model_or_odd_expert_dims_are_refused_by_name():
    with pytest.raises(ConfigError) as refused:
        check_job(JobConfig.model_validate(_raw(experts=0, float8_experts="mxfp8")))
    assert [key for key, _, _ in refused.value.problems] == ["training.float8_experts"]
    line = str(refused.value)
    assert "\n" not in line and "model.moe.experts > 0" in line
    assert "set training.float8_experts: off" in line
    with pytest.raises(ConfigError) as refused:  # 48: a multiple of 16, not of mxfp8's 32
        check_job(JobConfig.model_validate(_raw(expert_ffn_dim=48, float8_experts="mxfp8")))
    assert "multiples of 32" in str(refused.value) and "expert_ffn_dim=48" in str(refused.value)
    check_job(JobConfig.model_validate(_raw(expert_ffn_dim=48, float8_experts="rowwise")))


def test_a_cpu_job_is_refused_before_any_rank_starts_in_one_line():
    job = JobConfig.model_validate(_raw(float8_experts="mxfp8"))
    with pytest.raises(ConfigError) as refused:
        check_float8_here(job, source="job.yaml")
    line = str(refused.value)
    assert "\n" not in line and line.startswith("job.yaml: training.float8_experts: mxfp8 "
                                                "cannot run here: the cpu has no float8")
    assert "10.0" in line and line.endswith("or set training.float8_experts: off")
    assert job.training.float8_asked
    check_float8_here(JobConfig.model_validate(_raw()))  # off: nothing asked, nothing refused


def test_float8_experts_problem_by_device(monkeypatch):
    assert "9.0" in float8_experts_problem("rowwise", "cpu")
    assert "10.0" in float8_experts_problem("mxfp8", "cpu")
    assert "Max 1550" in float8_experts_problem("rowwise", "xpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))  # A100
    a100 = float8_experts_problem("rowwise", "cuda")
    assert "capability 8.0" in a100 and "needs 9.0" in a100 and "H100" in a100
    assert "capability 8.0" in float8_experts_problem("mxfp8", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))  # H100, H200
    assert float8_experts_problem("rowwise", "cuda") is None
    hopper = float8_experts_problem("mxfp8", "cuda")
    assert "capability 9.0" in hopper and "needs 10.0" in hopper and "B200" in hopper
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (10, 0))
    mxfp8 = sys.modules["torchao.prototype.moe_training.mxfp8_grouped_mm"]
    problem = float8_experts_problem("mxfp8", "cuda")  # the device suits: torchao's build?
    if mxfp8._SM100_KERNELS_AVAILABLE:
        assert problem is None
    else:  # this torchao (a cpu build's) lacks the B200 kernels
        assert "SM100" in problem
    monkeypatch.setitem(sys.modules, "torchao.prototype.moe_training.fp8_grouped_mm", None)
    assert INSTALL_HINT in torchao_experts_problem("rowwise")
    with pytest.raises(ValueError, match="emulated"):
        apply_float8_experts(_layer(), "rowwise", emulated=True)
