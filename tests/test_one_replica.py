"""One replica (dp 1) in bf16: no FSDP2, autocast around the forwards, fp32 master weights.

At dp 1 nothing is sharded, so the model is not wrapped by FSDP2 (whose one-rank all-gather
and reduce-scatter would be a copy of every parameter and every gradient each step);
`torch.autocast` computes in bf16 instead (optimus/parallel/data_parallel.py). What must hold:

- the model holds no FSDPModule; its parameters are float32, plain tensors or, under tensor
  parallel, DTensors on the tp mesh only, and its gradients float32;
- a step dispatches none of FSDP2's copies (`fsdp.*` ops, `_foreach_copy_`, `chunk_cat`,
  `split_with_sizes_copy`), does its matmuls in bf16, and never reads the step's token count
  back to the host (a 0-dim tensor divisor: no `_local_scalar_dense` in a dense step);
- MoE routers score in float32 under autocast;
- a few steps train like one fp32 process and like FSDP2's bf16 at dp 2, within bf16's
  tolerance (tests/test_precision.py derives the bounds: 1e-3 relative on the losses, 15% of
  the weights' movement; measured here at most 1.9e-4 on the loss and 8.3% of the movement,
  on an expert's weight, against dp 2). Autocast keeps the residual stream in float32 where
  FSDP2's policy keeps it in bf16, so dp 1 lands nearer float32 (5.6e-5) than dp 2 (1.6e-4);
- a bf16 checkpoint saved at dp 2 (DTensors) resumes at dp 1 (plain tensors), and back.
"""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch
from test_checkpoint_resume import _keep_only, _per_step_samples
from test_checkpoint_resume import _train as _train_resumable
from test_checkpoint_resume import job as checkpoint_job
from test_compile import _train as _train_counting_graphs
from test_compile import compile_events, compiled
from test_moe import layer
from test_precision import _initial, _train, fp32_one_process, job
from torch.utils._python_dispatch import TorchDispatchMode

from optimus.config import validate_job

# FSDP2's copies into and out of its communication buffers, all-gather and reduce-scatter.
FSDP_COPIES = ("aten._foreach_copy_", "aten.split_with_sizes_copy", "aten._chunk_cat")


class _Ops(TorchDispatchMode):
    """Counts the ops dispatched, by name, and the matmuls by their operands' dtype."""

    def __init__(self):
        super().__init__()
        self.ops, self.matmuls = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name in ("aten.mm", "aten.bmm", "aten.addmm"):
            self.matmuls[str(args[-2].dtype if name == "aten.addmm" else args[0].dtype)] += 1
        return func(*args, **(kwargs or {}))


def _model(world: int, kind: str, precision: str, parallel: dict):
    from optimus.config import resolve_layout
    from optimus.parallel.plan import build_parallel_model

    raw = job(kind, precision, steps=1, **parallel)
    raw["optim"]["warmup_steps"] = 0
    j = validate_job(raw, world=world)
    mesh = resolve_layout(j, world).build_mesh("cpu")
    return j, build_parallel_model(j, mesh, torch.device("cpu"))


