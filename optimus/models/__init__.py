"""The dense GPT: plain PyTorch, built on meta and initialised deterministically."""

from optimus.models.counts import flops_per_token, matmul_param_count, param_count
from optimus.models.gpt import (
    GPT,
    Attention,
    Block,
    FeedForward,
    RMSNorm,
    build_model,
    default_ffn_dim,
    init_weights,
    materialize,
)

__all__ = [
    "GPT",
    "Attention",
    "Block",
    "FeedForward",
    "RMSNorm",
    "build_model",
    "default_ffn_dim",
    "flops_per_token",
    "init_weights",
    "materialize",
    "matmul_param_count",
    "param_count",
]
