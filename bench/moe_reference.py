"""The MoE layer's dispatch and combine as they were before they moved fewer bytes: the "before"
of bench/moe.py, measured in the same run as the layer of the working tree.

A copy of commit 35f7561's `MoE.router_logits`, `choose`, `slots`, `dispatch` and `combine`
(optimus/models/moe.py at that commit), around an MoE's own router and expert weights:

- every slot (token t's j-th expert) gathers its token's row, `tokens[kept // top_k]`: top_k
  copies of each token go to the experts;
- the experts run on those rows (`swiglu_experts(x, w1, w3, w2, counts)`, the working tree's);
- their outputs are cast to float32, multiplied by the routing weights
  (`y.float() * weights`), and summed into a float32 [tokens, dim] by `index_add`, then cast
  back to the experts' dtype.

The auxiliary losses (balance `aux_loss`, router z-loss) are left out: they did not change,
and bench/moe.py says so when the job has them. Shared experts likewise.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from optimus.models.moe import swiglu_experts


class ExpertsBefore(nn.Module):
    """An MoE's experts, called as before: (rows grouped by expert, counts) -> rows."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.inner = experts

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        e = self.inner
        return swiglu_experts(x, e.w1, e.w3, e.w2, counts)


class MoEBefore(nn.Module):
    """`moe`'s router and experts, routed, dispatched and combined the way they were before.
    `router` and `experts` are the attributes bench/moe.py times and counts."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.router = moe.router
        self.experts = ExpertsBefore(moe.experts)
        self.experts_n, self.top_k, self.score = moe.experts_n, moe.top_k, moe.score
        self.balance, self.capacity_factor = moe.balance, moe.capacity_factor
        self.register_buffer("expert_bias", moe.expert_bias.clone())
        self.register_buffer("load", torch.zeros_like(moe.load))
        self.register_buffer("dropped", torch.zeros((), device=moe.load.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        tokens = x.reshape(-1, dim)
        with torch.autocast(tokens.device.type, enabled=False):
            logits = self.router(tokens.float())
        chosen, weights = self.choose(logits)
        kept, counts = self.slots(chosen, tokens.shape[0])
        y = self.experts(tokens[kept // self.top_k], counts)
        return self.combine(tokens, kept, y, weights).view(b, s, dim)

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if self.balance == "bias" else scores
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.score == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)
        return chosen, weights

    def slots(self, chosen: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = chosen.reshape(-1)
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.experts_n)
        kept = order
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * n_tokens * self.top_k / self.experts_n)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(order.numel(), device=order.device) - torch.repeat_interleave(
                starts, counts)
            kept = order[rank < capacity]
            counts = counts.clamp(max=capacity)
        if torch.is_grad_enabled():
            with torch.no_grad():
                self.load += torch.bincount(slots, minlength=self.experts_n).float()
                self.dropped += slots.numel() - kept.numel()
        return kept, counts

    def combine(self, tokens: torch.Tensor, kept: torch.Tensor, y: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        y32 = y.float() * weights.reshape(-1)[kept].unsqueeze(-1).float()
        out = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        return out.index_add(0, kept // self.top_k, y32).to(y.dtype)
