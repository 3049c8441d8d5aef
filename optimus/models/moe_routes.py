"""Where a mixture-of-experts layer's token slots go and how they come back, on the device.

A token's k chosen experts are its k slots: slot t * k + j is token t's j-th. The experts take
their rows grouped by expert; the layer's output is each token's slots summed. The functions
here build the index tensors of that round trip without a host read (no boolean-mask
indexing, no `repeat_interleave` by counts, no `.item()`: each would wait for the device), and
move each row of `dim` numbers as few times as they can:

- dispatch: the tokens are cast to the compute dtype first (bf16 under autocast: half the
  bytes of a float32 residual stream), then gathered once into the experts' order;
- the routing weight multiplies the experts' hidden activations (`swiglu_experts`' `scale`),
  not their output: no pass of its own over `dim`-wide rows where a compiler fuses it;
- combine: the experts' rows are gathered back into token order (one pass, compute dtype) and
  each token's k rows summed by a reduction that accumulates in float32 whatever the dtype.

Dropless routing gives the experts a [slots, dim] input grouped by expert (a grouped GEMM).
Capacity-limited routing gives them a stacked [experts, capacity + 1, dim] input (a batched
GEMM whose shape the host knows without asking the device): row c of expert e is its c-th slot
in token order, the rows past its count and the spare last one are padding whose weight is 0,
and a dropped slot reads its expert's spare row, whose output is exactly 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Slots:
    """The layer's slots grouped by expert, in token order within an expert."""

    order: torch.Tensor  # [slots]: the slot at each place of the expert-major order
    experts: torch.Tensor  # [slots]: the expert of each place (sorted)
    counts: torch.Tensor  # [experts]: slots routed to each expert (before any capacity)


def group_slots(chosen: torch.Tensor, n_experts: int) -> Slots:
    """Group the slots of `chosen` [tokens, k] by expert (a stable sort: token order kept)."""
    flat = chosen.reshape(-1)
    experts, order = torch.sort(flat, stable=True)
    return Slots(order, experts, torch.bincount(flat, minlength=n_experts))


def capacity_of(factor: float, tokens: int, top_k: int, n_experts: int) -> int:
    """Slots an expert takes under a capacity factor: ceil(factor x tokens x k / experts)."""
    return math.ceil(factor * tokens * top_k / n_experts)


def place_in_expert(slots: Slots) -> torch.Tensor:
    """Each place's rank within its expert's queue (0 for the expert's first slot)."""
    starts = torch.cumsum(slots.counts, 0) - slots.counts
    return torch.arange(slots.order.numel(), device=slots.order.device) - starts[slots.experts]


def token_major(values: torch.Tensor, slots: Slots) -> torch.Tensor:
    """`values`, one per place of the expert-major order, put back in slot order."""
    return torch.empty_like(values).index_copy_(0, slots.order, values)


def sum_slots(rows: torch.Tensor, where: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's k rows summed: `where` [tokens * k] is the row of `rows` each slot reads.
    One gather in the rows' dtype, then a sum that accumulates in float32 (torch's reductions
    do for bf16 and fp16) and rounds once to the rows' dtype."""
    gathered = rows.index_select(0, where)
    return gathered.view(-1, top_k, rows.shape[-1]).sum(1)


def host_sizes(counts: torch.Tensor) -> list[int]:
    """The split sizes of an all-to-all, read on the host: under expert parallelism the one
    place a layer waits for the device (the collectives need their sizes before they start).
    `.tolist()` is one device-to-host copy, however many numbers."""
    return counts.tolist()


class _Spread(torch.autograd.Function):
    """Each token's row once for each of its slots (`token_of_row`: the token of each row, in
    expert order). Backward gathers each token's k rows' gradients (`row_of_slot`) and sums
    them with float32 accumulation: no zeroed buffer and no scatter-add in the compute dtype,
    which autograd's own backward of a gather would be."""

    @staticmethod
    def forward(ctx, x, token_of_row, row_of_slot, top_k):
        ctx.save_for_backward(row_of_slot)
        ctx.top_k = top_k
        return x.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad):
        (row_of_slot,) = ctx.saved_tensors
        return _fold(grad, row_of_slot, ctx.top_k), None, None, None