def _step(rank: int, world: int, kind: str, precision: str, parallel: dict) -> dict:
    """One step's forward and backward, watched: what it dispatched, what the model holds."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    j, model = _model(world, kind, precision, parallel)
    d = j.data
    batch = torch.randint(0, j.model.vocab_size, (d.batch_size, d.seq_len + 1),
                          generator=torch.Generator().manual_seed(0))
    dp, dp_rank = world // j.parallel.tp, rank // j.parallel.tp
    mine = batch.chunk(dp)[dp_rank]
    microbatches = [{"input_ids": x[:, :-1], "labels": x[:, 1:]}
                    for x in mine.chunk(d.microbatches)]
    model.set_step_tokens(torch.tensor(batch[:, 1:].numel()))  # a 0-dim tensor, as the trainer
    with _Ops() as watched:
        loss = model.forward_backward(microbatches, torch.device("cpu"))
    params = dict(model.state_view().named_parameters())
    return {
        "loss": float(loss),
        "ops": dict(watched.ops), "matmuls": dict(watched.matmuls),
        "fsdp_units": sum(isinstance(m, FSDPModule) for p in model.parts for m in p.modules()),
        "autocast": model.autocast,
        "dtypes": {str(p.dtype) for p in params.values()},
        "grad_dtypes": {str(p.grad.dtype) for p in params.values() if p.grad is not None},
        "no_grad": sorted(k for k, p in params.items() if p.grad is None),
        "meshes": {tuple(p.device_mesh.mesh_dim_names) for p in params.values()
                   if isinstance(p, DTensor)},
        "plain": sum(not isinstance(p, DTensor) for p in params.values()),
        "params": len(params),
    }


def _validate(rank: int, world: int, kind: str, precision: str, parallel: dict) -> dict:
    """Validation's forward (`forward_loss`) of one batch, watched."""
    j, model = _model(world, kind, precision, parallel)
    d = j.data
    batch = torch.randint(0, j.model.vocab_size, (d.batch_size, d.seq_len + 1),
                          generator=torch.Generator().manual_seed(1))
    microbatches = [{"input_ids": x[:, :-1], "labels": x[:, 1:]}
                    for x in batch.chunk(d.microbatches)]
    with _Ops() as watched:
        loss = model.forward_loss(microbatches, torch.device("cpu"))
    return {"loss": float(loss), "matmuls": dict(watched.matmuls)}


def _fsdp_ops(ops: dict) -> list[str]:
    return sorted(name for name in ops if name.startswith("fsdp.") or name in FSDP_COPIES)


@pytest.mark.parametrize(("kind", "world", "parallel"),
                         [("dense", 1, {}), ("moe", 1, {}), ("dense", 2, {"tp": 2})])
def test_one_replica_in_bf16_is_not_fsdp_wrapped(run_ranks, kind, world, parallel):
    for result in run_ranks(_step, world, kind, "bf16", parallel, timeout=120):
        assert result["fsdp_units"] == 0
        assert result["autocast"] == torch.bfloat16
        assert result["dtypes"] == {"torch.float32"}  # master weights
        assert result["grad_dtypes"] == {"torch.float32"} and result["no_grad"] == []
        if parallel:  # DTensors only from tensor parallel (which places every parameter)
            assert result["meshes"] == {("tp",)} and result["plain"] == 0
        else:
            assert result["meshes"] == set() and result["plain"] == result["params"]
        assert _fsdp_ops(result["ops"]) == []
        assert result["ops"]["aten._to_copy"] > 0  # autocast's casts
        # Every matmul in bf16 but the MoE routers': per microbatch (2) and MoE layer (3), a
        # forward and two backward matmuls in float32.
        fp32 = 2 * 3 * 3 if kind == "moe" else 0
        assert result["matmuls"].get("torch.float32", 0) == fp32, result["matmuls"]
        assert result["matmuls"]["torch.bfloat16"] > 0
        if kind == "dense":  # the token count stays on the device (MoE reads counts.max())
            assert "aten._local_scalar_dense" not in result["ops"]


def test_two_replicas_in_bf16_are_fsdp_wrapped_and_dispatch_its_copies(run_ranks):
    """The control: at dp 2 FSDP2 holds the model, its copies show in the ops counted above,
    and autocast is off (FSDP2's policy casts)."""
    for result in run_ranks(_step, 2, "dense", "bf16", {}, timeout=120):
        assert result["fsdp_units"] == 5  # 4 blocks and the root
        assert result["autocast"] is None
        ops = set(result["ops"])
        assert "fsdp.all_gather_copy_in" in ops
        # The reduce-scatter's copy-in: FSDP2's own op in torch 2.13, aten's in 2.11.
        assert {"fsdp.chunk_cat", "aten._chunk_cat"} & ops
        assert result["matmuls"].get("torch.float32", 0) == 0


