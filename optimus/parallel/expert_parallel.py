"""Expert parallelism over the `ep` mesh axis, applied from outside the model.

Each MoE layer's stacked expert weights become DTensors sharded by expert (Shard(0)) over `ep`:
ep rank r holds experts r * E/ep .. (r + 1) * E/ep - 1. `MoE.dispatch` is replaced, per layer,
by an all-to-all dispatch that sends each token once to each rank holding one of its experts,
however many of its top k live there:

1. route locally (the router is a dense, replicated parameter) and group this rank's slots by
   expert, as without EP (capacity, if any, applies to this rank's microbatch, as under plain
   data parallelism: a dropped slot is not sent);
2. exchange per destination rank the number of tokens and of slots for each of its experts
   (one all-to-all of small integers), and read the split sizes on the host: the layer's one
   host read, as the collectives need their sizes before they start;
3. send each (token, rank) pair's row once in the compute dtype, with its routing: the local
   expert of each of its k slots (or none) and the slot's weight, 2k float32 numbers;
4. the receiving rank fans the rows out to its experts (grouped by expert), runs them by
   grouped GEMM with each slot's weight applied, and sums each row's slots (a token's partial
   sum on this rank) before the return trip;
5. the partial sums go home (the reverse all-to-all), where each token's, one per rank it
   went to, are summed with float32 accumulation.

All three all-to-alls (rows, routing, partial sums) are differentiable (the functional
collectives' all_to_all_single, which torch 2.13 differentiates): backward runs the mirror
exchanges, so each expert's gradient on its owner already sums the tokens of the whole ep
group, and the routing weights' gradients come home. Their sizes come from this step's
counts; nothing is kept across steps. The bytes sent are counted from the host's split sizes
(`sent_bytes`, the step's `MoE.step_bytes`, exported as `optimus_moe_alltoall_bytes`).

Expert weights are then sharded for the optimizer over the expert-data-parallel axis `edp`
(dp / ep replicas of each expert) by FSDP2, dense weights over the whole `dp`: see
`apply_data_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from optimus.models import moe_routes
from optimus.models.moe import MoE, counting, dry, moe_layers, swiglu_experts
from optimus.models.moe_routes import in_compute_dtype, place_in_expert, token_major


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh,
                          group: dist.ProcessGroup | None = None) -> None:
    """Shard every MoE layer's experts over `ep_mesh` and dispatch by all-to-all (on `group`,
    by default the mesh's own). The trainer's `group` is one used by no other collective
    (`LayoutMesh.own_group("experts")`): FSDP's asynchronous collectives on dp would otherwise
    interleave with the dispatch's all-to-alls when dp and ep span the same ranks."""
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


@dataclass
class _Sizes:
    """A layer's split sizes, read on the host: per ep rank, the rows this rank sends
    (`sent`) and receives (`got`), the slots in them each way; per local expert, its rows."""

    sent: list[int]
    got: list[int]
    slots_out: list[int]
    slots_in: list[int]
    expert_rows: list[int]


