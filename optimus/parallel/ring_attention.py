"""Ring attention: causal attention over a sequence split across a context-parallel group.

Each rank holds its queries, keys and values for its chunks of every sequence
(`SequenceSlice`: a head and a tail chunk when balanced). Forward, the key/value block of each
rank goes once around the ring (cp - 1 shifts: send to the next rank, receive from the
previous), each shift started before the block in hand is worked on, so that it travels
while the rank computes. Every query chunk attends to every key chunk that is not later than
it: an earlier chunk whole, its own chunk causally; a later one is skipped, not masked. The
partial results merge by their log-sum-exp (online softmax) in float32. Backward
(`_Ring.backward`, written out rather than left to autograd, which would keep every block's
scores) sends the blocks around again with their gradient accumulators: each rank adds its
queries' share to the block in hand, the accumulator travels on, and one last shift brings
every block's gradient home; the next block travels while one is worked on, the accumulator
once its share is in. A chunk pair's forward and backward use the global output and
log-sum-exp, as flash attention's backward does, so nothing of size sequence x sequence is
ever held.

A chunk pair's forward and backward use the global output and log-sum-exp, as flash
attention's backward does, so nothing of size sequence x sequence is ever held.

A chunk pair's attention (`_pair_forward`, `_pair_backward`) is explicit float32 math: the
scores of one chunk pair at a time, recomputed in backward, never kept (float32 training then
equals one process's attention to 1e-5 after Adam's steps). In bf16 or fp16 on a CPU it is
torch's fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu`, which returns the
log-sum-exp and has a backward that takes it); in float32 that kernel's blocked sums drift
past 1e-5 of the one-process weights within 5 steps (tensor x context parallel). Tests run
both kernels on CPU.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

aten = torch.ops.aten


class RingAttention:
    """Causal attention of this rank's queries to every rank's keys and values."""

    def __init__(self, group: dist.ProcessGroup, where, kernel: str | None = None):
        self.group, self.where = group, where
        ranks = dist.get_process_group_ranks(group)
        me = where.rank
        self.to, self.frm = ranks[(me + 1) % where.size], ranks[(me - 1) % where.size]
        self.kernel = kernel  # "flash" or "math"; None: as the module says
        # Point-to-point sends: compiled code calls it as it is. Wrapped here, not decorated,
        # since the decorator imports dynamo, which the trainer loads only when it compiles.
        self._attend = torch.compiler.disable(self._attend)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._attend(q, k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, heads, s, head_dim]; k, v [b, kv_heads, s, head_dim], sent around as they
        are (grouped-query heads are repeated for the queries only a chunk pair at a time)."""
        low = q.dtype in (torch.bfloat16, torch.float16)
        kernel = self.kernel or ("flash" if q.device.type == "cpu" and low else "math")
        return _Ring.apply(q, k, v, self, kernel)

    def pairs(self, owner: int) -> list[tuple[int, int, bool]]:
        """(query chunk, key chunk, causal) of this rank's chunks against `owner`'s, in the
        local order of each: the pairs where the keys are not later than the queries."""
        mine, theirs = self.where.chunks(self.where.rank), self.where.chunks(owner)
        return [(i, j, a == b) for i, a in enumerate(mine) for j, b in enumerate(theirs)
                if b <= a]

    def shift(self, x: torch.Tensor, tag: int) -> _Shift:
        """Start sending `x` to the next rank and receiving the previous rank's (`.wait()`
        gives it): the caller computes meanwhile. Blocks and gradient accumulators in flight
        together travel under their own tags."""
        x = x.contiguous()
        out = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, self.to, self.group, tag=tag),
               dist.P2POp(dist.irecv, out, self.frm, self.group, tag=tag)]
        return _Shift(out, dist.batch_isend_irecv(ops))


class _Shift:
    """A shift in flight: the tensor arriving, and the sends and receives to wait for."""

    def __init__(self, out: torch.Tensor, works: list):
        self.out, self.works = out, works

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.out