def test_validation_forward_runs_under_the_same_autocast(run_ranks):
    """`forward_loss` (what evaluate.py sums) computes in bf16 at dp 1, with and without a
    pipeline: its matmuls are bf16, its loss within bf16's rounding of fp32's, and a pipeline's
    (PP2, hidden states passed in float32, as autocast's residual stream is) the same bits as
    one process's."""
    (fp32,) = run_ranks(_validate, 1, "dense", "fp32", {}, timeout=120)
    (bf16,) = run_ranks(_validate, 1, "dense", "bf16", {}, timeout=120)
    pp2 = run_ranks(_validate, 2, "dense", "bf16", {"pp": 2, "schedule": "1f1b"}, timeout=120)
    assert set(fp32["matmuls"]) == {"torch.float32"}
    for result in (bf16, *pp2):
        assert set(result["matmuls"]) == {"torch.bfloat16"}, result["matmuls"]
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=1e-3) and bf16["loss"] != fp32["loss"]
    assert pp2[0]["loss"] == 0.0 and pp2[1]["loss"] == bf16["loss"]  # the last stage's rank


def test_a_tensor_token_count_divides_as_the_int_does():
    """The trainer hands `set_step_tokens` a 0-dim device tensor: the loss, the MoE balance
    loss and the router z-loss divide by it exactly as by the int (bitwise, eagerly)."""
    from optimus.parallel.loss import TokenSumLoss

    m = layer(router_z_loss=1e-3)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    out = {}
    for divisor in (32, torch.tensor(32)):
        m.zero_grad()
        m.reset_counters()
        m.step_tokens = divisor
        loss_fn = TokenSumLoss(z_loss=1e-4)
        loss_fn.tokens = divisor
        loss = loss_fn(m(x), labels)
        loss.backward()
        out[type(divisor)] = (loss.detach(), m.aux_total, m.z_total, m.router.weight.grad.clone())
    for want, got in zip(out[int], out[torch.Tensor], strict=True):
        assert torch.equal(want, got)


def test_routers_score_in_fp32_under_autocast():
    m = layer()
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    want = x @ m.router.weight.T
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m.router(x).dtype == torch.bfloat16  # what the router layer alone would give
        logits = m.router_logits(x)
        scores, chosen, _ = m.route(x)
        bf16 = m.router_logits(x.bfloat16())  # a bf16 residual stream is cast up as it enters
    assert logits.dtype == scores.dtype == bf16.dtype == torch.float32
    assert torch.allclose(logits, want, rtol=1e-6, atol=1e-7)
    assert torch.equal(chosen, m.route(x)[1])  # the same choices as without autocast
    assert torch.allclose(bf16, x.bfloat16().float() @ m.router.weight.T, rtol=1e-6, atol=1e-7)


def _worst_movement_error(got: dict, want: dict, start: dict) -> float:
    worst = 0.0
    for key, value in want.items():
        moved = value - start[key]
        if moved.norm() > 0:
            assert got[key].dtype == torch.float32, key
            worst = max(worst, float((got[key] - value).norm() / moved.norm()))
    return worst


def _merged(ranks: list[dict]) -> dict:
    return {k: v for result in ranks for k, v in result["state"].items()}


# name: (world, model kind, parallel); all at dp 1
ONE_REPLICA = {
    "dense-one-process": (1, "dense", {}),
    "dense-one-process-full-recompute": (1, "dense", {"activation_checkpoint": "full"}),
    "dense-TP2": (2, "dense", {"tp": 2}),
    "moe-one-process": (1, "moe", {}),
}
_dp2: dict[str, list[dict]] = {}


