"""The clip and the optimizer on each rank's local shards: the values of torch's own (one
process, and the layouts' DTensors), with no host read and no DTensor op per parameter.

The layouts run on real gloo ranks: FSDP (dp 2), tensor parallel (tp 2: the norms' gradients
are pending sums, the embedding's replicated), a pipeline (pp 2: the stages' norms add up),
and mixtures of experts under expert parallelism (the experts on their (edp, ep) mesh) and
under tp (the MoE layers plain tensors, the same on both tp ranks).
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from optimus.config import resolve_layout, validate_job
from optimus.optim import LocalAdamW, build_optimizer, lr_at, set_lr
from optimus.parallel.grads import clip_grad_norm_, clip_grads_
from optimus.parallel.loss import TokenSumLoss

CPU = torch.device("cpu")
SEQ, BATCH, MAX_NORM = 16, 8, 0.05  # MAX_NORM below every norm here: the clip scales
READ = "aten::_local_scalar_dense"  # what .item(), bool(), float() of a tensor dispatch


def _raw(n_layers: int = 2, moe: bool = False, **parallel) -> dict:
    model = {"vocab_size": 128, "dim": 32, "n_layers": n_layers, "n_heads": 4,
             "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": SEQ}
    if moe:
        model["moe"] = {"experts": 4, "top_k": 2, "expert_ffn_dim": 16, "dense_layers": 1}
    return {"name": "shards", "model": model,
            "optim": {"steps": 4, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2,
                      "weight_decay": 0.1},
            "data": {"seq_len": SEQ, "batch_size": BATCH, "microbatches": 2},
            "parallel": {"device": "cpu", **parallel}}


class Ops(TorchDispatchMode):
    """Counts the ops dispatched, and those dispatched with a DTensor among their arguments
    (each one a sharding decision of DTensor's)."""

    def __init__(self) -> None:
        super().__init__()
        self.all, self.dtensor = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.all[func.name()] += 1
        if any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs))):
            self.dtensor[func.name()] += 1
        return func(*args, **kwargs)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))


def _backward(model: torch.nn.Module, step: int) -> None:
    """The one-process model's gradients of the trainer's loss over the global batch."""
    batch, loss = _batch(step), TokenSumLoss()
    loss.tokens = BATCH * SEQ
    loss(model(batch[:, :-1]), batch[:, 1:]).backward()


def _plain_model(n_layers: int = 2) -> torch.nn.Module:
    from optimus.models import build_model

    job = validate_job(_raw(n_layers))
    return build_model(job.model, seed=job.seed, device="cpu")


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


# --- one process ----------------------------------------------------------------------------