class _Fold(torch.autograd.Function):
    """Each token's k rows summed (`row_of_slot`: the row of each slot, one slot a row).
    Backward hands each row its token's gradient (one gather), not an expanded gradient made
    contiguous and then scattered."""

    @staticmethod
    def forward(ctx, rows, row_of_slot, token_of_row, top_k):
        ctx.save_for_backward(token_of_row)
        return _fold(rows, row_of_slot, top_k)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return grad.index_select(0, token_of_row), None, None, None


def _fold(rows: torch.Tensor, row_of_slot: torch.Tensor, top_k: int) -> torch.Tensor:
    return rows.index_select(0, row_of_slot).view(-1, top_k, rows.shape[-1]).sum(1)


def spread(x: torch.Tensor, slots: Slots, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropless dispatch: the tokens' rows in expert order (each token k times), and the row
    of each slot, which `fold` takes back. Every row is one slot's: the gather is a
    permutation of the slots, so each direction's backward is the other direction."""
    token_of_row = torch.div(slots.order, top_k, rounding_mode="floor")
    row_of_slot = token_major(torch.arange(slots.order.numel(), device=x.device), slots)
    return _Spread.apply(x, token_of_row, row_of_slot, top_k), row_of_slot


def fold(rows: torch.Tensor, row_of_slot: torch.Tensor, slots: Slots,
         top_k: int) -> torch.Tensor:
    """Dropless combine: each token's k rows (one a slot, in expert order) summed."""
    token_of_row = torch.div(slots.order, top_k, rounding_mode="floor")
    return _Fold.apply(rows, row_of_slot, token_of_row, top_k)


def in_compute_dtype(tokens: torch.Tensor) -> torch.Tensor:
    """The tokens in the dtype the experts compute in: the autocast dtype under autocast (the
    residual stream is float32 there; the grouped GEMM would cast them anyway, after the
    k-fold gather: casting first halves what the gather moves)."""
    device = tokens.device.type
    if torch.is_autocast_enabled(device):
        return tokens.to(torch.get_autocast_dtype(device))
    return tokens


@dataclass
class CapacityPlan:
    """Capacity-limited routing into a stacked [experts, capacity + 1] buffer (see above)."""

    source: torch.Tensor  # [experts * (capacity + 1)]: the slot each buffer row reads
    filled: torch.Tensor  # [experts * (capacity + 1)]: whether that row holds a real slot
    row_of_slot: torch.Tensor  # [slots], slot order: the buffer row each slot's output is in
    kept: torch.Tensor  # [experts]: slots each expert takes (its count, at most capacity)
    rows: int  # capacity + 1 rows an expert


def plan_capacity(slots: Slots, capacity: int) -> CapacityPlan:
    """Which slot fills each row of the experts' stacked buffer, and where each slot reads
    its output back: every shape from the host's own numbers, nothing read from the device."""
    n_experts, rows = slots.counts.numel(), capacity + 1
    device = slots.order.device
    starts = torch.cumsum(slots.counts, 0) - slots.counts
    row = torch.arange(n_experts * rows, device=device)
    expert, within = row // rows, row % rows
    kept = slots.counts.clamp(max=capacity)
    filled = within < kept[expert]
    place = (starts[expert] + within).clamp(max=max(slots.order.numel() - 1, 0))
    source = slots.order[place] if slots.order.numel() else torch.zeros_like(row)
    placed = place_in_expert(slots).clamp(max=capacity)  # a dropped slot: the spare row
    row_of_slot = token_major(slots.experts * rows + placed, slots)
    return CapacityPlan(source, filled, row_of_slot, kept, rows)
