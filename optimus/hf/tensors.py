"""How each Optimus tensor becomes Hugging Face tensors of a family, and back.

A `Piece` is one Optimus tensor (a model state-dict key, the same in every layout) and the
Transformers tensors it is written as. Export and import walk the same list, one piece at a
time, so neither ever holds more than one Optimus tensor and its converted copy.

The transforms:
- `rope`: Optimus rotates the pairs (x[2i], x[2i+1]) of each head, Transformers the pairs
  (x[i], x[i + head_dim/2]) (`rotate_half`). Permuting the rows of wq and wk inside each head
  (even rows first, then odd) makes q and k come out in Transformers' order; the attention
  scores, and so everything downstream, are unchanged. The q/k norms' weights (`qk_norm`, one
  head_dim vector each) are permuted the same way: the RMS of a head does not depend on the
  order of its elements, and each weight element must stay with its element of q or k.
- `experts`: Optimus stacks experts as w1/w3 [E, dim, hidden] and w2 [E, hidden, dim] (input
  first); checkpoints of every Transformers MoE family hold one nn.Linear weight per expert
  ([out, in]: `mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`), which Transformers 5
  stacks itself when it loads them.
- `zero`: a tensor the family always has and Optimus does not (Qwen2-MoE's shared expert);
  written with zero width, so it contributes exactly nothing. On import it must be zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimus.checkpoint.manifest import CheckpointError
from optimus.hf.families import GLM4_MOE, QWEN2_MOE, Family
from optimus.models.counts import is_moe_layer


@dataclass(frozen=True)
class Piece:
    ours: str | None  # the Optimus tensor; None for a `zero` piece
    hf: tuple[str, ...]  # the Transformers tensors it is written as, in order
    kind: str = "same"  # same | rope | experts | zero
    heads: int = 0  # rope: the heads of this projection
    shape: tuple[int, ...] = ()  # zero: its shape


def pieces(cfg, family: Family) -> list[Piece]:
    """Every tensor of the exported model, in model order."""
    out = [Piece("tok_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.n_layers):
        out += _layer(cfg, family, i)
    return out + [Piece("norm.weight", ("model.norm.weight",)),
                  Piece("output.weight", ("lm_head.weight",))]


def _swiglu(ours: str, hf: str) -> list[Piece]:
    return [Piece(f"{ours}{a}.weight", (f"{hf}{b}.weight",))
            for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))]


def _zero_swiglu(hf: str, dim: int) -> list[Piece]:
    shapes = {"gate_proj": (0, dim), "up_proj": (0, dim), "down_proj": (dim, 0)}
    return [Piece(None, (f"{hf}{name}.weight",), "zero", shape=shape)
            for name, shape in shapes.items()]


def _layer(cfg, family: Family, i: int) -> list[Piece]:
    ours, hf = f"layers.{i}.", f"model.layers.{i}."
    out = [
        Piece(f"{ours}attention_norm.weight", (f"{hf}input_layernorm.weight",)),
        Piece(f"{ours}attention.wq.weight", (f"{hf}self_attn.q_proj.weight",), "rope",
              cfg.n_heads),
        Piece(f"{ours}attention.wk.weight", (f"{hf}self_attn.k_proj.weight",), "rope",
              cfg.n_kv_heads),
        Piece(f"{ours}attention.wv.weight", (f"{hf}self_attn.v_proj.weight",)),
        Piece(f"{ours}attention.wo.weight", (f"{hf}self_attn.o_proj.weight",)),
        Piece(f"{ours}ffn_norm.weight", (f"{hf}post_attention_layernorm.weight",)),
    ]
    if cfg.qk_norm:  # one head's worth, shared by every head (Qwen3, Qwen3-MoE, GLM-4-MoE)
        out += [Piece(f"{ours}attention.{n}_norm.weight", (f"{hf}self_attn.{n}_norm.weight",),
                      "rope", 1) for n in "qk"]
    ffn, mlp = f"{ours}feed_forward.", f"{hf}mlp."
    if not is_moe_layer(cfg, i):
        return out + _swiglu(ffn, mlp)
    m = cfg.moe
    out.append(Piece(f"{ffn}router.weight", (f"{mlp}gate.weight",)))
    if family is GLM4_MOE:
        out.append(Piece(f"{ffn}expert_bias", (f"{mlp}gate.e_score_correction_bias",)))
    for name, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        names = tuple(f"{mlp}experts.{e}.{theirs}.weight" for e in range(m.experts))
        out.append(Piece(f"{ffn}experts.{name}", names, "experts"))
    if family is GLM4_MOE:  # ungated shared experts, one SwiGLU as wide as all of them
        out += (_swiglu(f"{ffn}shared.", f"{mlp}shared_experts.") if m.shared_experts
                else _zero_swiglu(f"{mlp}shared_experts.", cfg.dim))
    elif family is QWEN2_MOE:  # its gated shared expert, at zero width: it adds exactly 0
        out += _zero_swiglu(f"{mlp}shared_expert.", cfg.dim)
        out.append(Piece(None, (f"{mlp}shared_expert_gate.weight",), "zero",
                         shape=(1, cfg.dim)))
    return out


def hf_shapes(piece: Piece, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes of `piece.hf`, from the Optimus tensor's shape (no data needed)."""
    if piece.kind == "experts":
        return [(shape[2], shape[1])] * len(piece.hf)
    if piece.kind == "zero":
        return [piece.shape]
    return [tuple(shape)]


def _rope_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head reordered from interleaved pairs to halves: 0,2,4,..,1,3,5,..
    (`w` [rows, cols], or a vector [rows])."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _rope_from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(w.shape)


def to_hf(piece: Piece, tensor: torch.Tensor | None) -> list[torch.Tensor]:
    """The Transformers tensors of one piece, contiguous, in `piece.hf` order."""
    if piece.kind == "zero":
        return [torch.zeros(piece.shape)]
    if piece.kind == "rope":
        return [_rope_to_hf(tensor, piece.heads).contiguous()]
    if piece.kind == "experts":
        return [expert.t().contiguous() for expert in tensor]
    return [tensor.contiguous()]


def from_hf(piece: Piece, tensors: list[torch.Tensor], source: str) -> torch.Tensor | None:
    """The Optimus tensor of one piece (None for a `zero` piece, after checking it is zero)."""
    if piece.kind == "zero":
        (t,) = tensors
        if t.count_nonzero():
            raise CheckpointError(
                f"{source}: {piece.hf[0]} is not zero; Optimus has no counterpart for it (a "
                "gated shared expert), so this model cannot be imported exactly")
        return None
    if piece.kind == "rope":
        return _rope_from_hf(tensors[0], piece.heads)
    if piece.kind == "experts":
        return torch.stack([t.t() for t in tensors])
    return tensors[0]
