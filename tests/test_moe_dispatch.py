"""What a mixture-of-experts layer asks of the device: ops that do not grow with the expert
count, no host read under a capacity, no float32 copy of the experts' rows under bf16, and
expert parallelism that sends each token once per destination rank, equal to one process.

Counted on a CPU with a TorchDispatchMode (every aten op the dispatcher runs, backward
included): what a device would launch and wait for.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from test_moe import layer
from torch.utils._python_dispatch import TorchDispatchMode

from optimus.models import moe_routes

EP = pytest.mark.expert_parallel
HOST_READ = "aten._local_scalar_dense"


class Ops(TorchDispatchMode):
    """Every op dispatched inside, by name, and the float32 outputs' sizes."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.float32_sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[str(func.overloadpacket)] += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.float32_sizes.append(t.numel())
        return out


def forward_backward(m, tokens: torch.Tensor) -> Ops:
    x = tokens.clone().requires_grad_()
    with Ops() as ops:
        m(x.view(1, *x.shape)).square().sum().backward()
    return ops


@pytest.mark.parametrize("capacity", [None, 1.25])
def test_the_ops_of_a_layer_do_not_grow_with_its_experts(capacity):
    """Forward and backward at 8 and at 64 experts dispatch the same ops, as many times."""
    counted = [forward_backward(layer(experts=n, capacity_factor=capacity),
                                torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
               for n in (8, 64)]
    assert counted[0].ops == counted[1].ops
    assert counted[0].ops["aten.bmm"] >= 3  # the experts' GEMMs ran (padded, on a CPU)


def test_capacity_routing_reads_nothing_on_the_host_and_dropless_once_on_a_cpu():
    """Capacity: every shape is the host's own (ceil(f x T x k / E) rows an expert): no read.
    Dropless on a CPU: the padded grouped GEMM reads its largest group once for the layer's
    three GEMMs (a CUDA device's native grouped GEMM reads nothing)."""
    tokens = torch.randn(64, 64)
    assert forward_backward(layer(capacity_factor=1.0), tokens).ops[HOST_READ] == 0
    assert forward_backward(layer(), tokens).ops[HOST_READ] == 1


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_bf16_dispatch_and_combine_make_no_float32_copy_of_the_experts_rows(capacity):
    """Under bf16 autocast no float32 tensor as large as the k-fold rows (tokens x k x dim)
    is made, forward or backward: the slots move in bf16 and sum with float32 accumulation.
    (The experts' float32 weight gradients are smaller here by construction.)"""
    m = layer(capacity_factor=capacity)
    n_tokens, dim = 256, 64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ops = forward_backward(m, torch.randn(n_tokens, dim))
    rows = n_tokens * m.top_k * dim
    assert max(ops.float32_sizes) < rows, sorted(ops.float32_sizes)[-5:]


def test_the_combined_output_equals_one_expert_at_a_time_under_bf16():
    """bf16 autocast: the layer's output within bf16 rounding of the float32 reference."""
    m = layer()
    tokens = torch.randn(48, 64)
    reference = m(tokens.view(1, 48, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(tokens.view(1, 48, 64))
    assert out.dtype == torch.bfloat16
    error = (out.float() - reference).norm() / reference.norm()
    assert 0 < error < 2e-2


# --- expert parallelism ------------------------------------------------------------------------

def _dedup(rank: int, world_size: int, moe: dict, bias: list[float] | None,
           n_tokens: int) -> dict:
    """One MoE layer under EP over all ranks against the same layer whole on this rank, on
    this rank's tokens: outputs and gradients, the dispatch's byte counters, host reads."""
    import torch.distributed as dist

    from optimus.parallel.expert_parallel import apply_expert_parallel

    m = layer(**moe)  # the same seed on every rank: the same weights
    if bias is not None:
        m.balance = "bias"
        m.expert_bias.copy_(torch.tensor(bias))
    whole = copy.deepcopy(m)
    mesh = dist.device_mesh.init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    apply_expert_parallel(m, mesh["ep"])
    x = torch.randn(n_tokens, 64, generator=torch.Generator().manual_seed(rank))
    reads = []
    real = moe_routes.host_sizes
    moe_routes.host_sizes = lambda t: reads.append(1) or real(t)
    try:
        outs = []
        for module in (m, whole):
            inp = x.clone().requires_grad_()
            with Ops() as ops:
                out = module(inp.view(1, n_tokens, 64)).view(n_tokens, 64)
                (out * torch.linspace(-1, 1, 64)).sum().backward()
            outs.append((out.detach(), inp.grad, module.router.weight.grad, ops))
    finally:
        moe_routes.host_sizes = real
    (out, grad, router, ops), (out1, grad1, router1, _) = outs
    dist.all_reduce(whole.experts.w2.grad)  # an expert learns from every rank's tokens
    local = m.experts_n // world_size
    shard = slice(rank * local, (rank + 1) * local)
    dispatch = m.dispatch
    return {"out": (out - out1).abs().max().item(), "grad": (grad - grad1).abs().max().item(),
            "router": (router - router1).abs().max().item(),
            "w2": (m.experts.w2.grad.to_local() - whole.experts.w2.grad[shard]).abs().max()
            .item(),
            "sent_bytes": dispatch.sent_bytes, "undeduplicated": dispatch.undeduplicated_bytes,
            "step_bytes": m.step_bytes,
            "host_reads": len(reads) + ops.ops[HOST_READ]}


@EP
def test_a_token_crosses_once_to_a_rank_that_holds_both_its_experts(run_ranks):
    """Top-2, EP2, every token's two experts on rank 1 (a bias that outweighs any score):
    rank 0 sends each of its tokens once (with its two slots' routing), not twice; rank 1
    sends rank 0's partial sums back, one row a token. Outputs and gradients as one process;
    one host read for the layer's forward and backward."""
    n_tokens, dim = 40, 64
    ranks = run_ranks(_dedup, 2, {"experts": 4, "top_k": 2}, [0.0, 0.0, 100.0, 100.0],
                      n_tokens, timeout=120)
    row, routing = dim * 4, 2 * 2 * 4  # fp32 rows; 2k fp32 of routing a row
    for r in ranks:
        assert max(r["out"], r["grad"], r["router"], r["w2"]) < 1e-5, r
        assert r["host_reads"] == 1
    # Forward and backward: twice each trip.
    assert ranks[0]["sent_bytes"] == 2 * n_tokens * (row + routing)
    assert ranks[1]["sent_bytes"] == 2 * n_tokens * row  # rank 0's tokens, summed, back
    assert ranks[0]["undeduplicated"] == 2 * (2 * n_tokens) * row  # two slots a token
    assert ranks[0]["step_bytes"] == ranks[0]["sent_bytes"]


@EP
@pytest.mark.parametrize("ep, moe", [
    (2, {"experts": 8, "top_k": 8}),
    (4, {"experts": 8, "top_k": 4, "score": "sigmoid"}),
    (2, {"experts": 4, "top_k": 2, "capacity_factor": 0.75}),
])
def test_deduplicated_expert_parallel_equals_one_process(run_ranks, ep, moe):
    """Random routing at top-8 over EP2 (every token to both ranks, eight slots folded into
    two rows), top-4 over EP4 with sigmoid scores, and a capacity that drops slots: outputs
    and gradients as the whole layer on one rank; fewer bytes than one row a slot."""
    for r in run_ranks(_dedup, ep, moe, None, 48, timeout=180):
        assert max(r["out"], r["grad"], r["router"], r["w2"]) < 1e-5, r
        assert r["host_reads"] == 1
        assert 0 < r["sent_bytes"] < r["undeduplicated"], r


def test_spread_and_fold_backward_are_each_others_forward():
    """The dropless gather and sum with their hand-written backwards: gradcheck in float64,
    uneven routing, one expert without a token."""
    chosen = torch.tensor([[0, 2], [2, 1], [0, 2], [1, 0], [2, 0]])
    slots = moe_routes.group_slots(chosen, 4)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)

    def round_trip(x, scale):
        rows, row_of_slot = moe_routes.spread(x, slots, 2)
        return moe_routes.fold(rows * scale, row_of_slot, slots, 2)

    scale = torch.rand(10, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(round_trip, (x, scale))
    rows, _ = moe_routes.spread(x, slots, 2)
    assert torch.equal(rows, x[slots.order // 2])  # expert-major, each token k times
