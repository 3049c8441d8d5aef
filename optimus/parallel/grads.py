"""Gradient clipping that works on plain and sharded (DTensor) gradients alike."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` (0: measure only) and return the total L2 norm before clipping.

    With sharded gradients the per-shard norms are combined across ranks, so every rank
    gets the same norm and applies the same scale.
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm
