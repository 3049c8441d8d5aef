"""Expert parallelism over the `ep` mesh axis, applied from outside the model.

Each MoE layer's stacked expert weights become DTensors sharded by expert (Shard(0)) over `ep`:
ep rank r holds experts r * E/ep .. (r + 1) * E/ep - 1. `MoE.dispatch` is replaced, per layer,
by an all-to-all dispatch:

1. route locally (the router is a dense, replicated parameter) and group this rank's slots by
   expert, as without EP (capacity, if any, applies to this rank's microbatch, as under plain
   data parallelism);
2. exchange the per-expert counts (one all-to-all of E integers), then the tokens themselves
   (an all-to-all with uneven splits: each rank sends every other rank the tokens routed to its
   experts);
3. regroup what arrived (source-major) by local expert, run the local experts by grouped GEMM,
   put the outputs back in arrival order;
4. send them home (the reverse all-to-all) and combine with the routing weights locally.

Both token all-to-alls are differentiable (the functional collectives' all_to_all_single,
which torch 2.13 differentiates): backward runs the mirror exchange, so each expert's gradient
on its owner already sums the tokens of the whole ep group. Their sizes come from this step's
counts; nothing is kept across steps.

Expert weights are then sharded for the optimizer over the expert-data-parallel axis `edp`
(dp / ep replicas of each expert) by FSDP2, dense weights over the whole `dp`: see
`apply_data_parallel`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from optimus.models.moe import MoE, moe_layers, swiglu_experts
from optimus.runtime.dims import own_group


def expert_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """This rank's ep group, as a process group of its own, used by no other collective (see
    `own_group`: FSDP's asynchronous collectives on dp would otherwise interleave with the
    dispatch's all-to-alls when dp and ep span the same ranks)."""
    return own_group(mesh, ("ep",))


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh,
                          group: dist.ProcessGroup | None = None) -> None:
    """Shard every MoE layer's experts over `ep_mesh` and dispatch by all-to-all (on `group`,
    by default the mesh's own)."""
    ep = ep_mesh.size()
    for moe in moe_layers(model):
        if moe.experts_n % ep:
            raise ValueError(f"{moe.experts_n} experts do not split over ep={ep}")
        for name in ("w1", "w2", "w3"):
            full = getattr(moe.experts, name)
            # The local shard, no communication (still on meta when the trainer builds the
            # model: init_weights later fills each shard with its part of the full values).
            shard = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(moe.experts, name, nn.Parameter(shard))
        # Called through the module, so that FSDP's hooks gather the weights over edp first.
        moe.experts.forward = partial(_local_experts, moe.experts)
        moe.dispatch = _AllToAllDispatch(moe, group or ep_mesh.get_group())


class _AllToAllDispatch:
    """`MoE.dispatch` for one layer under expert parallelism (see the module's docstring)."""

    def __init__(self, moe: MoE, group: dist.ProcessGroup):
        self.moe, self.group = moe, group
        self.ep = group.size()
        self.local = moe.experts_n // self.ep

    def __call__(self, tokens: torch.Tensor, chosen: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        moe, ep, local = self.moe, self.ep, self.local
        kept, counts = moe.slots(chosen, tokens.shape[0])
        # How many of each of my local experts' tokens every rank sends me: [ep, local].
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts, group=self.group)
        sent = counts.view(ep, local).sum(1).tolist()
        got = arriving.view(ep, local).sum(1).tolist()
        x = funcol.all_to_all_single_autograd(tokens[kept // moe.top_k], got, sent, self.group)
        # Arrival order is by source rank, then local expert; the experts want expert-major.
        segment = torch.repeat_interleave(torch.arange(ep * local, device=x.device), arriving)
        order = torch.argsort((segment % local) * ep + segment // local, stable=True)
        y = moe.experts(x[order], arriving.view(ep, local).sum(0))
        y = y[torch.argsort(order)]  # back to arrival order
        y = funcol.all_to_all_single_autograd(y, sent, got, self.group)
        return moe.combine(tokens, kept, y, weights)


def _local_experts(experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """This rank's experts (its shard of the stacked weights) on the tokens sent to them."""
    w1, w3, w2 = (_local(getattr(experts, n)) for n in ("w1", "w3", "w2"))
    return swiglu_experts(x, w1, w3, w2, counts)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w
