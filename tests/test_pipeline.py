"""Pipeline parallelism: the schedule rules agree with torch, and every schedule trains like
one process (per-microbatch losses and every gradient, in fp32)."""

from __future__ import annotations

import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import torch
import torch.distributed.pipelining as pipelining
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from optimus.config.schedule_rules import (
    SCHEDULES,
    SINGLE_STAGE,
    is_multi_stage,
    schedule_problem,
    stage_ids,
    stage_layers,
    stage_style,
)
from optimus.models import build_model
from optimus.parallel.pipeline import build_schedule, build_stage_models, run_pipeline_step

SEED, MB_SIZE, SEQ = 3, 2, 16


def _cfg(n_layers: int = 4) -> types.SimpleNamespace:
    return types.SimpleNamespace(vocab_size=256, dim=32, n_layers=n_layers, n_heads=2,
                                 n_kv_heads=2, ffn_dim=64, max_seq_len=32, rope_theta=10000.0,
                                 norm_eps=1e-5, init_std=0.02, qk_norm=False)


# --- rules ------------------------------------------------------------------------------------

def test_schedule_names_are_the_job_files_and_torchs():
    from optimus.config.schema import ParallelConfig

    job_file_names = typing.get_args(ParallelConfig.model_fields["schedule"].annotation)
    assert set(SCHEDULES) == set(job_file_names)
    for cls in SCHEDULES.values():
        assert issubclass(getattr(pipelining, cls), pipelining.schedules._PipelineSchedule)


