"""Sharded data parallel over the `dp` mesh axis with FSDP2 (`fully_shard`); experts over `edp`.

Parameters, gradients and optimizer state are sharded across dp (ZeRO-3). Gradients are
*summed* across ranks, not averaged: the trainer already divides the loss by the global token
count, so a mean here would divide twice.

Mixed precision lives here too, where the parameters do: with a bf16 policy each unit's
parameters are cast to bf16 as they are all-gathered (half the bytes on the wire), forward and
backward compute in bf16, and the gradients are cast to fp32 before the reduce-scatter, so the
sum over ranks and the sharded gradients, master weights and optimizer state are all fp32. At
dp 1 the same policy runs on a one-rank mesh: the all-gather is then only the cast and the
reduce-scatter only the cast back, and nothing is sharded (`apply_data_parallel` with
`reshard=False`): the whole model is then one unit, cast in one copy per step and kept in bf16
from forward to backward (there is no memory to win by dropping it, and a unit per block
would cost a copy and two hooks per block: 2% of a small model's step on CPU).

How often parameters are gathered (`parallel.param_gather`) trades memory for communication.
`microbatch` is FSDP2's default: a block is all-gathered for each microbatch's forward,
resharded after it, and all-gathered again for its backward, 2 x microbatches all-gathers of
the model a step. `step` keeps the parameters gathered through the step's microbatches:
`reshard_after_forward=False` on every unit, and, between microbatches,
`set_reshard_after_backward(False)` (FSDP2's own knob for gradient accumulation), so the model
is gathered once a step and resharded after the last backward, before the optimizer. The
gathered copy in the compute dtype then stays on every rank for the whole step (ZeRO-2-like
memory: parameters whole, optimizer state and reduced gradients sharded). Under a pipeline
torch's stages already hold the resharding after backward until the step's last one
(`PipelineStage.backward_maybe_with_nosync`), so `reshard_after_forward=False` suffices there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from optimus.models.moe import moe_layers


def precision_policy(dtype: torch.dtype) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for compute in `dtype`: None (plain fp32), or bf16 parameters in compute
    and all-gather with fp32 gradient reduction."""
    if dtype == torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh,
                        edp_mesh: DeviceMesh | None = None,
                        policy: MixedPrecisionPolicy | None = None,
                        reshard: bool = True, keep_gathered: bool = False) -> nn.Module:
    """Shard each transformer block as its own unit, the rest (embedding, head) at the root.

    Under expert parallelism (`edp_mesh`), each MoE layer's experts, already sharded by expert
    over `ep`, are their own unit sharded over the expert-data-parallel `edp`: the replicas of
    the same experts. Everything else shards over the whole `dp`. Every unit takes `policy`,
    but MoE routers, their own units, score in fp32 (their inputs are cast up as they enter).
    `reshard` False (dp 1) makes the model one unit, kept gathered from forward to backward.
    `keep_gathered` (param_gather: step) keeps a unit per block but never reshards one after
    its forward; `set_gradient_sync` then holds them gathered between microbatches.
    """
    options = {"mp_policy": policy or MixedPrecisionPolicy()}
    after_forward = reshard and not keep_gathered
    for moe in moe_layers(model):
        if edp_mesh is not None:
            fully_shard(moe.experts, mesh=edp_mesh, reshard_after_forward=after_forward,
                        **options)
        if policy is not None:  # routing decisions from bf16 scores flip on rounding: fp32
            fully_shard(moe.router, mesh=dp_mesh, reshard_after_forward=after_forward,
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    if reshard:
        for block in model.layers.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=after_forward, **options)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=after_forward, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: a divide factor otherwise becomes PREMUL_SUM, which gloo lacks.
            module.set_force_sum_reduction_for_comms(True)
    return model


def set_gradient_sync(model: nn.Module, enabled: bool, keep_gathered: bool = False) -> None:
    """Skip the gradient reduce-scatter on all but the last microbatch of a step; with
    `keep_gathered`, skip resharding the parameters after those backwards too."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        if keep_gathered:
            model.set_reshard_after_backward(enabled)
