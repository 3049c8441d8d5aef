"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

`full` wraps every block; `selective` every `every`-th block by its index in the whole model
(not in the stage), so a layout change keeps the same blocks checkpointed.

The recompute in backward replays the MoE layers' balancing decisions of the first forward
and counts nothing again (`recompute_contexts`, torch.utils.checkpoint's `context_fn`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from optimus.models.moe import recompute_contexts


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> int:
    """Wrap blocks of `model.layers` in place; return how many were wrapped."""
    if mode == "none":
        return 0
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode {mode!r}: use none, full or selective")
    wrapped = 0
    for key, block in list(model.layers.items()):
        if mode == "full" or int(key) % every == 0:
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False,
                                                 context_fn=recompute_contexts)
            wrapped += 1
    return wrapped
