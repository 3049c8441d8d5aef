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
    attend = {"alltoall": AllToAllAttention, "ring": RingAttention}[method](group, where)

    def mine(t):  # [b, h, s, d] -> this rank's positions
        return where.take(t.transpose(1, 2)).transpose(1, 2).contiguous()

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    out = attend(*local)
    out.backward(mine(dout))
    errors = [float((out - mine(want)).abs().max())]
    errors += [float((a.grad - mine(w.grad)).abs().max()) for a, w in zip(local, whole)]
    return errors


@pytest.mark.parametrize("method, world, balanced, hq, hkv", [
    ("alltoall", 2, True, 4, 4), ("alltoall", 2, False, 4, 2), ("alltoall", 4, True, 4, 2),
    ("alltoall", 4, True, 8, 4), ("ring", 2, True, 4, 2), ("ring", 4, True, 4, 4),
    ("ring", 4, False, 3, 1), ("ring", 3, True, 6, 2)])
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
    from test_parallel_matrix import STEPS, _train, base_job, reference, relative_error

    world, parallel = LAYOUTS[name]
    raw = base_job(**parallel)
    one = reference(run_ranks, raw["model"]["n_layers"])
    ranks = run_ranks(_train, world, raw, timeout=240)
    merged: dict[str, torch.Tensor] = {}
    for result in ranks:
        assert len(result["losses"]) == STEPS
        assert result["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert result["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
        merged.update(result["state"])
    assert merged.keys() == one["state"].keys()
    for key, value in one["state"].items():
        assert relative_error(merged[key], value) <= 1e-5, key
    assert one["losses"][-1] < one["losses"][0]
