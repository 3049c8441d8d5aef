"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from optimus.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm weights are vectors and stay undecayed).

    Parameters sharded on different meshes (under expert parallelism: experts over (edp, ep),
    the rest over dp) go in separate groups: a fused or foreach step works on one mesh at once.
    """
    groups: dict[tuple, list] = {}
    for param in model.parameters():
        if param.requires_grad:
            mesh = getattr(param, "device_mesh", None)
            key = (param.dim() >= 2, None if mesh is None else mesh.mesh_dim_names)
            groups.setdefault(key, []).append(param)
    groups = [{"params": params, "weight_decay": cfg.weight_decay if decay else 0.0}
              for (decay, _), params in groups.items()]
    fused = cfg.fused
    if fused is None:
        # The fused kernel exists for cpu, cuda and xpu in torch 2.13.
        fused = device.type in ("cpu", "cuda", "xpu")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused)


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Linear warmup to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `steps`.

    `step` counts optimizer steps from 1; the value is the rate used for that step.
    """
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