def test_rules_import_no_torch():
    code = ("import sys; import optimus.config.schedule_rules; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_the_trainer_imports_no_dynamo_until_a_pipeline_or_a_compile_needs_it():
    """Dynamo (~0.6 s of CPU) stays out of a rank's start: every rank, warm process and
    standby pays its imports. Building a pipeline schedule or compiling brings it in."""
    code = ("import sys; import optimus.train; "
            "assert 'torch._dynamo' not in sys.modules, 'dynamo was imported'; "
            "import torch.distributed.pipelining; assert 'torch._dynamo' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


@pytest.mark.parametrize(("schedule", "pp", "v", "m", "wrong", "fix"), [
    ("gpipe", 2, 2, 4, "gpipe runs one stage per rank, got virtual_stages=2", "virtual_stages: 1"),
    ("1f1b", 2, 3, 4, "1f1b runs one stage per rank", "virtual_stages: 1"),
    ("1f1b", 4, 1, 3, "at least as many microbatches as stages (pp=4), got 3",
     "data.microbatches >= 4"),
    ("interleaved_1f1b", 4, 2, 9, "9 microbatches in 9 // pp=4 = 2 rounds",
     "data.microbatches to 8 or 10"),
    ("interleaved_zero_bubble", 2, 2, 5, "5 // pp=2 = 2 rounds", "to 4 or 6"),
    ("interleaved_1f1b", 3, 2, 7, "7 // pp=3 = 2 rounds", "to 6 or 8"),
    ("zbv_zero_bubble", 2, 1, 4, "zbv_zero_bubble needs exactly 2 virtual stages per rank, got 1",
     "set parallel.virtual_stages: 2"),
    ("dualpipev", 2, 3, 8, "exactly 2 virtual stages per rank, got 3", "virtual_stages: 2"),
    ("dualpipev", 2, 2, 3, "(2 x pp = 4), got 3", "data.microbatches >= 4"),
    ("zigzag", 2, 1, 4, "unknown schedule 'zigzag'", "gpipe, 1f1b"),
])
def test_schedule_problem_refuses_with_a_fix(schedule, pp, v, m, wrong, fix):
    problem = schedule_problem(schedule, pp, v, m)
    assert problem is not None
    assert wrong in problem[0] and fix in problem[1], problem


@pytest.mark.parametrize(("schedule", "pp", "v", "m"), [
    ("gpipe", 4, 1, 1), ("1f1b", 4, 1, 4), ("1f1b", 2, 1, 3),
    ("interleaved_1f1b", 4, 1, 2), ("interleaved_1f1b", 4, 2, 3), ("interleaved_1f1b", 4, 3, 10),
    ("interleaved_zero_bubble", 2, 1, 6), ("looped_bfs", 4, 2, 9), ("looped_bfs", 2, 1, 1),
    ("zbv_zero_bubble", 4, 2, 1), ("dualpipev", 2, 2, 4), ("dualpipev", 3, 2, 7),
])
def test_schedule_problem_accepts(schedule, pp, v, m):
    assert schedule_problem(schedule, pp, v, m) is None


class _StubStage:
    """What a schedule's constructor reads from its stages."""

    submod = None

    def __init__(self, stage_index: int, num_stages: int, group_size: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = group_size, 0
        self.stage_index_to_group_rank: dict[int, int] = {}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_rules_agree_with_torchs_constructors(schedule):
    """Over a grid of layouts, torch refuses exactly what schedule_problem refuses."""
    cls = getattr(pipelining, SCHEDULES[schedule])
    for pp in (1, 2, 3, 4):
        for v in ((1,) if schedule in SINGLE_STAGE else (1, 2, 3)):
            ids = [k * pp for k in range(v)]  # rank 0's stages ("v" style needs exactly 2)
            if stage_style(schedule) == "v" and v == 2:
                ids = stage_ids(0, pp, v, "v")
            stubs = [_StubStage(i, pp * v, pp) for i in ids]
            for m in range(1, 13):
                try:
                    cls(stubs if is_multi_stage(schedule) else stubs[0], n_microbatches=m)
                    torch_ok = True
                except ValueError:
                    torch_ok = False
                ours = schedule_problem(schedule, pp, v, m)
                assert torch_ok == (ours is None), (schedule, pp, v, m, ours)


def test_stage_layers_contiguous_and_even():
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_layers(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert stage_layers(6, 2) == [range(0, 3), range(3, 6)]
    with pytest.raises(ValueError, match="3 layers cannot fill 4"):
        stage_layers(3, 4)


def test_stage_ids_loop_and_v():
    assert [stage_ids(r, 4, 1, "loop") for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_ids(r, 2, 3, "loop") for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [stage_ids(r, 3, 2, "v") for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert stage_style("zbv_zero_bubble") == stage_style("dualpipev") == "v"
    assert {stage_style(s) for s in SCHEDULES if s not in ("zbv_zero_bubble", "dualpipev")} == {
        "loop"}
    with pytest.raises(ValueError, match="2 stages per rank"):
        stage_ids(0, 2, 3, "v")


def test_stage_models_hold_their_layers_with_one_process_weights():
    cfg = _cfg(7)
    full = dict(build_model(cfg, SEED).named_parameters())
    stages = build_stage_models(cfg, SEED, "cpu", [0, 1, 2], 3)
    assert [list(s.layers) for s in stages] == [["0", "1", "2"], ["3", "4"], ["5", "6"]]
    assert stages[0].tok_embeddings is not None and stages[0].output is None
    assert stages[1].tok_embeddings is None and stages[1].norm is None
    assert stages[2].norm is not None and stages[2].output is not None
    seen = {}
    for stage in stages:
        seen.update(stage.named_parameters())
    assert seen.keys() == full.keys()
    for name, param in seen.items():
        torch.testing.assert_close(param, full[name], rtol=0, atol=0, msg=name)
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ))
    h = tokens
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, build_model(cfg, SEED)(tokens), rtol=1e-5, atol=1e-6)


# --- real pipelines against one process -------------------------------------------------------

def _batch(cfg, microbatches: int, replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (replicas * microbatches * MB_SIZE, SEQ + 1),
                           generator=g)
    return tokens[:, :-1], tokens[:, 1:]


class _TokenSumLoss:
    """The trainer's loss: summed cross-entropy over the global token count."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                               reduction="sum") / self.tokens


def _one_process(cfg, microbatches: int, replicas: int = 1) -> tuple[list[float], dict]:
    tokens, labels = _batch(cfg, microbatches, replicas)
    loss_fn, model = _TokenSumLoss(labels.numel()), build_model(cfg, SEED)
    pairs = zip(tokens.split(MB_SIZE), labels.split(MB_SIZE), strict=True)
    losses = [loss_fn(model(x), y) for x, y in pairs]
    sum(losses).backward()
    return [loss.item() for loss in losses], {n: p.grad for n, p in model.named_parameters()}


def _pipeline_rank(rank: int, world_size: int, schedule: str, v: int, n_layers: int,
                   microbatches: int, dp: int, steps: int) -> list[tuple[list[float], dict]]:
    from optimus.parallel.data_parallel import apply_data_parallel
    from optimus.runtime.dims import ParallelDims

    dims = ParallelDims(dp=dp, pp=world_size // dp)
    mesh, coords = dims.build_mesh("cpu"), dims.coords(rank)
    cfg, num_stages = _cfg(n_layers), dims.pp * v
    ids = stage_ids(coords["pp"], dims.pp, v, stage_style(schedule))
    models = build_stage_models(cfg, SEED, "cpu", ids, num_stages)
    if dp > 1:
        for model in models:
            apply_data_parallel(model, mesh.mesh("shard"))
    tokens, labels = _batch(cfg, microbatches, dp)
    mine = slice(coords["dp"] * len(tokens) // dp, (coords["dp"] + 1) * len(tokens) // dp)
    pipe = build_schedule(models, ids, num_stages, mesh.group("pipeline"), "cpu", schedule,
                          microbatches, _TokenSumLoss(labels.numel()))
    out = []
    for _ in range(steps):  # the same batch again: gradients must not depend on the step
        for model in models:
            model.zero_grad()
        losses = run_pipeline_step(pipe, ids, num_stages, tokens[mine], labels[mine])
        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                 for model in models for n, p in model.named_parameters()}
        out.append(([loss.item() for loss in losses], grads))
    return out


@pytest.mark.parametrize(("schedule", "pp", "v", "n_layers"), [
    ("1f1b", 2, 1, 4),
    ("gpipe", 2, 1, 4),
    ("interleaved_1f1b", 2, 2, 4),
    ("looped_bfs", 2, 2, 4),
    ("interleaved_zero_bubble", 2, 2, 4),
    ("zbv_zero_bubble", 2, 2, 4),
    ("dualpipev", 2, 2, 4),
    ("1f1b", 3, 1, 7),  # uneven: 3, 2, 2 layers
])
def test_pipeline_trains_like_one_process(run_ranks, schedule, pp, v, n_layers):
    _check_like_one_process(run_ranks, schedule, pp, v, n_layers, dp=1, steps=1)


def test_pipeline_with_fsdp_zero_bubble_trains_like_one_process(run_ranks):
    """pp=2 x dp=2, FSDP2 stages: zero-bubble weight gradients survive resharding, twice."""
    _check_like_one_process(run_ranks, "zbv_zero_bubble", 2, 2, 4, dp=2, steps=2)


def _check_like_one_process(run_ranks, schedule, pp, v, n_layers, dp, steps):
    microbatches = 4
    assert schedule_problem(schedule, pp, v, microbatches) is None
    results = run_ranks(_pipeline_rank, pp * dp, schedule, v, n_layers, microbatches, dp, steps,
                        timeout=60)
    ref_losses, ref_grads = _one_process(_cfg(n_layers), microbatches, dp)
    last_stage_pp_rank = 0 if stage_style(schedule) == "v" else pp - 1
    for step in range(steps):
        held = [set() for _ in range(dp)]  # parameter names, per data-parallel replica
        for rank, per_step in enumerate(results):
            losses, grads = per_step[step]
            pp_rank, dp_rank = divmod(rank, dp)  # rank order: pp outermost (ParallelDims)
            if pp_rank == last_stage_pp_rank:
                mine = ref_losses[dp_rank * microbatches:(dp_rank + 1) * microbatches]
                assert losses == pytest.approx(mine, rel=1e-5), (rank, step)
            else:
                assert losses == [], rank
            assert not held[dp_rank] & grads.keys(), f"rank {rank} repeats another's parameters"
            held[dp_rank] |= grads.keys()
            for name, grad in grads.items():
                where = f"step {step}, rank {rank}, {name}"
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7,
                                           msg=lambda m, where=where: f"{where}: {m}")
        assert all(names == ref_grads.keys() for names in held)
