"""Activation checkpointing: recompute a block's activations in backward instead of keeping them.

`full` wraps every block; `selective` every `every`-th block by its index in the whole model
(not in the stage), so a layout change keeps the same blocks checkpointed. `op` wraps every
block but keeps the outputs of its expensive ops (matmuls, attention, the tensor-parallel
reduce-scatters) and recomputes only the cheap element-wise ones (norms, RoPE, SwiGLU's
product, casts): most of full recompute's memory saving for a fraction of its extra time, as
a block's bytes are mostly in element-wise intermediates and its time in matmuls.

The recompute in backward replays the MoE layers' balancing decisions of the first forward
and counts nothing again (`recompute_contexts`, torch.utils.checkpoint's `context_fn`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from optimus.models.moe import MoE, recompute_contexts

MODES = ("none", "full", "selective", "op")


def _saved_ops() -> set:
    """The ops whose outputs `op` keeps: those whose recompute would cost real time."""
    aten, ops = torch.ops.aten, set()
    for name in ("mm", "addmm", "bmm", "_scaled_mm", "_grouped_mm",
                 "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    # Recomputing a reduce-scatter would repeat the communication in backward.
    ops.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)
    return ops


_SAVED = _saved_ops()


def _keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def op_level_contexts():
    """`context_fn` for `op` on a dense block: the selective policy above."""
    return create_selective_checkpoint_contexts(_keep_expensive)


def op_level_moe_contexts():
    """`context_fn` for `op` on an MoE block: the selective policy, with the MoE replay."""
    moe_forward, moe_recompute = recompute_contexts()
    forward, recompute = op_level_contexts()
    return _both(moe_forward, forward), _both(moe_recompute, recompute)


@contextmanager
def _both(first, second) -> Iterator[None]:
    with ExitStack() as stack:
        stack.enter_context(first)
        stack.enter_context(second)
        yield


def _context_fn(mode: str, block: nn.Module):
    """What the recompute of `block` runs under. Dense blocks take none but `op`'s policy
    (torch.compile traces checkpoints whose contexts are dispatch modes, nothing else); an MoE
    block adds its replay, and is then compiled inside its checkpoint (optimus/parallel/
    compile.py)."""
    if has_moe(block):
        return op_level_moe_contexts if mode == "op" else recompute_contexts
    return op_level_contexts if mode == "op" else None


def has_moe(block: nn.Module) -> bool:
    return any(isinstance(m, MoE) for m in block.modules())


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> int:
    """Wrap blocks of `model.layers` in place; return how many were wrapped."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: use {', '.join(MODES)}")
    if mode == "none":
        return 0
    wrapped = 0
    for key, block in list(model.layers.items()):
        if mode != "selective" or int(key) % every == 0:
            context_fn = _context_fn(mode, block)
            options = {"context_fn": context_fn} if context_fn else {}
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False, **options)
            wrapped += 1
    return wrapped
