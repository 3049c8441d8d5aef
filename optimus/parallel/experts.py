"""After each step: the experts' load across all ranks, the loss-free balancing bias, metrics.

Every MoE layer counts, during the step, the slots routed to each of its experts and the slots
dropped for capacity. Here they are summed over every rank, one all-reduce of a
[n_layers, experts + 2] tensor indexed by global layer per parallel axis: a pipeline stage
fills its own rows, a data-parallel replica or a tensor-parallel sequence shard adds its
tokens. So every rank sees the whole model's load. With `balance: bias` each layer then moves
its expert bias by `bias_update_rate` towards the mean load (up for an expert below it, down
above it): the same update on every replica, since every replica saw the same sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from optimus.models.moe import MoE, is_moe_layer


def expert_step(layers: list[MoE], cfg, mesh: DeviceMesh, device: torch.device) -> dict | None:
    """Sum the step's load over the data-parallel replicas, pipeline stages and tensor-parallel
    sequence shards, update the biases, reset the counters; the step's figures ({"load": per
    MoE layer, "dropped": slots, "aux_loss": the step's, token-weighted, mean over layers}),
    None without MoE."""
    m = cfg.moe
    if not m.experts:
        return None
    stats = torch.zeros(cfg.n_layers, m.experts + 2, device=device)
    for layer in layers:
        stats[layer.layer, :m.experts] = layer.load
        stats[layer.layer, m.experts] = layer.dropped
        if layer.aux_total is not None:
            stats[layer.layer, m.experts + 1] = layer.aux_total
    tp = mesh["tp"]
    if tp.get_local_rank() > 0:
        stats[:, m.experts + 1] = 0  # the auxiliary loss is already the same on every tp rank
    for axis in ("dp", "pp", "tp"):  # tp ranks route their own shares of the sequence
        if mesh[axis].size() > 1:
            dist.all_reduce(stats, group=mesh[axis].get_group())
    for layer in layers:
        load = stats[layer.layer, :m.experts]
        if m.balance == "bias":
            layer.expert_bias += m.bias_update_rate * torch.sign(load.mean() - load)
        layer.load.zero_()
        layer.dropped.zero_()
        layer.aux_total = None
    moe_rows = [i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]
    return {"load": [[int(v) for v in stats[i, :m.experts].tolist()] for i in moe_rows],
            "dropped": int(stats[moe_rows, m.experts].sum()),
            "aux_loss": float(stats[moe_rows, m.experts + 1].mean())}
