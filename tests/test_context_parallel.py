"""Context parallelism (`parallel.cp`): each sequence split over ranks, attention across them
by all-to-all or by a ring, equal to one process in every layout it composes with."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from optimus.parallel.context_parallel import (
    AllToAllAttention,
    RingAttention,
    SequenceSlice,
)

# --- the slice ----------------------------------------------------------------------------


def test_balanced_slices_pair_a_head_chunk_with_a_tail_chunk():
    runs = [SequenceSlice(r, 4).of(r, 32) for r in range(4)]
    assert runs == [[(0, 4), (28, 32)], [(4, 8), (24, 28)], [(8, 12), (20, 24)],
                    [(12, 16), (16, 20)]]
    # Causal work per rank: the keys each position attends to, summed, equal on every rank.
    work = [sum(p + 1 for a, b in r for p in range(a, b)) for r in runs]
    assert len(set(work)) == 1
    where = SequenceSlice(1, 4)
    assert where.positions(8, torch.device("cpu")).tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    tokens = torch.arange(64).view(2, 32)
    assert where.take(tokens)[1].tolist() == [36, 37, 38, 39, 56, 57, 58, 59]
    assert SequenceSlice(2, 4, balanced=False).of(2, 32) == [(16, 24)]
    with pytest.raises(ValueError, match="does not split into 2 x cp = 8 chunks"):
        SequenceSlice(0, 4).of(0, 36)


def _attention(rank: int, world: int, method: str, balanced: bool, hq: int, hkv: int):
    """This rank's errors against one process's causal attention: output, dq, dk, dv."""
    g = torch.Generator().manual_seed(0)
    b, s, d = 2, 24, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, d, generator=g)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=hkv != hq)
    want.backward(dout)
    where = SequenceSlice(rank, world, balanced)
    group = dist.new_group(list(range(world)))
    if method == "alltoall":
        attend = AllToAllAttention(group, where)
    else:  # "ring": the CPU's fused kernel a chunk pair; "ring-math": explicit math
        attend = RingAttention(group, where, kernel="math" if method == "ring-math" else None)

    def mine(t):  # [b, h, s, d] -> this rank's positions
        return where.take(t.transpose(1, 2)).transpose(1, 2).contiguous()

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    out = attend(*local)
    out.backward(mine(dout))
    errors = [float((out - mine(want)).abs().max())]
    errors += [float((a.grad - mine(w.grad)).abs().max())
               for a, w in zip(local, whole, strict=True)]
    return errors


@pytest.mark.parametrize("method, world, balanced, hq, hkv", [
    ("alltoall", 2, True, 4, 4), ("alltoall", 2, False, 4, 2), ("alltoall", 4, True, 4, 2),
    ("alltoall", 4, True, 8, 4), ("ring", 2, True, 4, 2), ("ring", 4, True, 4, 4),
    ("ring", 4, False, 3, 1), ("ring", 3, True, 6, 2), ("ring-math", 2, True, 4, 2),
    ("ring-math", 4, False, 4, 4), ("ring-math", 3, True, 6, 2)])
def test_attention_across_ranks_equals_one_process(run_ranks, method, world, balanced, hq, hkv):
    """Outputs and the gradients of q, k, v, with grouped-query heads (repeated for the
    all-to-all where they do not split), head counts that do not split (the ring), and an odd
    group size."""
    for errors in run_ranks(_attention, world, method, balanced, hq, hkv, timeout=120):
        assert max(errors) < 1e-5, errors


# --- training: every layout with cp equals one process --------------------------------------

# name: (world, parallel). The dense matrix's job (tests/test_parallel_matrix.py): 4 heads, 2 kv
# heads, 32 positions, 5 steps of 4 microbatches; fp32, losses and weights within 1e-5.
LAYOUTS = {
    "CP2-alltoall": (2, {"cp": 2}),
    "CP2-ring": (2, {"cp": 2, "cp_method": "ring"}),
    "CP4-alltoall": (4, {"cp": 4}),  # 2 kv heads repeated for 4 ranks
    "CP4-ring-contiguous": (4, {"cp": 4, "cp_method": "ring", "cp_split": "contiguous"}),
    "CP2xTP2": (4, {"cp": 2, "tp": 2}),
    "CP2xTP2-ring": (4, {"cp": 2, "tp": 2, "cp_method": "ring"}),
    "CP2xPP2": (4, {"cp": 2, "pp": 2, "schedule": "1f1b"}),
    "CP2xDP2": (4, {"cp": 2, "dp": 2}),
    "CP2-ring-recompute": (2, {"cp": 2, "cp_method": "ring", "activation_checkpoint": "full"}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_layouts_train_like_one_process(run_ranks, name):
    from test_parallel_matrix import trains_like_one_process

    ranks = trains_like_one_process(run_ranks, *LAYOUTS[name])  # asserts against one process
    # Every rank, whichever slice of the sequences it held, reports the same summed loss.
    assert len({tuple(r["losses"]) for r in ranks}) == 1


@pytest.mark.parametrize("method", ["alltoall", "ring"])
def test_context_parallel_trains_compiled_like_eager(run_ranks, tmp_path, method):
    """Blocks compiled by AOT autograd around the exchanges: the all-to-all's functional
    collectives trace; the ring's sends run as they are (a graph break)."""
    from test_compile import LAYOUT_BACKEND, _train, assert_matches, compile_events, compiled
    from test_parallel_matrix import base_job, reference

    raw = compiled(base_job(cp=2, cp_method=method), tmp_path, LAYOUT_BACKEND)
    ranks = run_ranks(_train, 2, raw, timeout=300)
    assert_matches(ranks, reference(run_ranks, 4), rel=1e-4)
    assert all(r["graphs"] >= 2 for r in ranks)  # the blocks' pieces and the loss
    assert compile_events(tmp_path)[0]["step"] == 1