class _AllToAllDispatch:
    """`MoE.dispatch` for one layer under expert parallelism (see the module's docstring).

    `sent_bytes`: what this rank's all-to-alls have sent to other ranks (tokens, their routing
    and the partial sums coming back; a training pass's backward counted as as many again);
    `undeduplicated_bytes`: what a dispatch of one row a slot would have sent. Both grow from
    the host's own split sizes: counting them reads nothing from the device."""

    def __init__(self, moe: MoE, group: dist.ProcessGroup):
        self.moe, self.group = moe, group
        self.ep = group.size()
        self.me = group.rank()
        self.local = moe.experts_n // self.ep
        self.sent_bytes = self.undeduplicated_bytes = 0

    def __call__(self, tokens: torch.Tensor, chosen: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        moe, k = self.moe, self.moe.top_k
        n_tokens = tokens.shape[0]
        x = in_compute_dtype(tokens)
        slots = moe.slots(chosen)
        counts, valid = slots.counts, None  # valid: [tokens, k], the slots not dropped
        capacity = moe.capacity(n_tokens)
        if capacity is not None:
            valid = token_major(place_in_expert(slots) < capacity, slots).view(n_tokens, k)
            counts = counts.clamp(max=capacity)
        rank_of = torch.div(chosen, self.local, rounding_mode="floor")  # each slot's ep rank
        # pair[t, r]: token t goes to rank r (once, however many of its experts live there).
        ones = torch.ones_like(rank_of, dtype=torch.int32) if valid is None else valid.int()
        pair = torch.zeros(n_tokens, self.ep, dtype=torch.int32, device=x.device).scatter_add_(
            1, rank_of, ones) > 0
        sizes, arriving = self._sizes(pair, counts)
        token, dest, routing = self._rows(pair, rank_of, valid, chosen, weights, sizes)
        x_in = funcol.all_to_all_single_autograd(x.index_select(0, token), sizes.got,
                                                 sizes.sent, self.group)
        routing = funcol.all_to_all_single_autograd(routing, sizes.got, sizes.sent, self.group)
        partial = self._experts(x_in, routing, arriving, sizes)
        back = funcol.all_to_all_single_autograd(partial, sizes.sent, sizes.got, self.group)
        self._count(sizes, x.element_size() * x.shape[-1], routing.element_size() * 2 * k,
                    weights.requires_grad)
        # Each token's partial sums, one per rank it went to: summed with float32 accumulation.
        width = min(self.ep, k)  # the most ranks a token can go to
        place = (pair.cumsum(1) - 1)[token, dest]
        return _sum_partials(back, token * width + place, n_tokens, width)

    def _sizes(self, pair: torch.Tensor, counts: torch.Tensor) -> tuple[_Sizes, torch.Tensor]:
        """Exchange what each rank sends each other (tokens, and slots per local expert) and
        read every split size on the host: the layer's one host read."""
        ep, local = self.ep, self.local
        per_rank = pair.sum(0)
        header = torch.cat([per_rank.view(ep, 1), counts.view(ep, local)], 1)
        arriving = torch.empty_like(header)
        dist.all_to_all_single(arriving, header, group=self.group)
        read = moe_routes.host_sizes(torch.cat([per_rank, counts.view(ep, local).sum(1),
                                                arriving.flatten()]))
        rows_in = [read[2 * ep + r * (local + 1):2 * ep + (r + 1) * (local + 1)]
                   for r in range(ep)]
        return _Sizes(sent=read[:ep], slots_out=read[ep:2 * ep],
                      got=[row[0] for row in rows_in], slots_in=[sum(r[1:]) for r in rows_in],
                      expert_rows=[sum(r[1 + e] for r in rows_in) for e in range(local)]), \
            arriving

    def _rows(self, pair: torch.Tensor, rank_of: torch.Tensor, valid: torch.Tensor | None,
              chosen: torch.Tensor, weights: torch.Tensor, sizes: _Sizes):
        """The (token, rank) pairs to send, rank-major and in token order within a rank: their
        tokens, their ranks, and their routing [pairs, 2k]: each slot's local expert there
        (`local`: not there) and its weight (0 not there)."""
        n_tokens, local = pair.shape[0], self.local
        wanted = pair.t().reshape(-1)
        row = torch.argsort((~wanted).to(torch.uint8), stable=True)[:sum(sizes.sent)]
        dest, token = torch.div(row, n_tokens, rounding_mode="floor"), row % n_tokens
        mine = rank_of.index_select(0, token) == dest.unsqueeze(1)
        if valid is not None:
            mine &= valid.index_select(0, token)
        ids = torch.where(mine, chosen.index_select(0, token) - dest.unsqueeze(1) * local, local)
        routing = torch.cat([ids.to(weights.dtype),
                             torch.where(mine, weights.index_select(0, token), 0)], 1)
        return token, dest, routing

    def _experts(self, x_in: torch.Tensor, routing: torch.Tensor, arriving: torch.Tensor,
                 sizes: _Sizes) -> torch.Tensor:
        """The arrived rows through the local experts: fanned out to their slots (expert-major;
        slots not here sort last and are cut), each slot's output times its weight, summed
        per arrived row (in the compute dtype: the row's slots on this rank, often one)."""
        k = self.moe.top_k
        places = torch.sort(routing[:, :k].detach().reshape(-1).long(), stable=True).indices
        places = places[:sum(sizes.expert_rows)]
        y = self.moe.experts(x_in.index_select(0, places // k), arriving[:, 1:].sum(0),
                             max(sizes.expert_rows, default=0),
                             scale=routing[:, k:].reshape(-1)[places])
        return y.new_zeros(x_in.shape[0], y.shape[-1]).index_add(0, places // k, y)

    def _count(self, sizes: _Sizes, row: int, routing: int, trained: bool) -> None:
        """Bytes to other ranks: the tokens and their routing out, the partial sums back. A
        training pass's backward sends as much again, counted with its first forward (an
        activation recompute's forward sends its own, once); a dry pass counts nothing."""
        if dry():
            return
        trips = 2 if torch.is_grad_enabled() and trained and counting() else 1
        me = self.me
        out, back = sum(sizes.sent) - sizes.sent[me], sum(sizes.got) - sizes.got[me]
        moved = trips * (out * (row + routing) + back * row)
        self.sent_bytes += moved
        self.moe.step_bytes += moved
        slots = (sum(sizes.slots_out) - sizes.slots_out[me] + sum(sizes.slots_in)
                 - sizes.slots_in[me])
        self.undeduplicated_bytes += trips * slots * row


def _sum_partials(back: torch.Tensor, where: torch.Tensor, n_tokens: int,
                  width: int) -> torch.Tensor:
    """Each token's `width` places (its partial sums, zero where it went to fewer ranks),
    summed with float32 accumulation in the rows' dtype."""
    buffer = back.new_zeros(n_tokens * width, back.shape[-1]).index_copy(0, where, back)
    return buffer.view(n_tokens, width, back.shape[-1]).sum(1)


def _local_experts(experts: nn.Module, x: torch.Tensor, counts: torch.Tensor,
                   rows_max: int | None = None, scale: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """This rank's experts (its shard of the stacked weights) on the tokens sent to them."""
    w1, w3, w2 = (_local(getattr(experts, n)) for n in ("w1", "w3", "w2"))
    return swiglu_experts(x, w1, w3, w2, counts, rows_max, scale, experts.matmul)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w
