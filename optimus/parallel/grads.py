"""Gradient clipping that works on plain and sharded (DTensor) gradients, across stages."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None, *,
                    leave_nonfinite: bool = False) -> torch.Tensor:
    """Clip to `max_norm` (0: measure only) and return the global L2 norm before clipping.

    Sharded gradients (tp, dp) are combined by DTensor; the stages of a pipeline hold
    different parameters, so their squared norms are summed over `pp_group`. Every rank ends
    with the same norm and applies the same scale. With `leave_nonfinite`, a NaN/Inf norm
    leaves the gradients as they are (one host sync), so a rank can still tell whether its own
    were the bad ones (`local_grads_finite`).
    """
    params = [p for p in params if p.grad is not None]
    by_mesh: dict = {}  # gradients on different meshes (experts under EP) are normed apart
    for p in params:
        mesh = getattr(p.grad, "device_mesh", None)
        by_mesh.setdefault(None if mesh is None else mesh.mesh_dim_names, []).append(p)
    squared = None
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0,
                                             foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = norm.pow(2) if squared is None else squared + norm.pow(2)
    if squared is None:
        return torch.zeros(())
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squared, group=pp_group)
    norm = squared.sqrt()
    if max_norm > 0 and not (leave_nonfinite and not bool(torch.isfinite(norm))):
        _scale(params, torch.clamp(max_norm / (norm + 1e-6), max=1.0))  # torch's coefficient
    return norm


def _scale(params: list[torch.nn.Parameter], coef: torch.Tensor) -> None:
    """Multiply every gradient by `coef`, each rank its own part: a DTensor's local tensor
    whatever its placement (a shard, a replica, or a pending sum: the scale is linear). Not
    torch's clip_grads_with_norm_ on the DTensors themselves: on torch 2.11 its multiply left
    the sequence-parallel norm weights' gradients unscaled (the norm matched, the update did
    not: tests/test_tensor_parallel.py, run on 2.11)."""
    by_device: dict = {}
    for p in params:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        by_device.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(device))


def local_grads_finite(params: Iterable[torch.nn.Parameter]) -> bool:
    """Whether this rank's own gradient shards hold no NaN/Inf (no communication)."""
    local = [g.to_local() if isinstance(g, DTensor) else g
             for p in params if (g := p.grad) is not None]
    return all(bool(torch.isfinite(g).all()) for g in local)