# --- checkpoints: the state does not depend on cp --------------------------------------------


def _train_reading(rank: int, world_size: int, raw: dict) -> dict:
    """Train; the samples each step read, kept by one rank of each data-parallel replica."""
    from optimus.config import resolve_layout, validate_job
    from optimus.train import train

    job = validate_job(raw, world=world_size)
    result = train(job, keep_sample_ids=True, quiet=rank != 0)
    coords = resolve_layout(job, world_size).coords(rank)
    return {"losses": result.losses, "steps": [m.step for m in result.metrics],
            "samples": result.sample_ids if coords["dp"] == rank == 0 or
            (coords["tp"] == coords["pp"] == coords["cp"] == 0) else None}


def test_a_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4(run_ranks, tmp_path):
    import shutil

    from test_checkpoint_resume import STEPS, _keep_only, job

    from optimus.data.audit import audit_run

    saved = tmp_path / "saved"
    original = run_ranks(_train_reading, 2, job(saved, parallel={"cp": 2}), timeout=240)
    assert original[1]["samples"] is None  # the cp ranks of a replica read the same samples
    assert original[0]["losses"] == original[1]["losses"]
    _keep_only(saved / "checkpoints", 4)
    for name, world, parallel in (("cp1", 1, {}),
                                  ("cp4-ring", 4, {"cp": 4, "cp_method": "ring"})):
        run_dir = tmp_path / name
        shutil.copytree(saved / "checkpoints", run_dir / "checkpoints")
        shutil.copytree(saved / "secrets", run_dir / "secrets")
        resumed = run_ranks(_train_reading, world, job(run_dir, parallel=parallel),
                            timeout=240)
        for result in resumed:
            assert result["steps"] == list(range(5, STEPS + 1))
            assert result["losses"] == pytest.approx(original[0]["losses"][4:], rel=1e-5)
        assert resumed[0]["samples"] == original[0]["samples"][4:]  # the very next samples
        audit = audit_run(run_dir)
        assert audit.ok, audit.problems
        assert (audit.steps, audit.end) == (STEPS - 4, STEPS * 8)
    audit = audit_run(saved)  # every sample once, as without cp
    assert audit.ok and (audit.steps, audit.end) == (STEPS, STEPS * 8), audit.problems


# --- the config check: what cannot work is refused, one line each -----------------------------


