"""Regional torch.compile (`training.compile`), on CPU with inductor (gcc builds its kernels).

Each block is compiled on its own (and the loss, outside tensor parallelism); FSDP2, tensor
parallelism's redistributions and the pipeline stay eager around them. Compiled training
must follow eager training: inductor fuses and reorders float32 arithmetic, which changes
roundings of ~1e-7 relative per op; over 5 steps of Adam the loss stays within ~1e-6 of eager
(measured: at most 2e-7), and the bound is 1e-4. A wrong graph (a missed residual, a dropped
gradient, a stale weight) is off by percents.This test found one: traced into a compiled graph,
the MoE's auxiliary loss lost its gradient (router gradients 300x too small, the loss itself
unchanged), so `add_aux_loss` stays eager.

And it compiles once: dynamo may compile again in step 2 (a shape first seen there, e.g. an
MoE's tokens per expert, is then made dynamic), never later. The trainer logs each compile as
a "compile" event with its step, which the tests read back from metrics.jsonl.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from test_moe import moe_job
from test_parallel_matrix import LAYOUTS, base_job, reference, relative_error

from optimus.config import validate_job
from optimus.train import train

# The backend of the multi-rank tests (see test_the_layouts_train_compiled_like_eager).
LAYOUT_BACKEND = os.environ.get("LAYOUT_BACKEND", "aot_eager")


def _train(rank: int, world_size: int, raw: dict) -> dict:
    from optimus.parallel.compile import CompileStats

    result = train(validate_job(raw, world=world_size), keep_state=True, quiet=rank != 0)
    return {"losses": result.losses, "state": result.state, "graphs": CompileStats.now().graphs}


def compiled(raw: dict, run_dir: Path, backend: str = "inductor") -> dict:
    return {**raw, "training": {"compile": True, "compile_backend": backend},
            "run_dir": str(run_dir)}


def compile_events(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == "compile"]


def assert_matches(ranks: list[dict], want: dict, rel: float) -> None:
    merged: dict[str, torch.Tensor] = {}
    for result in ranks:
        assert result["losses"] == pytest.approx(want["losses"], rel=rel)
        merged.update(result["state"])
    for key, value in want["state"].items():
        if value.norm() == 0:  # a buffer that stays zero (the MoE bias under aux_loss)
            assert merged[key].norm() == 0, key
        else:
            assert relative_error(merged[key], value) <= rel, key


def test_compiled_dense_training_matches_eager_and_compiles_once(run_ranks, tmp_path):
    want = reference(run_ranks, 4)
    raw = compiled(base_job(), tmp_path)
    (result,) = run_ranks(_train, 1, raw, timeout=300)
    assert_matches([result], want, rel=1e-4)
    events = compile_events(tmp_path)
    assert events and events[0]["step"] == 1
    assert all(e["step"] <= 2 for e in events), events
    assert events[0]["seconds"] > 0
    # One graph for all four blocks (they share their code), one for the loss.
    assert result["graphs"] == 2


# The layouts compiled in CI: each adds a piece no other one holds. TP2xDP2, TP2xPP2 and
# PP2xDP2, and TP2 and DP2 alone, combine pieces that TP2xPP2xDP2 (and TP4, for tensor
# parallelism alone) compile all together: ~70 CPU-s of tracing on two cores saved, at the
# price of a bug that only a pair would show. COMPILE_LAYOUTS=all runs every layout of the
# matrix (all eleven passed when the set was cut, 2026-11-29).
COVERING = ("PP2-1f1b", "PP2v2-interleaved", "DP2-params-gathered-a-step",
            "TP2xPP2xDP2-stable", "PP3-7-layers", "TP4-kv-replicated-stable")
COMPILED_LAYOUTS = list(LAYOUTS) if os.environ.get("COMPILE_LAYOUTS") == "all" else [
    name for name in LAYOUTS if name in COVERING]


@pytest.mark.parametrize("name", COMPILED_LAYOUTS)
def test_the_layouts_train_compiled_like_eager(run_ranks, tmp_path, name):
    """Each layout traced and compiled by AOT autograd (what DTensor, FSDP2's hooks and the
    pipeline meet), without inductor's code generation, which every rank would pay for again
    (5 minutes more of CI); inductor runs the one-process dense test. LAYOUT_BACKEND=inductor runs
    these with inductor too (all pass: 192 s with a warm kernel cache, 2 cores)."""
    world, parallel = LAYOUTS[name]
    raw = compiled(base_job(**parallel), tmp_path, LAYOUT_BACKEND)
    want = reference(run_ranks, raw["model"]["n_layers"], raw["model"]["qk_norm"])
    assert_matches(run_ranks(_train, world, raw, timeout=300), want, rel=1e-4)
    assert all(e["step"] <= 2 for e in compile_events(tmp_path))


_moe_eager: dict[str, dict] = {}


@pytest.mark.parametrize("world,parallel", [(1, {}), (2, {"ep": 2})], ids=["one-process", "EP2"])
def test_moe_trains_compiled_like_eager(run_ranks, tmp_path, world, parallel):
    """MoE blocks compile in pieces (routing has data-dependent shapes: graph breaks), and
    compile again at step 2 at most, when their shapes are made dynamic. AOT autograd, as the
    layouts (the auxiliary loss's lost gradient showed there as with inductor); with
    LAYOUT_BACKEND=inductor these pass too, and so did TP2 x EP2."""
    if "want" not in _moe_eager:
        (_moe_eager["want"],) = run_ranks(_train, 1, moe_job(), timeout=120)
    raw = moe_job()
    raw["parallel"].update(parallel)
    raw = compiled(raw, tmp_path, LAYOUT_BACKEND)
    assert_matches(run_ranks(_train, world, raw, timeout=300), _moe_eager["want"], rel=1e-4)
    events = compile_events(tmp_path)
    assert events and all(e["step"] <= 2 for e in events), events