def test_clip_equals_torch_on_one_process():
    model = _plain_model()
    ref = copy.deepcopy(model)
    _backward(model, 0)
    _backward(ref, 0)
    norm = clip_grads_(model.parameters(), MAX_NORM)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    assert want > 2 * MAX_NORM  # the clip does scale
    torch.testing.assert_close(norm.total, want, rtol=1e-6, atol=0)
    # One process holds every value once: its own share is the whole.
    torch.testing.assert_close(norm.local_squared, want.square(), rtol=1e-6, atol=0)
    assert norm.total.dtype == torch.float32 and norm.total.shape == ()
    for got, expected in zip(_grads(model), _grads(ref), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    # Measuring only (max_norm 0) leaves the gradients as they are.
    before = _grads(model)
    torch.testing.assert_close(clip_grad_norm_(model.parameters(), 0.0), torch.tensor(MAX_NORM),
                               rtol=1e-5, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), before, strict=True))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nonfinite_norm_leaves_the_gradients(bad):
    model = _plain_model()
    _backward(model, 0)
    next(model.parameters()).grad[0, 0] = bad
    before = _grads(model)
    norm = clip_grads_(model.parameters(), MAX_NORM, leave_nonfinite=True)
    assert not torch.isfinite(norm.total) and not torch.isfinite(norm.local_squared)
    assert float(norm.found_inf()) == 1.0
    for got, expected in zip(_grads(model), before, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    # Without leave_nonfinite the coefficient is torch's (NaN, or 0 for an Inf norm).
    ref = copy.deepcopy(model)
    for p, grad in zip(ref.parameters(), before, strict=True):
        p.grad = grad.clone()
    clip_grads_(model.parameters(), MAX_NORM)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    for got, expected in zip(_grads(model), _grads(ref), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(_grads(model)[1], before[1])


def test_clip_reads_nothing_and_its_ops_do_not_grow_with_the_model():
    counts = []
    for n_layers in (1, 3):
        model = _plain_model(n_layers)
        _backward(model, 0)
        with Ops() as ops:
            clip_grads_(model.parameters(), MAX_NORM, leave_nonfinite=True).found_inf()
        assert ops.all[READ] == 0
        counts.append(sum(ops.all.values()))
    assert counts[0] == counts[1] < 30, counts  # 2 x 9 + 3 vs 3 x 9 + 3 parameters


@pytest.mark.parametrize("fused", [True, False])
def test_local_adamw_equals_torch_adamw_and_skips_on_the_flag(fused):
    model = _plain_model()
    ref = copy.deepcopy(model)
    opt = LocalAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    stock = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    job = validate_job(_raw())
    for step in range(1, 5):
        for m, o in ((model, opt), (ref, stock)):
            set_lr(o, lr_at(step, job.optim))  # a new rate every step
            _backward(m, step)
        skip = step in (1, 3)  # the first: the state is made, then the update skipped
        before = _state(model, opt)
        with Ops() as ops:
            opt.step(found_inf=torch.tensor(1.0 if skip else 0.0))
        if fused:  # the flag stays on the device (a non-fused step reads it once)
            assert ops.all[READ] == 0
        if skip:  # nothing moved; a state made by this step is zeros, its count 0
            for key, value in _state(model, opt).items():
                assert torch.equal(value, before.get(key, torch.zeros_like(value))), key
        else:
            stock.step()
        if step > 1:
            _assert_same(_state(model, opt), _state(ref, stock))
        opt.zero_grad()
        stock.zero_grad()
    assert float(opt.state[next(model.parameters())]["step"]) == 2  # the skipped ones undone


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's values of every parameter and its optimizer state, copied."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {}
    for name, p in model.named_parameters():
        out[name] = local(p)
        out.update({f"{name}/{k}": local(v) for k, v in opt.state[p].items()})
    return out


def _assert_same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


# --- layouts on gloo ranks -----------------------------------------------------------------

def _oracle_norm(params: list, pp_group) -> torch.Tensor:
    """The global norm as DTensor computes it: each mesh's gradients normed by DTensor and
    gathered, plain ones counted once, the stages added over the pipeline group."""
    import torch.distributed as dist

    by_mesh: dict = {}
    for p in params:
        mesh = getattr(p.grad, "device_mesh", None)
        by_mesh.setdefault(None if mesh is None else mesh.mesh_dim_names, []).append(p.grad)
    squared = torch.zeros(())
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        squared += (norm.full_tensor() if isinstance(norm, DTensor) else norm).square()
    if pp_group.size() > 1:
        dist.all_reduce(squared, group=pp_group)
    return squared.sqrt()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _layout(rank: int, world: int, raw: dict, one_process: bool) -> dict:
    """Four steps of this layout's model (clip, then LocalAdamW) beside a twin that steps with
    torch's fused AdamW: step 3 skipped by a flag of 1, step 4 by the clip's own flag after a
    gradient of the last rank's went NaN. Checks each step here; returns the figures the test
    compares across ranks."""
    from optimus.models import build_model
    from optimus.parallel.plan import build_parallel_model

    job = validate_job(raw, world=world)
    mesh = resolve_layout(job, world).build_mesh("cpu")
    pp_group, stages = mesh.group("pipeline"), mesh.size("pipeline")
    model, twin = (build_parallel_model(job, mesh, CPU) for _ in range(2))
    view, twin_view = model.state_view(), twin.state_view()
    opt = build_optimizer(view, job.optim, CPU)
    assert type(opt) is LocalAdamW and all(g["fused"] for g in opt.param_groups)
    twin_params = dict(twin_view.named_parameters())
    names = {p: n for n, p in view.named_parameters()}
    stock = torch.optim.AdamW(
        [{"params": [twin_params[names[p]] for p in g["params"]],
          "weight_decay": g["weight_decay"]} for g in opt.param_groups],
        lr=job.optim.lr, betas=(job.optim.beta1, job.optim.beta2), eps=job.optim.eps,
        fused=True)
    ref = build_model(job.model, seed=job.seed, device="cpu") if one_process else None

    out = {"norms": [], "own": [], "clip_ops": [], "step_ops": []}
    for step in range(1, 5):
        share = _batch(step).chunk(mesh.size("batch"))[mesh.rank("batch")]
        microbatches = [{"input_ids": b[:, :-1], "labels": b[:, 1:]} for b in share.chunk(2)]
        for m, o in ((model, opt), (twin, stock)):
            set_lr(o, lr_at(step, job.optim))
            m.set_step_tokens(BATCH * SEQ)
            m.forward_backward(microbatches, CPU)
        params = list(model.parameters())
        if step == 4 and rank == world - 1:  # one rank's gradient goes bad
            _local(params[0].grad).view(-1)[0] = math.nan
        want = _oracle_norm(params, pp_group)
        own = sum(float(_local(p.grad).double().square().sum()) for p in params)
        before = [_local(p.grad).clone() for p in params]
        with Ops() as ops:
            norm = clip_grads_(params, MAX_NORM, stages, leave_nonfinite=True)
            found_inf = norm.found_inf()
        out["clip_ops"].append((ops.all[READ], sum(ops.dtensor.values())))
        clip_grads_(twin.parameters(), MAX_NORM, stages, leave_nonfinite=True)
        out["norms"].append(float(norm.total))
        out["own"].append(float(norm.local_squared))
        assert float(norm.local_squared) == pytest.approx(own, rel=1e-5, nan_ok=True)
        if step < 4:
            torch.testing.assert_close(norm.total, want, rtol=1e-5, atol=0)
            assert float(norm.total) > 2 * MAX_NORM
        else:
            assert math.isnan(float(norm.total)) and float(found_inf) == 1.0
            for p, grad in zip(params, before, strict=True):  # untouched, NaN and all
                torch.testing.assert_close(_local(p.grad), grad, rtol=0, atol=0,
                                           equal_nan=True)
        if ref is not None and step == 1:
            _backward(ref, step)
            torch.testing.assert_close(norm.total, torch.nn.utils.clip_grad_norm_(
                ref.parameters(), MAX_NORM), rtol=1e-5, atol=0)
            ref_params = dict(ref.named_parameters())
            for name, p in view.named_parameters():  # the clipped gradients, every value
                torch.testing.assert_close(_full(p.grad), ref_params[name].grad,
                                           rtol=1e-5, atol=1e-8, msg=name)

        kept = _state(view, opt)
        with Ops() as ops:
            opt.step(found_inf=found_inf if step == 4 else torch.tensor(float(step == 3)))
        out["step_ops"].append((ops.all[READ], sum(ops.dtensor.values())))
        if step >= 3:  # skipped on the device: nothing moved, the step counts neither
            _assert_same(_state(view, opt), kept)
        else:
            stock.step()
            _assert_same(_state(view, opt), _state(twin_view, stock))
        opt.zero_grad(set_to_none=True)
        stock.zero_grad(set_to_none=True)
    for p in view.parameters():  # torch's state, as checkpoints hold it
        state = opt.state[p]
        assert float(state["step"]) == 2
        if isinstance(p, DTensor):
            assert state["exp_avg"].placements == p.placements
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


LAYOUTS = {  # name: (raw job, compared with one process)
    "dp2": (_raw(), True),
    "tp2": (_raw(tp=2), True),
    "pp2": (_raw(pp=2, schedule="1f1b"), True),
    "ep2-moe": (_raw(moe=True, ep=2), False),
    "tp2-moe": (_raw(moe=True, tp=2), False),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_clips_and_steps_like_torch(run_ranks, name):
    raw, one_process = LAYOUTS[name]
    ranks = run_ranks(_layout, 2, raw, one_process, timeout=90)
    first, last = ranks
    assert first["norms"][:3] == last["norms"][:3]  # the same on every rank, to the bit
    for result in ranks:
        # Neither the clip nor the step reads a tensor on the host.
        assert all(reads == 0 for reads, _ in result["clip_ops"] + result["step_ops"])
        assert all(dtensor == 0 for _, dtensor in result["clip_ops"])  # no DTensor op
    if not name.startswith("tp2"):  # every gradient has its parameter's placements: all local
        # (but the first step's zeros_like of DTensors: the state, made as torch's AdamW does)
        assert all(dtensor == 0 for _, dtensor in first["step_ops"][1:] + last["step_ops"][1:])
    if name in ("dp2", "pp2"):  # disjoint shards: the ranks' own squares add up to the norm
        for step in range(3):
            assert first["own"][step] + last["own"][step] == pytest.approx(
                first["norms"][step] ** 2, rel=1e-5)
    # The poisoned rank's own share is NaN, the other's finite: each can tell which it is.
    assert math.isfinite(first["own"][3]) and math.isnan(last["own"][3])


def test_ops_do_not_grow_with_the_layout_model(run_ranks):
    """On dp 2, the clip's ops are as many for 3 layers as for 1 (a few per kind of
    placement, none per parameter)."""
    counts = run_ranks(_clip_op_counts, 2, timeout=90)
    assert counts[0] == counts[1]
    assert counts[0][0] == counts[0][1] < 30, counts


def _clip_op_counts(rank: int, world: int) -> tuple[int, int]:
    from optimus.parallel.plan import build_parallel_model

    counts = []
    for n_layers in (1, 3):
        job = validate_job(_raw(n_layers), world=world)
        mesh = resolve_layout(job, world).build_mesh("cpu")
        assert mesh.size("shard") == 2
        model = build_parallel_model(job, mesh, CPU)
        batch = _batch(0).chunk(2)[rank]
        model.set_step_tokens(BATCH * SEQ)
        model.forward_backward([{"input_ids": batch[:, :-1], "labels": batch[:, 1:]}], CPU)
        params = list(model.parameters())
        with Ops() as ops:
            clip_grads_(params, MAX_NORM, mesh.size("pipeline"), leave_nonfinite=True)
        assert ops.all[READ] == 0 and not ops.dtensor, (ops.all, ops.dtensor)
        counts.append(sum(ops.all.values()))
    return tuple(counts)