@pytest.mark.parametrize("name", list(ONE_REPLICA))
def test_one_replica_trains_in_bf16_like_fp32_and_like_fsdp2(run_ranks, name):
    world, kind, parallel = ONE_REPLICA[name]
    want = fp32_one_process(run_ranks, kind)
    if kind not in _dp2:  # FSDP2's bf16 over two replicas
        _dp2[kind] = run_ranks(_train, 2, job(kind, "bf16"), timeout=240)
    raw = job(kind, "bf16", **parallel)
    ranks = run_ranks(_train, world, raw, timeout=240)
    start, fsdp2 = _initial(raw), _dp2[kind]
    for result in ranks:
        assert result["losses"] == pytest.approx(want["losses"], rel=1e-3)
        assert result["losses"] != want["losses"]  # it did compute in bf16
        assert result["losses"] == pytest.approx(fsdp2[0]["losses"], rel=1e-3)
        assert result["losses"] != fsdp2[0]["losses"]  # and not through FSDP2's casts
    assert want["losses"][-1] < want["losses"][0]
    assert _worst_movement_error(_merged(ranks), want["state"], start) <= 0.15
    assert _worst_movement_error(_merged(ranks), _merged(fsdp2), start) <= 0.15


def test_full_recompute_replays_the_autocast_forward_exactly(run_ranks):
    """Recompute runs the blocks again under the autocast they first ran in: the same losses,
    to the bit, as without it (a recompute in float32 would give other activations)."""
    (plain,) = run_ranks(_train, 1, job("dense", "bf16"), timeout=240)
    (full,) = run_ranks(_train, 1, job("dense", "bf16", activation_checkpoint="full"),
                        timeout=240)
    assert full["losses"] == plain["losses"]
    for key, value in plain["state"].items():
        assert torch.equal(full["state"][key], value), key


def test_compiled_one_replica_trains_in_bf16_like_eager_and_compiles_once(run_ranks, tmp_path):
    """Inductor's blocks under autocast: as eager bf16 within bf16's bounds (fused kernels
    round differently), one graph for the blocks and one for the loss, compiled in the first
    steps only (autocast's state is part of what dynamo guards: a recompile would show)."""
    raw = job("dense", "bf16")
    (eager,) = run_ranks(_train, 1, raw, timeout=240)
    raw_compiled = compiled(raw, tmp_path)
    raw_compiled["training"]["mixed_precision"] = "bf16"
    (result,) = run_ranks(_train_counting_graphs, 1, raw_compiled, timeout=600)
    assert result["losses"] == pytest.approx(eager["losses"], rel=1e-3)
    assert _worst_movement_error(result["state"], eager["state"], _initial(raw)) <= 0.15
    assert result["graphs"] == 2
    events = compile_events(tmp_path)
    assert events and all(e["step"] <= 2 for e in events), events


@pytest.mark.parametrize(("saved_world", "resumed_world"), [(2, 1), (1, 2)])
def test_a_bf16_checkpoint_resumes_across_one_and_two_replicas(run_ranks, tmp_path,
                                                               saved_world, resumed_world):
    """Saved at dp 2 (FSDP2's DTensors) and resumed at dp 1 (plain tensors), or the reverse:
    the run continues where it stopped. From the weights of step 4 the loss is ~8% below the
    first step's, so a load that kept fresh weights is far outside bf16's 1e-3."""
    saved = tmp_path / "saved"
    bf16 = {"mixed_precision": "bf16"}
    original = run_ranks(_train_resumable, saved_world,
                         checkpoint_job(saved, training=bf16), timeout=300)
    _keep_only(saved / "checkpoints", 4)
    run_dir = tmp_path / "resumed"
    shutil.copytree(saved / "checkpoints", run_dir / "checkpoints")
    shutil.copytree(saved / "secrets", run_dir / "secrets")
    resumed = run_ranks(_train_resumable, resumed_world,
                        checkpoint_job(run_dir, training=bf16), timeout=300)
    losses = original[0]["losses"]
    assert losses[4] < losses[0] * 0.97
    for result in resumed:
        assert result["steps"] == [5, 6, 7, 8]
        assert result["losses"] == pytest.approx(losses[4:], rel=1e-3)
    assert _per_step_samples(resumed) == _per_step_samples(original)[4:]
