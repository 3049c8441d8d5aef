"""Sharded data parallel over the `dp` mesh axis with FSDP2 (`fully_shard`); experts over `edp`.

Parameters, gradients and optimizer state are sharded across dp (ZeRO-3). Gradients are
*summed* across ranks, not averaged: the trainer already divides the loss by the global token
count, so a mean here would divide twice.

Mixed precision lives here too, where the parameters do. Under FSDP2 (dp > 1) a bf16 policy
casts each unit's parameters to bf16 as they are all-gathered (half the bytes on the wire),
forward and backward compute in bf16, and the gradients are cast to fp32 before the
reduce-scatter, so the sum over ranks and the sharded gradients, master weights and optimizer
state are all fp32. At dp 1 there is nothing to shard and nothing to reduce, and FSDP2 on a
one-rank mesh would cost a copy of every parameter into its bf16 buffer and a copy of every
gradient out of it each step: the model is not wrapped, and bf16 is `torch.autocast` around
each forward instead (`compute`, as torchtitan computes on one device). Parameters and
gradients are then plain fp32 tensors (or tp's DTensors), each matmul casts its operands to
bf16 as it runs (eagerly, a parameter's cast is cached for the rest of the forward), and what
autocast leaves alone (norms, softmax, the residual stream's sums) stays fp32.

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

import contextlib

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


def autocast_dtype(dtype: torch.dtype, dp: int) -> torch.dtype | None:
    """The dtype `compute` autocasts to: `dtype` at dp 1 when it is not float32, else None
    (fp32 needs nothing; under FSDP2, dp > 1, its policy casts)."""
    return dtype if dp == 1 and dtype != torch.float32 else None


def compute(device: torch.device | str, dtype: torch.dtype | None):
    """The context a forward runs in: autocast to `dtype` on `device`'s type, or nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh,
                        edp_mesh: DeviceMesh | None = None,
                        policy: MixedPrecisionPolicy | None = None,
                        keep_gathered: bool = False) -> nn.Module:
    """Shard each transformer block as its own unit, the rest (embedding, head) at the root.

    Under expert parallelism (`edp_mesh`), each MoE layer's experts, already sharded by expert
    over `ep`, are their own unit sharded over the expert-data-parallel `edp`: the replicas of
    the same experts. Everything else shards over the whole `dp`. Every unit takes `policy`,
    but MoE routers, their own units, score in fp32 (their inputs are cast up as they enter).
    `keep_gathered` (param_gather: step) keeps a unit per block but never reshards one after
    its forward; `set_gradient_sync` then holds them gathered between microbatches.
    """
    options = {"mp_policy": policy or MixedPrecisionPolicy()}
    after_forward = not keep_gathered
    for moe in moe_layers(model):
        if edp_mesh is not None:
            fully_shard(moe.experts, mesh=edp_mesh, reshard_after_forward=after_forward,
                        **options)
        if policy is not None:  # routing decisions from bf16 scores flip on rounding: fp32
            fully_shard(moe.router, mesh=dp_mesh, reshard_after_forward=after_forward,
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
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
    `keep_gathered`, skip resharding the parameters after those backwards too. A model FSDP2
    does not wrap (dp 1) has nothing to skip."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        if keep_gathered:
            model.set_reshard_after_backward(enabled)
