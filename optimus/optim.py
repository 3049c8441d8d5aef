"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from optimus.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm weights are vectors and stay undecayed).

    Parameters sharded on different meshes (under expert parallelism: experts over (edp, ep),
    the rest over dp) go in separate groups: a fused or foreach step works on one mesh at once.
    The optimizer steps on each rank's local shards (`LocalAdamW`).
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
    return LocalAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                      fused=fused)


class LocalAdamW(torch.optim.AdamW):
    """torch's AdamW, stepping on each rank's local tensors; its state is torch's own.

    A parameter whose gradient and moments share its placements (FSDP2's shards, tensor
    parallel's, plain tensors) is updated by the fused kernel on the local tensors directly:
    the same arithmetic as DTensor's dispatch of that kernel, without the dispatch (a sharding
    decision per op, per step). The rest (a sequence-parallel norm's gradient is a pending sum
    over tp while its weight is replicated; a non-fused group) steps as torch's AdamW does, on
    the DTensors. The state stays DTensors made by torch's rules, so state_dict, DCP's
    get/set_optimizer_state_dict and checkpoints are those of torch.optim.AdamW.

    `step(found_inf=flag)`: a 0-dim float32 tensor on the parameters' device, 1.0 to skip
    this update. The fused kernel skips it on the device and torch's functional adamw takes
    the step counts back, so a skipped step changes nothing and nothing waits for the flag.
    A group that is not fused (optim.fused false, a device without the kernel) cannot take
    the flag: the step then reads it on the host, once.
    """

    @torch.no_grad()
    def step(self, closure=None, *, found_inf: torch.Tensor | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # GradScaler hands its flag over as attributes (fused AdamW supports it).
        grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and not all(g["fused"] for g in self.param_groups):
            if bool(found_inf):  # the one host read: only the fused kernel takes a flag
                return loss
            found_inf = None
        for group in self.param_groups:
            local, stock = _Tensors(), _Tensors()
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    _init_state(state, param, group)
                tensors = [param, param.grad, state["exp_avg"], state["exp_avg_sq"]]
                if group["amsgrad"]:
                    tensors.append(state["max_exp_avg_sq"])
                views = _local_tensors(tensors) if group["fused"] else None
                (local if views else stock).add(views or tensors, state["step"])
            for tensors in (local, stock):
                if tensors.params:
                    _adamw(tensors, group, grad_scale, found_inf)
        return loss


class _Tensors:
    """The lists torch's functional adamw takes, for one group's parameters."""

    def __init__(self) -> None:
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs = [], [], [], []
        self.max_exp_avg_sqs, self.steps = [], []

    def add(self, tensors: list[torch.Tensor], step: torch.Tensor) -> None:
        self.params.append(tensors[0])
        self.grads.append(tensors[1])
        self.exp_avgs.append(tensors[2])
        self.exp_avg_sqs.append(tensors[3])
        self.max_exp_avg_sqs.extend(tensors[4:])
        self.steps.append(step)


def _adamw(t: _Tensors, group: dict, grad_scale, found_inf) -> None:
    """One group's update by torch's functional AdamW, with the group's own options: the public
    form of torch.optim.AdamW's step (these arguments since torch 2.2), which with fused=True
    increments the step counts, runs torch._fused_adamw_ and, given found_inf, takes the
    counts back by the flag."""
    beta1, beta2 = group["betas"]
    adamw(t.params, t.grads, t.exp_avgs, t.exp_avg_sqs, t.max_exp_avg_sqs, t.steps,
          foreach=group["foreach"], capturable=group["capturable"],
          differentiable=group["differentiable"], fused=group["fused"],
          grad_scale=grad_scale, found_inf=found_inf,
          has_complex=any(torch.is_complex(p) for p in t.params),
          amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
          weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])


def _init_state(state: dict, param: torch.Tensor, group: dict) -> None:
    """A parameter's first state, as torch's Adam creates it: the step count a 0-dim fp32
    tensor on the parameter's device when fused (on the cpu otherwise), the moments zeros
    with the parameter's placements."""
    if group["fused"] or group["capturable"]:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
    else:
        state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _scalar_dtype() -> torch.dtype:
    """Of an unfused step count: float64 under a float64 default, as torch's Adam keeps it."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The local tensors of a parameter, its gradient and its moments when all share the
    parameter's placements on one mesh (each rank then updates exactly the values it holds);
    None when they do not. `_local_tensor`, not to_local(): on torch 2.13 a parameter's
    to_local() is a fresh view, an op per parameter per step."""
    first = tensors[0]
    if not isinstance(first, DTensor):
        return None if any(isinstance(t, DTensor) for t in tensors) else tensors
    mesh, placements = first.device_mesh, first.placements
    for t in tensors[1:]:
        if not (isinstance(t, DTensor) and t.placements == placements
                and (t.device_mesh is mesh or t.device_mesh == mesh)):
            return None
    return [t._local_tensor for t in tensors]


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
