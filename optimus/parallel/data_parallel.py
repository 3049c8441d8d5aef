"""Sharded data parallel over the `dp` mesh axis with FSDP2 (`fully_shard`); experts over `edp`.

Parameters, gradients and optimizer state are sharded across dp (ZeRO-3). Gradients are
*summed* across ranks, not averaged: the trainer already divides the loss by the global token
count, so a mean here would divide twice.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from optimus.models.moe import moe_layers


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh,
                        edp_mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard each transformer block as its own unit, the rest (embedding, head) at the root.

    Under expert parallelism (`edp_mesh`), each MoE layer's experts, already sharded by expert
    over `ep`, are their own unit sharded over the expert-data-parallel `edp`: the replicas of
    the same experts. Everything else shards over the whole `dp`.
    """
    if edp_mesh is not None:
        for moe in moe_layers(model):
            fully_shard(moe.experts, mesh=edp_mesh)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: a divide factor otherwise becomes PREMUL_SUM, which gloo lacks.
            module.set_force_sum_reduction_for_comms(True)
    return model


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduce-scatter on all but the last microbatch of a step."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
