"""torchtitan 0.3.0's MoE layer with the configuration and weights of ours (bench/moe.py).

`torchtitan.models.common.moe.MoE`, from torchtitan's wheel (bench/gpu.sh installs it from
.whl; Optimus itself never imports it), configured as the job's layer: the same experts,
width and top k; its token-choice router with the same score function (sigmoid weights
renormalised over the top k: `route_norm`, as ours; softmax weights not), scale 1; the
loss-free balancing bias where the job balances by bias (zero, as ours starts); no shared
experts; its local token dispatcher (no expert parallelism). Imported as
bench/torchtitan_peer.py imports it (on torch < 2.12, with its stand-in for a name torchtitan
imports and uses only on meshes of several devices). Its experts always cast to bf16 and
run `torch._grouped_mm` (its router's gate runs under float32 autocast, which a CPU refuses:
there its layer takes float32 tokens only, `--dtype float32`).
Weights are ours, transposed to its [experts, out, in] layout, so both layers route alike and
their outputs agree to bf16 rounding: `agreement` says how closely.

Regions, for bench/moe_measure.py: its inner grouped experts (`routed_experts.inner_experts`)
and its router's gate (`router.gate`, the linear layer); the rest is its dispatch and combine
(scores, top k, the argsort, the gather, the float32 weighting, the scatter-add).
"""

from __future__ import annotations

import torch
from torch import nn

VERSION = "0.3.0"


def torchtitan_moe(moe: nn.Module, dtype: torch.dtype) -> tuple[nn.Module, dict] | str:
    """torchtitan's MoE as `moe` is configured, with its weights, and its regions; or why
    not (one line)."""
    try:
        from bench.torchtitan_peer import import_torchtitan

        import_torchtitan()  # with its stand-in for a name torch < 2.12 lacks, where needed
        import torchtitan.models.common.moe as tt
        from torchtitan.models.common.linear import Linear
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    except Exception as e:  # noqa: BLE001 (any failure to import: a missing dependency, a torch API)
        return f"torchtitan cannot be imported here: {type(e).__name__}: {e}"
    e, dim, hidden, k = moe.experts_n, moe.router.in_features, moe.experts.w1.shape[-1], moe.top_k
    config = tt.MoE.Config(
        num_experts=e,
        routed_experts=tt.RoutedExperts.Config(
            inner_experts=tt.GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=e),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=k)),
        router=tt.TokenChoiceTopKRouter.Config(
            num_experts=e, gate=Linear.Config(in_features=dim, out_features=e), top_k=k,
            score_func=moe.score, route_norm=moe.score == "sigmoid"),
        load_balance_coeff=1e-3 if moe.balance == "bias" else None, shared_experts=None)
    device = moe.experts.w1.device
    with torch.device(device):
        peer = config.build()
    inner = peer.routed_experts.inner_experts
    with torch.no_grad():
        peer.router.gate.weight.copy_(moe.router.weight)
        for ours, theirs in (("w1", "w1_EFD"), ("w3", "w3_EFD"), ("w2", "w2_EDF")):
            getattr(inner, theirs).copy_(getattr(moe.experts, ours).transpose(1, 2))
        if peer.expert_bias_E is not None:
            peer.expert_bias_E.copy_(moe.expert_bias)
        peer.tokens_per_expert_E.zero_()
    inner.to(dtype)
    return peer.train(), {"experts": inner, "router": peer.router.gate}


def agreement(ours: nn.Module, peer: nn.Module, x: torch.Tensor) -> float:
    """|ours(x) - peer(x)| / |ours(x)|, forward: the two layers compute the same function."""
    with torch.no_grad():
        a, b = ours(x).float(), peer(x).float()
    return float((a - b).norm() / a.norm())
