"""Gradient clipping on each rank's local shards, with one reduction for the global norm.

Every rank squares its own gradient values (the local tensor of each DTensor: a shard, a
replica or a pending sum) with foreach ops, weighs each parameter's share so that the sum over
every rank counts each value once, and one all-reduce over the world adds the shares up: the
stages of a pipeline, the dp and tp shards and the experts' (edp, ep) mesh alike. No DTensor
op is dispatched and nothing is read on the host, so a step's clip waits for nothing.

Why a weight, not a reduction per mesh: a value held on r ranks (a replica over tp, a router's
weight on every tp rank of an FSDP unit over dp) is counted 1/r times on each, and a shard once
on its only holder; with the weights known on the host (from the placements), one collective
over all ranks replaces the two or three that DTensor issues per mesh (a dp x tp norm gathers
in two steps) and the pipeline's own. Gradients that are pending sums (Partial: those of the
sequence-parallel norms under tp without FSDP) must be summed before they are squared: all of
a mesh's in one buffer, one all-reduce over its tp group before the world's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# FSDP2 shards a tensor-parallel shard over dp with it. A subclass of Shard in some releases,
# not on torch 2.13 (its is_shard() is False); either way each rank holds disjoint values.
from torch.distributed.tensor.placement_types import _StridedShard


class GradNorm(NamedTuple):
    """What `clip_grads_` measured, before it clipped.

    `total`: the global L2 norm of every gradient of the model (all stages, all shards), the
    same on every rank: a 0-dim fp32 tensor on the gradients' device.
    `local_squared`: the sum of squares of this rank's own gradient values (its shards, its
    replicas, its pending sums, none weighted), before any communication. It is NaN/Inf
    exactly when a value this rank computed is (or one so large, |g| > ~1.8e19, that its
    square overflows fp32): whether this rank's gradients were the bad ones, without another
    pass over them (`local_grads_finite` is that pass).
    """

    total: torch.Tensor
    local_squared: torch.Tensor

    def found_inf(self) -> torch.Tensor:
        """1.0 when the global norm is NaN/Inf, else 0.0, on the device: the optimizer's
        flag to skip its update (`LocalAdamW.step(found_inf=...)`)."""
        return torch.isfinite(self.total).logical_not().float()


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, stages: int = 1, *,
                    leave_nonfinite: bool = False) -> torch.Tensor:
    """`clip_grads_`, returning the global norm alone (as torch's clip_grad_norm_ does)."""
    return clip_grads_(params, max_norm, stages, leave_nonfinite=leave_nonfinite).total


@torch.no_grad()
def clip_grads_(params: Iterable[torch.nn.Parameter], max_norm: float, stages: int = 1, *,
                leave_nonfinite: bool = False) -> GradNorm:
    """Clip to `max_norm` (0: measure only); return the global L2 norm before clipping, and
    this rank's own squared share of it (`GradNorm`).

    A collective over the default group when the world has more than one rank: every rank
    calls it (a rank without gradients returns at once, as it always did). `stages`: the ranks
    of one pipeline (`LayoutMesh.size("pipeline")`), 1 without a pipeline. Every rank ends
    with the same norm and applies the same scale, torch's coefficient
    min(1, max_norm / (norm + 1e-6)). With
    `leave_nonfinite`, a NaN/Inf norm leaves the gradients as they are (the coefficient is
    chosen on the device); without it they are scaled as torch's clip scales them (by NaN, or
    by 0 for an infinite norm), which is no matter when the update is skipped.

    Plain tensors are taken to be whole and the same on every rank of their stage (what a
    layout leaves undistributed: everything at one rank, MoE layers under tp alone).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return GradNorm(torch.zeros(()), torch.zeros(()))
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world % stages:
        raise ValueError(f"a pipeline of {stages} stages does not divide a world of {world}")
    total, own = _squares(grads, world // stages)
    if world > 1:
        total = total.clone() if total is own else total  # `own` stays this rank's
        dist.all_reduce(total)  # every stage's, every shard's share: one collective
    norm = total.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's coefficient
        if leave_nonfinite:
            coef = torch.where(torch.isfinite(norm), coef, 1.0)
        _scale(grads, coef)
    return GradNorm(norm, own)


def _squares(grads: list[torch.Tensor], holders: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's weighted share of the global sum of squares (to be summed over the world),
    and its own unweighted sum of squares. `holders`: the ranks of one stage, each holding
    all of that stage's parameters or a shard of them."""
    runs: dict[tuple, dict[float, list[torch.Tensor]]] = {}  # (device, dtype) -> weight -> locals
    pending: dict[tuple, list[torch.Tensor]] = {}  # Partial(sum): (mesh, dims, ...) -> locals
    whole: list[DTensor] = []  # placements of any other kind: DTensor gathers them
    kinds: dict[tuple, tuple | None] = {}  # (mesh, placements): a few, however many grads
    for grad in grads:
        if not isinstance(grad, DTensor):
            runs.setdefault((grad.device, grad.dtype), {}).setdefault(
                1.0 / holders, []).append(grad)
            continue
        # The local tensor itself: what to_local() returns under no_grad, without its call.
        local, mesh = grad._local_tensor, grad.device_mesh
        key = (id(mesh), grad.placements)
        if key not in kinds:
            kinds[key] = _kind(mesh, grad.placements)
        if kinds[key] is None:
            whole.append(grad)
            continue
        shards, summed = kinds[key]
        if summed:
            pending.setdefault((mesh, summed, shards, local.device, local.dtype), []).append(
                local)
        else:
            runs.setdefault((local.device, local.dtype), {}).setdefault(
                shards / holders, []).append(local)

    totals, owns = [], []
    for by_weight in runs.values():
        # One foreach norm per device and dtype; each weight's gradients are a slice of it.
        tensors = [t for group in by_weight.values() for t in group]
        squares = torch.stack(torch._foreach_norm(tensors, 2.0)).float().square()
        owns.append(squares.sum())
        if len(by_weight) == 1:  # one weight (a one-process model, FSDP alone): no slices
            (weight,) = by_weight
            totals.append(owns[-1] if weight == 1.0 else owns[-1] * weight)
            continue
        start = 0
        for weight, group in by_weight.items():
            totals.append(squares[start:start + len(group)].sum() * weight)
            start += len(group)
    for (mesh, dims, shards, _, _), locals_ in pending.items():
        # A pending sum's square is not the sum of the ranks' squares: sum the values first,
        # a mesh's all in one buffer (a copy: the gradients stay pending sums).
        flat = torch.cat([t.reshape(-1) for t in locals_]).float()
        owns.append(flat.square().sum())
        for dim in dims:
            dist.all_reduce(flat, group=mesh.get_group(dim))
        totals.append(flat.square().sum() * (shards / holders))
    for grad in whole:
        owns.append(grad._local_tensor.float().square().sum())
        totals.append(grad.full_tensor().float().square().sum() / holders)
    return _add_up(totals), _add_up(owns)


def _kind(mesh, placements) -> tuple[int, tuple[int, ...]] | None:
    """How many disjoint shards a gradient of these placements is split into, and the mesh
    dims over which its values are pending sums; None for a placement of another kind."""
    shards, summed = 1, []
    for dim, placement in enumerate(placements):
        if placement.is_shard() or isinstance(placement, _StridedShard):
            shards *= mesh.size(dim)
        elif placement.is_partial() and getattr(placement, "reduce_op", None) == "sum":
            summed.append(dim)
        elif not placement.is_replicate():
            return None
    return shards, tuple(summed)


def _add_up(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of 0-dim tensors, on the first one's device."""
    if len(parts) == 1:
        return parts[0]
    device = parts[0].device
    return torch.stack([p.to(device) for p in parts]).sum()


def _scale(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every gradient by `coef`, each rank its own part: a DTensor's local tensor
    whatever its placement (a shard, a replica, or a pending sum: the scale is linear). Not
    torch's clip_grads_with_norm_ on the DTensors themselves: on torch 2.11 its multiply left
    the sequence-parallel norm weights' gradients unscaled (the norm matched, the update did
    not: tests/test_tensor_parallel.py, run on 2.11)."""
    by_device: dict = {}
    for grad in grads:
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        by_device.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), tensors in by_device.items():
        torch._foreach_mul_(tensors, coef.to(device))


def local_grads_finite(params: Iterable[torch.nn.Parameter]) -> bool:
    """Whether this rank's own gradient shards hold no NaN/Inf (no communication; a host read
    per gradient: the failure path's, after `GradNorm.local_squared` said which rank)."""
    local = [g.to_local() if isinstance(g, DTensor) else g
             for p in params if (g := p.grad) is not None]
    return all(bool(torch.isfinite(g).all()) for g in local)

