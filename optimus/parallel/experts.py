"""The experts across ranks: the auxiliary loss's counts during a step, the load after it.

During the step, an MoE layer balancing by auxiliary loss sums its slot counts with the ranks
that hold other tokens of its scope (`share_balance_counts`): for the global batch, every data-,
expert- and tensor-parallel rank of its pipeline stage; for a sequence, its tensor-parallel
ranks (each holds a share of the sequence's positions). Only counts travel, never gradients:
each rank adds its own tokens' probabilities times the shared fractions.

After each step (`expert_step`), every MoE layer's counts of the step (slots routed to each of
its experts, slots dropped for capacity, its share of the auxiliary loss and of the router
z-loss, the bytes its expert-parallel all-to-alls sent to other ranks) are summed over every
rank, one all-reduce of a [n_layers, experts + 4] tensor indexed
by global layer per parallel axis: a pipeline stage fills its own rows, a data-parallel replica
or a tensor-parallel sequence shard adds its tokens. So every rank sees the whole model's load.
With `balance: bias` each layer then moves its expert bias by `bias_update_rate` towards the
mean load (up for an expert below it, down above it): the same update on every replica, since
every replica saw the same sums.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from optimus.models.counts import is_moe_layer
from optimus.models.moe import MoE
from optimus.runtime.mesh import LayoutMesh


def share_balance_counts(layers: list[MoE], cfg, mesh: LayoutMesh) -> None:
    """Have the MoE layers sum their auxiliary loss's counts over the ranks of their scope.

    Every rank calls it (it may create process groups), whether or not it holds MoE layers."""
    m = cfg.moe
    if not m.experts or m.balance != "aux_loss":
        return
    scope_global = m.aux_loss_scope == "global"
    group = mesh.own_group("stage" if scope_global else "sequence")
    if group is None:
        return
    summed = partial(_all_reduce, group=group)
    for layer in layers:
        if scope_global:
            layer.sum_over_batch = summed
        else:
            layer.sum_over_sequence = summed


def _all_reduce(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(counts, group=group)
    return counts


def expert_step(layers: list[MoE], cfg, mesh: LayoutMesh, device: torch.device,
                held: torch.Tensor | None = None) -> torch.Tensor | None:
    """Sum the step's load over the data-parallel replicas, pipeline stages and tensor-parallel
    sequence shards, update the biases (unless `held`, 1.0 on the device where the step's update
    was held back: such a step leaves them too), reset the counters. Returns the summed
    [n_layers, experts + 4] figures on the device (None without MoE), read by the host only
    when the step is logged (`expert_figures`): nothing here waits on the device."""
    m = cfg.moe
    if not m.experts:
        return None
    stats = torch.zeros(cfg.n_layers, m.experts + 4, device=device)
    for layer in layers:
        stats[layer.layer, :m.experts] = layer.load
        stats[layer.layer, m.experts] = layer.dropped
        if layer.aux_total is not None:  # this rank's share: its own tokens
            stats[layer.layer, m.experts + 1] = layer.aux_total
        if layer.z_total is not None:
            stats[layer.layer, m.experts + 2] = layer.z_total
        stats[layer.layer, m.experts + 3] = float(layer.step_bytes)  # a host number: no wait
    mesh.all_reduce("world", stats)  # tp ranks route their own shares of the sequence
    keep = None if held is None or m.balance != "bias" else 1 - held
    for layer in layers:
        load = stats[layer.layer, :m.experts]
        if m.balance == "bias":
            move = m.bias_update_rate * torch.sign(load.mean() - load)
            layer.expert_bias += move if keep is None else move * keep
        layer.reset_counters()
    return stats


def expert_figures(values: list[float], cfg) -> dict:
    """A logged step's figures of the experts from `expert_step`'s tensor, read on the host (flat,
    row by row): {"load": per MoE layer, "dropped": slots, "aux_loss": the step's,
    token-weighted, mean over layers; "alltoall_bytes": what the experts' all-to-alls sent
    between ranks in the step, every layer and rank, forward and backward (0 without expert
    parallelism); with a router z-loss, "router_z_loss": the mean over tokens of
    logsumexp(router logits)^2, unscaled, mean over layers}."""
    m = cfg.moe
    width = m.experts + 4
    rows = [values[i * width:(i + 1) * width]
            for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]
    out = {"load": [[int(v) for v in row[:m.experts]] for row in rows],
           "dropped": int(sum(row[m.experts] for row in rows)),
           "aux_loss": sum(row[m.experts + 1] for row in rows) / len(rows),
           "alltoall_bytes": int(sum(row[m.experts + 3] for row in rows))}
    if m.router_z_loss:
        out["router_z_loss"] = sum(row[m.experts + 2] for row in rows) / len(rows)
    return out
