"""A Llama-style dense GPT in plain PyTorch.

No parallel code lives here: tensor parallelism, pipeline splitting and data-parallel sharding
are applied from outside by `optimus.parallel`. Two properties make that possible:

- Attention derives its head counts from the activations (`q.view(b, s, -1, head_dim)`), so
  sharding `wq`/`wk`/`wv` column-wise and `wo` row-wise needs no change here.
- `forward` skips `tok_embeddings`, `norm` and `output` when they are set to None, and `layers`
  is a ModuleDict keyed "0".."L-1", so a pipeline stage is this model with pieces deleted.
- Two seams let a model hold a slice of each sequence (context parallelism): `GPT.positions`,
  the positions its sequences hold (RoPE rotates by them), and `Attention.attend`, the
  attention of q, k, v.

Models are built on the meta device and initialised by `init_weights`, which gives every
parameter values that depend only on (seed, its fully qualified name): every layout starts from
the same weights.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from optimus.models.counts import is_moe_layer
from optimus.models.moe import MoE


def default_ffn_dim(dim: int, multiple_of: int) -> int:
    """Llama's SwiGLU hidden size: 2/3 of 4 * dim, rounded up to a multiple of `multiple_of`."""
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None):
    """Cos and sin tables of shape [max_seq_len, head_dim // 2], in float32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
                            / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device=device), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [b, s, heads, head_dim] by position (Llama's layout)."""
    s = x.shape[1]
    cos = cos[:s].view(1, s, 1, -1)
    sin = sin[:s].view(1, s, 1, -1)
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32, returned in x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of q [b, heads, s, head_dim] to k, v [b, kv_heads, s, head_dim]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    """Grouped-query causal self-attention; q, k, v are separate so TP can shard each.

    `attend` computes the attention of q, k, v, [b, heads, s, head_dim] each: the device's
    causal kernel, or one that spans the ranks holding the rest of the sequence.

    With `qk_norm`, each head's query and key are RMS-normalised before RoPE (Qwen3's QK-norm:
    `q_norm` and `k_norm`, one weight of head_dim each, shared by every head), which bounds
    the attention logits whatever the projections' scale."""

    def __init__(self, cfg):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attend = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the activations: local heads under tensor parallelism.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = self.attend(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block; its feed-forward is a mixture of experts in MoE layers."""

    def __init__(self, cfg, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if is_moe_layer(cfg, layer):
            m = cfg.moe
            shared = (FeedForward(cfg.dim, m.expert_ffn_dim * m.shared_experts)
                      if m.shared_experts else None)
            self.feed_forward = MoE(cfg, layer, shared)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer: tokens [b, s] -> logits [b, s, vocab_size].

    Any of `tok_embeddings`, `norm`, `output` may be set to None (pipeline stages): without
    `tok_embeddings` the input is hidden states [b, s, dim]; without `output` the result is.
    `positions` (int64, on the CPU) are the positions of every sequence this model holds, in
    order, when it holds a slice of each; None: all of them from 0.
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.positions: torch.Tensor | None = None
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)compute the RoPE tables in float32 on the device the model lives on."""
        device = self._param_device()
        cos, sin = rope_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len,
                               self.cfg.rope_theta, device=device)
        if self.positions is not None:  # the rows of the positions this model holds
            where = self.positions.to(device)
            cos, sin = cos.index_select(0, where), sin.index_select(0, where)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _param_device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return torch.get_default_device()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


# Wrappers that activation checkpointing, torch.compile and FSDP1 insert into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter's name with wrapper modules removed: the key its initial values hang on."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit generator seed from (seed, parameter name); never Python's hash()."""
    digest = hashlib.sha256(f"{seed}/{canonical_name(name)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """Initialise every parameter from (seed, its name) alone, and recompute the RoPE tables.

    Each parameter gets its own CPU float32 generator, so the values do not depend on which
    other parameters exist (a pipeline stage gets the same values as the full model), on the
    device or on the dtype. Norm weights are ones; embeddings, linear, router and expert
    weights are normal(0, init_std), except the residual-branch outputs (`wo`, every `w2`),
    scaled by 1/sqrt(2 * n_layers) (GPT-2) so the residual stream's variance does not grow with
    depth. DTensor parameters (already sharded) get their shard of the same full tensor. MoE
    buffers (the balancing bias, the load counters) start at zero.
    """
    cfg = model.cfg
    for name, p in model.named_parameters():
        name = canonical_name(name)
        if name.endswith("norm.weight"):
            full = torch.ones(p.shape, dtype=torch.float32)
        else:
            std = cfg.init_std
            if name.endswith(("attention.wo.weight", ".w2.weight", "experts.w2")):
                std /= math.sqrt(2 * cfg.n_layers)
            g = torch.Generator().manual_seed(param_seed(seed, name))
            full = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g)
        _copy_full(p, full)
    for module in model.modules():
        if isinstance(module, MoE):
            module.reset_buffers()
    model.reset_rope()


def _copy_full(p: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(p, DTensor):
        # Every rank built the same full tensor: take the local shard without communication.
        full = distribute_tensor(full.to(p.device), p.device_mesh, p.placements,
                                 src_data_rank=None)
    p.copy_(full)


def build_model(cfg, seed: int, device: torch.device | str = "cpu") -> GPT:
    """Build on the meta device, materialise on `device`, and initialise from `seed`.

    With device "meta" the model stays unmaterialised: the parallel plans shard it first, then
    `materialize` gives each rank only its shards."""
    with torch.device("meta"):
        model = GPT(cfg)
    return materialize(model, seed, device)


def materialize(model: nn.Module, seed: int, device: torch.device | str) -> nn.Module:
    """Allocate a meta-device model (or its shards) on `device` and initialise it from `seed`;
    a no-op on meta."""
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        init_weights(model, seed)
    return model
