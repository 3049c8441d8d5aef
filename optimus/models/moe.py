"""A mixture-of-experts feed-forward in plain PyTorch: router, experts, shared experts.

Each token is scored by a linear router (softmax, or sigmoid with the top k renormalised), sent
to its top k experts and brought back as the score-weighted sum of their outputs, plus the
shared experts' output when there are any. Dropless by default: every token reaches exactly k
experts. With a capacity factor, an expert takes at most ceil(factor x tokens x k / experts)
tokens (the first ones in token order) and the rest of its slots are dropped, and counted.

Load balancing is an auxiliary loss (the fraction of slots each expert got times its mean router
probability, summed and scaled by the number of experts) whose gradient joins the backward pass
wherever the layer runs, or loss-free: a per-expert bias, added to the scores only to choose the
experts, which the trainer moves after each step towards the mean load (`expert_bias`, a
buffer, saved with the model).

Expert weights are stacked, [experts, in, out], and computed by grouped GEMM:
`torch._grouped_mm` where the device has it (CUDA, bf16, compute capability 9+), a padded
batched matmul elsewhere (on CPU `_grouped_mm` has no backward in torch 2.13).

No parallel code here: dispatch and combine are local. Expert parallelism replaces
`MoE.dispatch` from outside, tensor parallelism `MoE.sum_over_token_shards`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def is_moe_layer(cfg, layer: int) -> bool:
    """Whether layer `layer` of a model config has a mixture of experts as its feed-forward."""
    moe = getattr(cfg, "moe", None)
    return bool(moe is not None and moe.experts) and layer >= moe.dense_layers


class GroupedExperts(nn.Module):
    """`experts` SwiGLU feed-forwards with stacked weights: w2(silu(w1 x) * w3 x) each."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [tokens, dim], sorted by expert, `counts[e]` rows for expert e."""
        return swiglu_experts(x, self.w1, self.w3, self.w2, counts)


def swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    """Each group of rows of `x` through its expert's SwiGLU (weights stacked by expert)."""
    h = F.silu(grouped_mm(x, w1, counts)) * grouped_mm(x, w3, counts)
    return grouped_mm(h, w2, counts)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` (grouped by expert, `counts[e]` for expert e) times their expert's `w[e]`."""
    if _native_grouped_mm(x, w):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offsets)
    return padded_grouped_mm(x, w, counts)


def padded_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same as one batched matmul over experts padded to the largest group.

    No shortcut for zero rows: the result must stay in the autograd graph even then. Under
    expert parallelism a rank that receives no tokens still takes part in the backward
    all-to-all, which only runs if the experts' output requires grad (a rank that skips it
    deadlocks the others)."""
    experts = w.shape[0]
    expert = torch.repeat_interleave(torch.arange(experts, device=x.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(experts, int(counts.max()), x.shape[-1])
    padded = padded.index_put((expert, position), x)
    return torch.bmm(padded, w)[expert, position]


def _native_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
            and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


class _AddAuxLoss(torch.autograd.Function):
    """Identity on the activations; in backward, the auxiliary loss's gradient joins in. So the
    loss needs no path to the model's output: it works in every pipeline stage."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class MoE(nn.Module):
    """Router + grouped experts (+ shared experts), in place of a block's feed-forward."""

    def __init__(self, cfg, layer: int, shared: nn.Module | None = None):
        super().__init__()
        m = cfg.moe
        self.layer, self.experts_n, self.top_k = layer, m.experts, m.top_k
        self.score, self.balance = m.score, m.balance
        self.capacity_factor, self.aux_loss_coeff = m.capacity_factor, m.aux_loss_coeff
        self.router = nn.Linear(cfg.dim, m.experts, bias=False)
        self.experts = GroupedExperts(m.experts, cfg.dim, m.expert_ffn_dim)
        self.shared = shared  # the shared experts: one SwiGLU, as wide as all of them
        self.register_buffer("expert_bias", torch.zeros(m.experts))  # saved: it is state
        # Since the trainer last read them: slots routed to each expert, slots dropped.
        self.register_buffer("load", torch.zeros(m.experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.step_tokens = 1  # the step's global token count (the trainer sets it)
        self.aux_total: torch.Tensor | None = None  # this step's, token-weighted, this rank
        # Under tensor parallelism each rank routes its own share of the sequence: the
        # auxiliary loss, not a sum over tokens, needs the totals of all shares (a
        # differentiable sum, which the parallel plan sets).
        self.token_shards = 1
        self.sum_over_token_shards: Callable[[torch.Tensor], torch.Tensor] = _alone

    def reset_buffers(self) -> None:
        self.expert_bias.zero_()
        self.load.zero_()
        self.dropped.zero_()
        self.aux_total = None

    def counters(self) -> tuple:
        """What the layer has counted since the trainer last read it."""
        return self.load.clone(), self.dropped.clone(), self.aux_total

    def restore_counters(self, counters: tuple) -> None:
        load, dropped, self.aux_total = counters
        self.load.copy_(load)
        self.dropped.copy_(dropped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores, chosen, weights = self.route(tokens)
        out = self.dispatch(tokens, chosen, weights)
        if self.shared is not None:
            out = out + self.shared(tokens)
        if self.balance == "aux_loss" and self.training and torch.is_grad_enabled():
            # Token-weighted over the step's microbatches and ranks, as the main loss is.
            aux, n_tokens = self.aux_loss(scores, chosen)
            aux = aux * (n_tokens / self.step_tokens)
            self.aux_total = aux.detach() + (0 if self.aux_total is None else self.aux_total)
            # Every shard holds the same loss, and backward through the sum over shards adds
            # up their gradients: each adds 1 / shards of it.
            out = _AddAuxLoss.apply(out, aux * (self.aux_loss_coeff / self.token_shards))
        return out.view(b, s, dim)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scores [T, E] (float32), the chosen experts [T, k] and their weights [T, k]."""
        logits = self.router(tokens).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if self.balance == "bias" else scores
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.score == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, chosen, weights

    def dispatch(self, tokens: torch.Tensor, chosen: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """Send each token to its experts, run them, and bring the weighted outputs back."""
        kept, counts = self.slots(chosen, tokens.shape[0])
        y = self.experts(tokens[kept // self.top_k], counts)
        return self.combine(tokens, kept, y, weights)

    def slots(self, chosen: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots that go to an expert, grouped by expert in token order (slot t * k + j is
        token t's j-th expert), and how many each expert takes; counts the load and drops."""
        slots = chosen.reshape(-1)
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.experts_n)
        kept = order
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * n_tokens * self.top_k / self.experts_n)
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(order.numel(), device=order.device) - torch.repeat_interleave(
                starts, counts)  # each slot's place in its expert's queue
            kept = order[rank < capacity]
            counts = counts.clamp(max=capacity)
        if torch.is_grad_enabled():  # a training pass, not an evaluation
            with torch.no_grad():
                self.load += torch.bincount(slots, minlength=self.experts_n).float()
                self.dropped += slots.numel() - kept.numel()
        return kept, counts

    def combine(self, tokens: torch.Tensor, kept: torch.Tensor, y: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """Each token's experts' outputs `y` (in `kept` order), weighted and summed."""
        y = y * weights.reshape(-1)[kept].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(tokens).index_add(0, kept // self.top_k, y)

    def aux_loss(self, scores: torch.Tensor,
                 chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """experts x sum over experts of (fraction of slots routed to it) x (its mean
        probability): 1 when balanced, up to `experts` when one expert takes everything. Over
        the tokens of every shard; and how many tokens those are."""
        e = self.experts_n
        probs = scores / scores.sum(-1, keepdim=True)  # softmax already sums to 1
        slots = torch.bincount(chosen.reshape(-1), minlength=e).float()
        totals = self.sum_over_token_shards(
            torch.cat([slots, probs.sum(0), probs.new_full((1,), scores.shape[0])]))
        slots, prob_sums, n_tokens = totals.split([e, e, 1])
        fraction = slots / (n_tokens * self.top_k)
        return e * (fraction * prob_sums / n_tokens).sum(), n_tokens.squeeze().detach()


def _alone(totals: torch.Tensor) -> torch.Tensor:
    return totals


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
