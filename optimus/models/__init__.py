"""The dense GPT: plain PyTorch, built on meta and initialised deterministically.

The model's classes are imported on first use (PEP 562): the counts, which the planner and the
controller read, need no torch, and importing any module of this package runs this file.
"""

from optimus.models.counts import flops_per_token, matmul_param_count, param_count

_FROM_GPT = ("GPT", "Attention", "Block", "FeedForward", "RMSNorm", "build_model",
             "default_ffn_dim", "init_weights", "materialize")


def __getattr__(name: str):
    if name in _FROM_GPT:
        from optimus.models import gpt

        return getattr(gpt, name)
    raise AttributeError(f"module 'optimus.models' has no attribute {name!r}")


__all__ = [*_FROM_GPT, "flops_per_token", "matmul_param_count", "param_count"]