BLOCK, GRADIENT = 1, 2  # the tags of a key/value block and of its gradient accumulator


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: RingAttention, kernel: str):
        cp, rank, pieces = ring.where.size, ring.where.rank, ring.where.pieces
        chunk = q.shape[2] // pieces
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        with torch.autocast(q.device.type, enabled=False):  # the merge stays float32
            _ring_forward(ring, kernel, q, kv, out, lse, chunk, scale, cp, rank)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ring, ctx.kernel, ctx.scale = ring, kernel, scale
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, kernel, scale = ctx.ring, ctx.kernel, ctx.scale
        cp, rank, pieces = ring.where.size, ring.where.rank, ring.where.pieces
        chunk = q.shape[2] // pieces
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        coming = None
        for step in range(cp):
            if step:  # the accumulator moves on once this rank's share is in it
                kv, dkv = coming.wait(), ring.shift(dkv, GRADIENT).wait()
            if step < cp - 1:  # the next block travels while this one is worked on
                coming = ring.shift(kv, BLOCK)
            for i, j, causal in ring.pairs((rank - step) % cp):
                qs, ks, vs = _pieces(q, kv, i, j, chunk)
                rows, keys = slice(i * chunk, (i + 1) * chunk), slice(j * chunk, (j + 1) * chunk)
                g = _pair_backward(_piece(dout, i, chunk), qs, ks, vs, _piece(out, i, chunk),
                                   lse[:, :, rows].contiguous(), causal, scale, kernel)
                dq[:, :, rows] += g[0].float()
                dkv[0, :, :, keys] += _fold(g[1], kv.shape[2])
                dkv[1, :, :, keys] += _fold(g[2], kv.shape[2])
        if cp > 1:  # each block's gradient to the rank that owns it
            dkv = ring.shift(dkv, GRADIENT).wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _ring_forward(ring: RingAttention, kernel: str, q, kv, out, lse, chunk: int, scale: float,
                  cp: int, rank: int) -> None:
    """Fill `out` and `lse` (float32) with this rank's queries' attention to every block,
    the next block on its way while one is worked on."""
    coming = None
    for step in range(cp):
        if step:
            kv = coming.wait()
        if step < cp - 1:
            coming = ring.shift(kv, BLOCK)
        for i, j, causal in ring.pairs((rank - step) % cp):
            qs, ks, vs = _pieces(q, kv, i, j, chunk)
            o, m = _pair_forward(qs, ks, vs, causal, scale, kernel)
            rows = slice(i * chunk, (i + 1) * chunk)
            both = torch.logaddexp(lse[:, :, rows], m)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - both)[..., None]
                               + o.float() * torch.exp(m - both)[..., None])
            lse[:, :, rows] = both


def _pieces(q, kv, i: int, j: int, chunk: int):
    """Query chunk i and key/value chunk j, the kv heads repeated for the query heads."""
    ks, vs = (_piece(t, j, chunk) for t in (kv[0], kv[1]))
    if ks.shape[1] != q.shape[1]:
        ks, vs = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (ks, vs))
    return _piece(q, i, chunk), ks, vs


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A repeated kv head's gradient: the sum over the query heads it served (float32)."""
    b, heads, n, d = grad.shape
    return grad.float().view(b, kv_heads, heads // kv_heads, n, d).sum(2)


def _piece(t: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    return t[:, :, n * chunk:(n + 1) * chunk].contiguous()


def _pair_forward(q, k, v, causal: bool, scale: float, kernel: str):
    """Attention of one query chunk to one key chunk: its output and float32 log-sum-exp."""
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                scale=scale)
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v.float(), lse


def _pair_backward(dout, q, k, v, out, lse, causal: bool, scale: float, kernel: str):
    """The gradients of q, k, v of one chunk pair, given the global output and log-sum-exp of
    the query rows (flash attention's backward, which is exact blockwise)."""
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
    d, o = dout.float(), out.float()
    dp = d @ v.float().transpose(-2, -1)
    ds = p * (dp - (d * o).sum(-1, keepdim=True))
    dq, dk = ds @ k.float() * scale, ds.transpose(-2, -1) @ q.float() * scale
    return dq, dk, p.transpose(-2, -1) @ d


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        n = scores.shape[-1]
        hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, -math.inf)
    return scores
