"""Parameter and FLOP counts of the GPT (dense or MoE), by formula (for MFU and planning).

Torch-free: the planner and the controller (which plans the layouts a smaller job may take)
read these without importing torch."""

from __future__ import annotations


def is_moe_layer(cfg, layer: int) -> bool:
    """Whether layer `layer` of a model config has a mixture of experts as its feed-forward."""
    moe = getattr(cfg, "moe", None)
    return bool(moe is not None and moe.experts) and layer >= moe.dense_layers


def _matmul_params_per_layer(cfg, layer: int, active: bool) -> int:
    head_dim = cfg.dim // cfg.n_heads
    q = cfg.dim * cfg.n_heads * head_dim
    kv = 2 * cfg.dim * cfg.n_kv_heads * head_dim
    o = cfg.n_heads * head_dim * cfg.dim
    if not is_moe_layer(cfg, layer):
        return q + kv + o + 3 * cfg.dim * cfg.ffn_dim
    m = cfg.moe
    expert = 3 * cfg.dim * m.expert_ffn_dim
    routed = m.top_k if active else m.experts  # a token goes through top_k of them
    return q + kv + o + cfg.dim * m.experts + (routed + m.shared_experts) * expert


def matmul_param_count(cfg, active: bool = False) -> int:
    """Parameters that enter a matmul: every weight but the embedding table and the norms.

    The output head is included (it is a matmul; it is not tied to the embedding). With
    `active`, an MoE layer counts only the experts one token goes through (top_k routed and
    the shared ones), and its router.
    """
    layers = sum(_matmul_params_per_layer(cfg, i, active) for i in range(cfg.n_layers))
    return layers + cfg.dim * cfg.vocab_size


def param_count(cfg, active: bool = False) -> int:
    """Exact number of parameters of `GPT(cfg)` (with `active`: those one token uses).

    embedding V*d + per layer (q d*h*hd, k and v d*kvh*hd each, o h*hd*d, two norms 2*d, with
    `qk_norm` the q and k norms 2*hd, and a SwiGLU 3*d*ffn, or in an MoE layer a router d*E
    and (E + shared) experts of 3*d*ffn_e) + final norm d + output head d*V, with
    hd = dim // n_heads.
    """
    embedding = cfg.vocab_size * cfg.dim
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    if cfg.qk_norm:
        norms += cfg.n_layers * 2 * (cfg.dim // cfg.n_heads)
    return embedding + norms + matmul_param_count(cfg, active)


def flops_per_token(cfg, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), the numerator of MFU.

    6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len, where N_matmul is
    `matmul_param_count(cfg, active=True)` (in an MoE layer, the experts a token goes
    through). A multiply-add is 2 FLOPs, so a weight costs 2 FLOPs per token forward and the
    backward costs twice the forward (gradients of inputs and of weights):
    6 per weight per token. Attention scores (Q K^T) and the weighted sum (P V) each cost
    2 * head_dim * seq_len per head per token forward, so 4 forward and 12 in all; the full
    T x T matrix is counted although causal attention needs only half, as is conventional
    (PaLM, Megatron, torchtitan). Embedding lookups, norms, RoPE and softmax are not counted,
    nor is the loss: so neither `model.qk_norm` (two more norms per layer, ~4 FLOPs per
    element of q and k) nor `optim.z_loss` (one more logsumexp over the vocabulary per token,
    ~3 V FLOPs forward, as many as the cross-entropy's softmax) changes this count.
    """
    head_dim = cfg.dim // cfg.n_heads
    attention = 12 * cfg.n_layers * cfg.n_heads * head_dim * seq_len
    return 6 * matmul_param_count(cfg, active=True) + attention
