"""The dense GPT: plain PyTorch, built on meta and initialised deterministically.

The model's classes load on first use (optimus/lazy.py): the counts, which the planner and the
controller read, need no torch, and importing any module of this package runs this file.
"""

from optimus.lazy import lazy_names
from optimus.models.counts import flops_per_token, matmul_param_count, param_count

IGNORE_INDEX = -100  # a label that carries no loss (the loss, evaluation and the fault hooks)

_WHERE = {name: "gpt" for name in ("GPT", "Attention", "Block", "FeedForward", "RMSNorm",
                                   "build_model", "default_ffn_dim", "init_weights",
                                   "materialize")}
__all__ = [*sorted(_WHERE), "IGNORE_INDEX", "flops_per_token", "matmul_param_count", "param_count"]
__getattr__ = lazy_names(__name__, _WHERE)
