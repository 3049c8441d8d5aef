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

The auxiliary loss's statistics have a scope (`aux_loss_scope`), and no layout changes them:
- `global` (the default): the slot fractions are those of the step's global batch, counted
  over every rank that holds other tokens of it (data-, expert- and tensor-parallel ranks) and
  over the step's microbatches so far: microbatch j of a step uses the counts of its global
  microbatches 1..j, so the last one sees the whole batch. (The whole batch's counts cannot be
  known before the first backward under gradient accumulation; a running count is the usual
  answer.) Balancing over the global batch rather than per sequence lets experts specialise.
- `sequence`: every sequence is balanced on its own (its own fractions and mean probabilities),
  and the sequences' losses are averaged, token-weighted.
Either way a rank adds its own tokens' probabilities times the fractions; summed over ranks and
microbatches that is the loss, so only the counts (never a gradient) cross ranks, through
`sum_over_batch` and `sum_over_sequence`, which the parallel plans set.

The router z-loss (ST-MoE, `router_z_loss` > 0), whatever the balancing, is the mean over the
step's tokens of logsumexp(router logits)^2, times its coefficient: each rank adds its own
tokens' squares over the step's global token count, and its gradient joins the backward the
same way as the balance loss's. Nothing crosses ranks for it.

A forward counts the load, the dropped slots and the running totals once. Activation recompute
replays the first forward's balancing decisions and counts nothing (`recompute_contexts`), and a
pipeline's shape-inference pass on placeholder tensors counts nothing and talks to no other
rank (`moe_pass("dry")`).

Expert weights are stacked, [experts, in, out], and computed by grouped GEMM:
`torch._grouped_mm` where the device has it (CUDA, bf16, compute capability 9+), a padded
batched matmul elsewhere (on CPU `_grouped_mm` has no backward in torch 2.13), or a float8 one
(`training.float8_experts`). In bf16 mixed precision the slots move in bf16 and each token's
weighted outputs are summed with float32 accumulation (optimus/models/moe_routes.py: the
passes, and why none makes a float32 copy of the experts' rows). Nothing in the layer reads
the device from the host but the padded GEMM's largest group (one read a layer, dropless, off
the native kernel); under a capacity, none. The ops it dispatches do not grow with the number
of experts.

No parallel code here: dispatch and combine are local. Expert parallelism replaces
`MoE.dispatch` from outside; the parallel plans set `MoE.sum_over_batch` and
`MoE.sum_over_sequence` (optimus/parallel/experts.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from optimus.models.moe_routes import (
    Slots,
    capacity_of,
    fold,
    group_slots,
    in_compute_dtype,
    plan_capacity,
    spread,
    sum_slots,
)


class GroupedExperts(nn.Module):
    """`experts` SwiGLU feed-forwards with stacked weights: w2(silu(w1 x) * w3 x) each."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        # The grouped GEMM: `grouped_mm`, or a float8 one (optimus/parallel/float8_experts.py).
        self.matmul: GroupedMM = grouped_mm

    def forward(self, x: torch.Tensor, counts: torch.Tensor, rows_max: int | None = None,
                scale: torch.Tensor | None = None) -> torch.Tensor:
        """x: [tokens, dim], sorted by expert, `counts[e]` rows for expert e (at most
        `rows_max` where the caller knows it); `scale`: [tokens] weights of the outputs."""
        return swiglu_experts(x, self.w1, self.w3, self.w2, counts, rows_max, scale,
                              self.matmul)


# (x [rows, in] grouped by expert, w [experts, in, out], counts [experts], rows_max) -> [rows, out]
GroupedMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "int | None"], torch.Tensor]


def swiglu_experts(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   counts: torch.Tensor, rows_max: int | None = None,
                   scale: torch.Tensor | None = None, mm: GroupedMM | None = None
                   ) -> torch.Tensor:
    """Each group of rows of `x` through its expert's SwiGLU (weights stacked by expert),
    its output times `scale` (one weight a row) where given: the scale multiplies the hidden
    activations before the last GEMM (a linear map: the same product), where it is one more
    factor of the elementwise product a compiler fuses, not a pass over the output."""
    mm = mm or grouped_mm
    if rows_max is None and mm is grouped_mm and x.dim() == 2 and not _native_grouped_mm(x, w1):
        rows_max = int(counts.max()) if counts.numel() else 0  # one host read, not three
    h = F.silu(mm(x, w1, counts, rows_max)) * mm(x, w3, counts, rows_max)
    if scale is not None:
        h = h * scale.to(h.dtype).unsqueeze(-1)
    return mm(h, w2, counts, rows_max)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
               rows_max: int | None = None) -> torch.Tensor:
    """Rows of `x` (grouped by expert, `counts[e]` for expert e) times their expert's `w[e]`.
    Under autocast (one replica's bf16: no FSDP2 to cast the weights) both operands take the
    autocast dtype first, as a matmul under autocast would: the grouped kernel then applies.
    `rows_max`, the largest count where the caller knows it, spares the padded path its one
    host read."""
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    if x.dim() == 3:  # [experts, rows, in]: every expert takes as many rows (capacity)
        return torch.bmm(x, w)
    if _native_grouped_mm(x, w):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offsets)
    return padded_grouped_mm(x, w, counts, rows_max)


def padded_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                      rows_max: int | None = None) -> torch.Tensor:
    """The same as one batched matmul over experts padded to the largest group (`rows_max`;
    read from `counts` when not given: the one host read of this path). Each row's expert is
    a search in the groups' ends, not `repeat_interleave`, which reads its size on the host.

    No shortcut for zero rows: the result must stay in the autograd graph even then. Under
    expert parallelism a rank that receives no tokens still takes part in the backward
    all-to-all, which only runs if the experts' output requires grad (a rank that skips it
    deadlocks the others)."""
    experts = w.shape[0]
    if rows_max is None:
        rows_max = int(counts.max()) if counts.numel() else 0
    ends = torch.cumsum(counts, 0)
    row = torch.arange(x.shape[0], device=x.device, dtype=ends.dtype)
    expert = torch.searchsorted(ends, row, right=True)
    position = row - (ends - counts)[expert]
    padded = x.new_zeros(experts, rows_max, x.shape[-1]).index_put((expert, position), x)
    return torch.bmm(padded, w)[expert, position]


def _native_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` can take these operands: CUDA, sm90+, both in bf16.

    In bf16 mixed precision (FSDP2's policy, or autocast at dp 1) the experts' weights arrive
    here in bf16, so a Hopper GPU takes the native kernel; fp32 training takes the padded
    path. On XPU torch 2.13 has no `_grouped_mm`: always the padded path.
    """
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


def add_aux_loss(out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """`out`, unchanged, carrying `aux`'s gradient into backward. Always eager: traced into a
    compiled graph (torch 2.13), the function's backward lost the auxiliary loss's gradient
    (the output does not depend on `aux`, and the graph dropped the branch). The compile
    path marks it so (optimus/parallel/compile.py `keep_eager`), not a decorator here: the
    mark imports dynamo, ~0.6 s of CPU that every rank would pay at import, compiled or not."""
    return _AddAuxLoss.apply(out, aux)


EAGER_ONLY = ("add_aux_loss",)  # this module's functions torch.compile must not trace into


# How the current forward pass treats the layers' bookkeeping (counters, running totals, the
# collectives that sum counts): None for a plain training or evaluation pass, else
# (mode, record) with mode "record" (a first forward whose balancing decisions are kept in
# `record`, by layer), "replay" (activation recompute: reuse them, count nothing) or "dry"
# (placeholder inputs: count nothing, no collectives).
_PASS: ContextVar[tuple[str, dict] | None] = ContextVar("optimus_moe_pass", default=None)


@contextmanager
def moe_pass(mode: str, record: dict | None = None) -> Iterator[None]:
    """Run the forwards inside as `mode`: "record", "replay" or "dry" (see above)."""
    if mode not in ("record", "replay", "dry"):
        raise ValueError(f"unknown MoE pass {mode!r}")
    token = _PASS.set((mode, {} if record is None else record))
    try:
        yield
    finally:
        _PASS.reset(token)


def recompute_contexts():
    """`context_fn` for torch.utils.checkpoint (non-reentrant): the forward records each MoE
    layer's balancing decisions, the recompute in backward replays them, so a recomputed block
    counts nothing twice and computes the same auxiliary loss without asking other ranks. A
    forward inside a dry pass stays dry, and so does its recompute."""
    record: dict = {}
    return _first_forward(record), _recompute(record)


@contextmanager
def _first_forward(record: dict) -> Iterator[None]:
    current = _PASS.get()
    if current is not None and current[0] == "dry":
        record["dry"] = True
        yield
        return
    with moe_pass("record", record):
        yield


@contextmanager
def _recompute(record: dict) -> Iterator[None]:
    with moe_pass("dry" if record.get("dry") else "replay", record):
        yield


class MoE(nn.Module):
    """Router + grouped experts (+ shared experts), in place of a block's feed-forward."""

    def __init__(self, cfg, layer: int, shared: nn.Module | None = None):
        super().__init__()
        m = cfg.moe
        self.layer, self.experts_n, self.top_k = layer, m.experts, m.top_k
        self.score, self.balance = m.score, m.balance
        self.capacity_factor, self.aux_loss_coeff = m.capacity_factor, m.aux_loss_coeff
        self.aux_scope = m.aux_loss_scope
        self.router_z_coeff = m.router_z_loss
        self.router = nn.Linear(cfg.dim, m.experts, bias=False)
        self.experts = GroupedExperts(m.experts, cfg.dim, m.expert_ffn_dim)
        self.shared = shared  # the shared experts: one SwiGLU, as wide as all of them
        self.register_buffer("expert_bias", torch.zeros(m.experts))  # saved: it is state
        # Since the trainer last read them: slots routed to each expert, slots dropped.
        self.register_buffer("load", torch.zeros(m.experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        # The step's running totals for the global-batch auxiliary loss: slots per expert and
        # tokens, over every rank and the microbatches so far.
        self.register_buffer("batch_slots", torch.zeros(m.experts), persistent=False)
        self.register_buffer("batch_tokens", torch.zeros(()), persistent=False)
        self.step_tokens = 1  # the step's global token count (the trainer sets it)
        self.aux_total: torch.Tensor | None = None  # this rank's share of the step's aux loss
        self.z_total: torch.Tensor | None = None  # ... and of its router z-loss (unscaled)
        self.step_bytes = 0  # sent to other ranks by expert parallelism since the last step
        # Counts summed over the ranks holding other tokens of the same global microbatch
        # (global scope) or of the same sequences (sequence scope): set by the parallel plans.
        self.sum_over_batch: Callable[[torch.Tensor], torch.Tensor] = _alone
        self.sum_over_sequence: Callable[[torch.Tensor], torch.Tensor] = _alone

    def reset_buffers(self) -> None:
        self.expert_bias.zero_()
        self.reset_counters()

    def reset_counters(self) -> None:
        """Forget what was counted: after the trainer has read a step's figures."""
        self.load.zero_()
        self.dropped.zero_()
        self.batch_slots.zero_()
        self.batch_tokens.zero_()
        self.aux_total = self.z_total = None
        self.step_bytes = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        tokens = x.reshape(-1, dim)
        logits = self.router_logits(tokens)
        scores, chosen, weights = self.choose(logits)
        out = self.dispatch(tokens, chosen, weights)
        if self.shared is not None:
            out = out + self.shared(tokens).to(out.dtype)
        if self.training and torch.is_grad_enabled():
            extra = None  # the auxiliary losses' terms, scaled by their coefficients
            if self.balance == "aux_loss":
                aux = self.balance_loss(scores, chosen.view(b, s, -1))
                if counting():
                    self.aux_total = aux.detach() + (0 if self.aux_total is None
                                                     else self.aux_total)
                extra = aux * self.aux_loss_coeff
            if self.router_z_coeff:
                z = self.router_z_loss(logits)
                if counting():
                    self.z_total = z.detach() + (0 if self.z_total is None else self.z_total)
                extra = z * self.router_z_coeff + (0 if extra is None else extra)
            if extra is not None:
                out = add_aux_loss(out, extra)
        return out.view(b, s, dim)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scores [T, E] (float32), the chosen experts [T, k] and their weights [T, k]."""
        return self.choose(self.router_logits(tokens))

    def router_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The router's logits [T, E], computed in float32 whatever the forward computes in:
        under autocast too (bf16 scores would flip near-tied choices on rounding)."""
        with torch.autocast(tokens.device.type, enabled=False):
            return self.router(tokens.float())

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`route` from the router's float32 logits [T, E]."""
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if self.balance == "bias" else scores
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.score == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, chosen, weights

    def dispatch(self, tokens: torch.Tensor, chosen: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """Send each token to its experts, run them, and bring the weighted outputs back
        (optimus/models/moe_routes.py: how, and what each pass moves)."""
        k = self.top_k
        x = in_compute_dtype(tokens)
        slots = self.slots(chosen)
        scale = weights.reshape(-1)
        if self.capacity_factor is None:
            rows, row_of_slot = spread(x, slots, k)
            y = self.experts(rows, slots.counts, scale=scale[slots.order])
            return fold(y, row_of_slot, slots, k)
        plan = plan_capacity(slots, self.capacity(tokens.shape[0]))
        e, dim = self.experts_n, x.shape[-1]
        stacked = x.index_select(0, plan.source // k).view(e, plan.rows, dim)
        scale = torch.where(plan.filled, scale[plan.source], 0).view(e, plan.rows)
        y = self.experts(stacked, None, plan.rows, scale=scale)
        return sum_slots(y.view(-1, y.shape[-1]), plan.row_of_slot, k)

    def capacity(self, n_tokens: int) -> int | None:
        """Slots each expert takes of `n_tokens` tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return capacity_of(self.capacity_factor, n_tokens, self.top_k, self.experts_n)

    def slots(self, chosen: torch.Tensor) -> Slots:
        """The slots grouped by expert in token order (slot t * k + j is token t's j-th
        expert), with each expert's count; counts the load and, under a capacity, the slots
        dropped past it (on the device: nothing here waits for it)."""
        slots = group_slots(chosen, self.experts_n)
        if torch.is_grad_enabled() and counting():  # a training pass, counted once
            with torch.no_grad():
                self.load += slots.counts.float()
                capacity = self.capacity(chosen.shape[0])
                if capacity is not None:
                    self.dropped += (slots.counts - capacity).clamp(min=0).sum()
        return slots

    def router_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's share of ST-MoE's router z-loss: the sum over its tokens of
        logsumexp(router logits)^2, over the step's global token count (as the balance loss:
        summed over ranks and microbatches, the mean over the step's tokens). It keeps the
        router's logits small, where the softmax (or sigmoid) is not saturated and rounding
        in bf16 costs little. Local: no count crosses ranks."""
        return logits.logsumexp(-1).square().sum() / self.step_tokens

    def balance_loss(self, scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """This rank's share of the auxiliary loss: experts x sum over experts of (the fraction
        of slots routed to it) x (its mean probability), over the scope's tokens (1 when
        balanced, up to `experts` when one expert takes everything), weighted by the scope's
        share of the step's tokens. `chosen` is [sequences, positions, k]. Only the counts
        cross ranks; each rank adds its own tokens' probabilities."""
        e = self.experts_n
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        b, s, _ = chosen.shape
        fraction = self._fractions(chosen)  # [E] (global) or [b, E] (sequence)
        per_sequence = probs.view(b, s, e).sum(1)  # [b, E]
        prob_sums = per_sequence.sum(0) if self.aux_scope == "global" else per_sequence
        return e * (fraction * prob_sums).sum() / self.step_tokens

    def _fractions(self, chosen: torch.Tensor) -> torch.Tensor:
        """Slot fractions per expert in this pass's scope, counted once per real forward:
        a recompute replays them, a dry pass counts locally and keeps nothing."""
        mode, record = _PASS.get() or (None, None)
        if mode == "replay":
            return record[id(self)]
        e, k = self.experts_n, self.top_k
        b, s, _ = chosen.shape
        with torch.no_grad():
            # [b, E] slots per sequence and expert: a scatter-add, not `one_hot`, whose range
            # check reads the indices' min and max on the host.
            flat = chosen.reshape(b, -1)
            per_sequence = torch.zeros(b, e, device=chosen.device).scatter_add_(
                1, flat, torch.ones(flat.shape, device=chosen.device))
            if self.aux_scope == "global":
                counts = torch.cat([per_sequence.sum(0), per_sequence.new_full((1,), b * s)])
                if mode != "dry":
                    counts = self.sum_over_batch(counts)
                    self.batch_slots += counts[:e]
                    self.batch_tokens += counts[e]
                    counts = torch.cat([self.batch_slots, self.batch_tokens.view(1)])
                fraction = counts[:e] / (counts[e] * k)
            else:
                counts = torch.cat([per_sequence, per_sequence.new_full((b, 1), s)], dim=1)
                if mode != "dry":
                    counts = self.sum_over_sequence(counts)
                fraction = counts[:, :e] / (counts[:, e:] * k)
        if mode == "record":
            record[id(self)] = fraction
        return fraction


def counting() -> bool:
    """Whether this pass counts (not a recompute's replay, not a dry pass)."""
    current = _PASS.get()
    return current is None or current[0] == "record"


def dry() -> bool:
    """Whether this pass runs on placeholder inputs (`moe_pass("dry")`)."""
    current = _PASS.get()
    return current is not None and current[0] == "dry"


def _alone(totals: torch.Tensor) -> torch.Tensor:
    return totals


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
