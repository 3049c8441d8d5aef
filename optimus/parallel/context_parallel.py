"""Context parallel: every sequence split over the ranks of the `context` purpose, from outside.

Each rank of a context-parallel group of `cp` ranks holds a slice of every sequence's
positions (`SequenceSlice`): with `balanced` (the default) the sequence is cut into 2 x cp
chunks and rank r holds chunk r and chunk 2cp-1-r, a head chunk and a tail chunk, so each
rank's share of the causal attention's work is the same (the tail of a sequence attends to
more keys than its head); with `contiguous` rank r holds the r-th of cp runs. Everything but
attention is per position, so the model needs only two seams (optimus/models/gpt.py):
the positions its RoPE rotates by (`GPT.positions`: its tables hold those rows) and the
attention of its blocks (`Attention.attend`). `apply_context_parallel` sets both; each rank's
microbatches are cut to its slice of the tokens and labels (`SequenceSlice.take`). The loss
of a slice is a share of the sequence's loss: the `loss` purpose sums it over cp, while the
step's token count is taken from whole sequences (`tokens`): the normalisation is unchanged.

Attention across the group, `parallel.cp_method`:
- `alltoall` (DeepSpeed-Ulysses' exchange): one all-to-all gives each rank every position of
  cp-th of the heads; the device's own causal attention kernel runs on whole sequences; one
  all-to-all gives the positions back. Needs the (tensor-parallel-local) query heads to divide
  by cp; key/value heads that do not are repeated to the query heads first. Each rank sends
  (cp - 1) / cp of its q, k, v and attention output a layer forward, as much in backward.
- `ring` (optimus/parallel/ring_attention.py): the key/value block of each rank goes once
  around the group; each rank attends its queries to every block chunk by chunk (a chunk
  sees an earlier chunk whole, its own causally, a later one not at all) and merges the
  partial results by their log-sum-exp (online softmax). Any head count. Written over
  torch.distributed's point-to-point ops, so any backend (gloo in CI) runs it. torch's own
  `context_parallel` (torch.distributed.tensor.experimental) is not used: in torch 2.13 it
  patches SDPA globally for the CUDA flash/efficient kernels only, and needs its buffers
  sharded by a context manager around each step, which the pipeline schedule's forward
  cannot take.
Both are exact: the result equals one process's attention (to float rounding).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from optimus.models.gpt import Attention
from optimus.parallel.ring_attention import RingAttention


class SequenceSlice:
    """Which positions of every sequence one rank of a context-parallel group holds."""

    def __init__(self, rank: int, size: int, balanced: bool = True):
        self.rank, self.size, self.balanced = rank, size, balanced

    def of(self, rank: int, length: int) -> list[tuple[int, int]]:
        """The [start, end) runs of positions `rank` holds of a `length`-position sequence."""
        if self.balanced:
            chunk = length // (2 * self.size)
            if chunk * 2 * self.size != length:
                raise ValueError(f"a sequence of {length} positions does not split into "
                                 f"2 x cp = {2 * self.size} chunks")
            tail = 2 * self.size - 1 - rank
            return [(rank * chunk, (rank + 1) * chunk), (tail * chunk, (tail + 1) * chunk)]
        part = length // self.size
        if part * self.size != length:
            raise ValueError(f"a sequence of {length} positions does not split over cp = "
                             f"{self.size}")
        return [(rank * part, (rank + 1) * part)]

    @property
    def pieces(self) -> int:
        """Equal chunks a rank holds of every sequence: 2 balanced, 1 contiguous."""
        return 2 if self.balanced else 1

    def chunks(self, rank: int) -> list[int]:
        """Which of the sequence's `pieces` x size equal chunks `rank` holds, in its order."""
        return [rank, 2 * self.size - 1 - rank] if self.balanced else [rank]

    def positions(self, local: int, device: torch.device, rank: int | None = None
                  ) -> torch.Tensor:
        """The positions (int64) rank `rank` (this one by default) holds, for a local slice
        of `local` positions: what RoPE rotates its slice by."""
        return _positions(self.rank if rank is None else rank, self.size, self.balanced,
                          local * self.size, str(device))

    def take(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's slice of [batch, seq, ...] (a copy: the whole stays the caller's)."""
        runs = self.of(self.rank, tokens.shape[1])
        return torch.cat([tokens[:, a:b] for a, b in runs], dim=1)


@lru_cache(maxsize=64)
def _positions(rank: int, size: int, balanced: bool, length: int, device: str) -> torch.Tensor:
    runs = SequenceSlice(rank, size, balanced).of(rank, length)
    return torch.cat([torch.arange(a, b) for a, b in runs]).to(device)


def take_microbatches(microbatches: list[dict], where: SequenceSlice | None) -> list[dict]:
    """Each microbatch with its tokens and labels cut to this rank's slice (as given without
    context parallelism)."""
    if where is None:
        return microbatches
    return [{**mb, "input_ids": where.take(mb["input_ids"]), "labels": where.take(mb["labels"])}
            for mb in microbatches]


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, method: str,
                           where: SequenceSlice, seq_len: int) -> None:
    """Make a GPT (or a pipeline stage of one) attend across `group` and rotate its slice of
    `seq_len`-position sequences by the positions it holds. Apply before activation
    checkpointing, compile and FSDP2 (its RoPE tables are built when it is materialised)."""
    model.positions = where.positions(seq_len // where.size, torch.device("cpu"))
    attend = {"alltoall": AllToAllAttention, "ring": RingAttention}[method](group, where)
    for module in model.modules():
        if isinstance(module, Attention):
            module.attend = attend


class AllToAllAttention:
    """Causal attention over the whole sequence by trading positions for heads and back."""

    def __init__(self, group: dist.ProcessGroup, where: SequenceSlice):
        self.group, self.where = group, where

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp, heads = self.where.size, q.shape[1]
        if heads % cp:
            raise ValueError(f"all-to-all context parallel needs the {heads} local query "
                             f"heads to divide by cp={cp}")
        if k.shape[1] % cp:  # repeat each key/value head for the query heads it serves
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        b, _, local, d = q.shape
        widths = [q.shape[1] // cp, k.shape[1] // cp, v.shape[1] // cp]
        # [b, h, s/cp, d] -> [cp, b, h/cp, s/cp, d]: the heads each rank gets, outermost.
        parts = torch.cat([t.unflatten(1, (cp, -1)).movedim(1, 0) for t in (q, k, v)], dim=2)
        got = funcol.all_to_all_single_autograd(parts.contiguous(), None, None, self.group)
        # [cp (whose positions), b, h/cp, s/cp, d] -> [b, h/cp, s, d] in true position order.
        order = self._order(local, q.device)
        whole = got.movedim(0, 2).flatten(2, 3).index_select(2, torch.argsort(order))
        q, k, v = whole.split(widths, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=k.shape[1] != q.shape[1])
        # Back: each rank's positions to it, for this rank's heads.
        back = out.index_select(2, order).unflatten(2, (cp, local)).movedim(2, 0)
        mine = funcol.all_to_all_single_autograd(back.contiguous(), None, None, self.group)
        return mine.movedim(0, 1).reshape(b, heads, local, d)

    def _order(self, local: int, device: torch.device) -> torch.Tensor:
        """The true positions of the gathered sequence, rank after rank."""
        return torch.cat([self.where.positions(local, device, rank=r)
                          for r in range(self.where.size)])