@pytest.mark.parametrize("parallel, data, world, message", [
    ({"cp": 4}, {"seq_len": 36}, 4,
     "data.seq_len: 36 does not split into 2 x cp chunks, a head and a tail one a rank "
     r"\(cp=4: 8\) — fix: use a multiple of 8, or cp among \[2, 3, 6, 9, 18\]"),
    ({"cp": 4, "cp_split": "contiguous"}, {"seq_len": 30}, 4,
     r"data.seq_len: 30 does not split into cp runs \(cp=4: 4\)"),
    ({"cp": 2, "tp": 4, "cp_method": "ring"}, {"seq_len": 36}, 8,
     r"data.seq_len: each rank's slice of 18 positions \(seq_len / cp\) does not split over "
     r"tp=4 \(sequence parallel\) — fix: use a multiple of 16"),
    ({"cp": 8}, {}, 8, r"parallel.cp: all-to-all attention gives each rank n_heads / \(tp x cp\)"
     r" query heads, and 4 \(n_heads / tp\) do not split over cp=8 — fix: use cp among "
     r"\[1, 2, 4\], or parallel.cp_method: ring"),
    ({"cp": 2, "dp": 2}, {}, 8, r"parallel.dp: dp x tp x pp x cp = 2 x 1 x 1 x 2 = 4 but the "
     "world has 8 ranks — fix: set parallel.dp to 4"),
])
def test_the_check_refuses_what_context_parallelism_cannot_run(parallel, data, world, message):
    from test_parallel_matrix import base_job

    from optimus.config import ConfigError, check_job, validate_job

    raw = base_job(**parallel)
    raw["data"].update(data)
    raw["model"]["max_seq_len"] = 64
    with pytest.raises(ConfigError, match=message) as refused:
        check_job(validate_job(raw), world=world)
    assert len(str(refused.value).splitlines()) == 1  # one problem, one line


def test_the_check_refuses_experts_that_split_a_context_group():
    from test_moe import moe_job

    from optimus.config import ConfigError, check_job, validate_job

    raw = moe_job()
    raw["parallel"].update(cp=4, ep=2)
    raw["data"]["seq_len"] = 32
    with pytest.raises(ConfigError, match="parallel.ep: ep=2 is not a multiple of cp=4"):
        check_job(validate_job(raw), world=4)
    raw["parallel"].update(cp=2, ep=4)  # dp 2 lends 2 ranks: ep / cp = 2 divides dp = 2
    assert check_job(validate_job(raw), world=4).coords(3)["ep"] == 3
    raw["parallel"].update(cp=2, ep=4, dp=3)
    with pytest.raises(ConfigError, match=r"ep=4 takes ep / cp = 2 data-parallel ranks, which "
                       r"does not divide dp=3 — fix: use ep among 2, 6"):
        check_job(validate_job(raw), world=6)


# --- what reads a checkpoint trained with cp ---------------------------------------------------


def _train_state(rank: int, world_size: int, raw: dict) -> dict:
    from optimus.config import validate_job
    from optimus.train import train

    return train(validate_job(raw, world=world_size), keep_state=True, quiet=True).state


def _evaluate(rank: int, world_size: int, path: str, overrides: list) -> float:
    from pathlib import Path

    from optimus.evaluate import evaluate_checkpoint

    return evaluate_checkpoint(Path(path), data=None, batches=2, overrides=overrides)[0].loss


def test_a_cp_checkpoint_exports_to_hugging_face_and_evaluates_on_any_cp(run_ranks, tmp_path):
    from test_checkpoint_resume import job

    from optimus.checkpoint import latest_committed
    from optimus.config import validate_job
    from optimus.hf import export_hf, load_hf
    from optimus.models import build_model

    raw = job(tmp_path, parallel={"cp": 2, "cp_method": "ring"}, optim={"steps": 4})
    states = run_ranks(_train_state, 2, raw, timeout=240)
    trained = {**states[0], **states[1]}
    step = latest_committed(tmp_path / "checkpoints")
    export_hf(step, tmp_path / "hf")
    cfg = validate_job(raw).model
    model = build_model(cfg, seed=0)  # other weights, until the export fills them
    load_hf(tmp_path / "hf", cfg, [model])
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    (whole,) = run_ranks(_evaluate, 1, str(step), ["parallel.cp=1"], timeout=120)
    for cp, method in ((2, "alltoall"), (4, "ring")):
        for loss in run_ranks(_evaluate, cp, str(step),
                              [f"parallel.cp={cp}", f"parallel.cp_method={method}"],
                              timeout=120):
            assert loss == pytest.approx(whole, rel=2e-5)
