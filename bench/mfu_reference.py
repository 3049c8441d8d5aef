"""The reference of bench/mfu.py: the training loop a plain-PyTorch user writes by hand.

It takes the same model (`build_model`'s code, the initial weights it drew) and the same
batches as the Optimus run it is set beside, and applies each technique the way PyTorch and
torchao document it, with nothing of Optimus's own: no trainer, no process group, no wrappers.
Its loop (`run_steps`) is also the one bench/torchtitan_peer.py drives torchtitan's model with.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from optimus.data import build_loader, build_source
from optimus.models import build_model


def _saved_ops() -> set:
    """Ops whose outputs op-level recompute keeps: matmuls (float8 ones too) and attention.
    Everything else in a block (norms, RoPE, SwiGLU's product, casts) is recomputed."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


SAVED = _saved_ops()


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


class Recomputed(nn.Module):
    """A block under torch.utils.checkpoint with the op-level selective policy."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                       _policy))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def build(job, mode, device: torch.device, weights: dict, recipe: str):
    """The model as the user sets it up: float8 linears, then recompute, then compile."""
    model = build_model(job.model, seed=job.seed, device="meta").to_empty(device=device)
    model.load_state_dict(weights)
    model.reset_rope()
    if mode.precision == "float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda _, fqn: fqn.startswith("layers."))
    for key, block in list(model.layers.items()):
        if mode.ac == "op":
            block = Recomputed(block)
        if mode.compile:
            block = torch.compile(block)
        model.layers[key] = block
    loss_fn = torch.compile(cross_entropy) if mode.compile else cross_entropy
    return model, loss_fn


def batches(job) -> list[dict]:
    """The batches the Optimus run reads (same source, seed and order), drawn up front."""
    d = job.data
    source = build_source(d.source, path=d.path, vocab_size=job.model.vocab_size, seed=job.seed)
    loader = iter(build_loader(source, seq_len=d.seq_len, batch_size=d.batch_size,
                               microbatches=1, dp_rank=0, dp_size=1, seed=job.seed))
    return [next(loader) for _ in range(job.optim.steps)]


def run_steps(batches, train_step, window) -> float:
    """The loop itself: one step a batch, marked at its start (`window.step_start`); the loss
    read on the host at logged steps only, as a user's log line does (and the trainer's
    logging: `window.logged`). Returns the first step's loss (step 1 is always logged)."""
    first = None
    for step, batch in enumerate(batches, 1):
        window.step_start(step)
        loss = train_step(batch)
        if window.logged(step):
            value = loss.item()  # waits for the device
            first = value if first is None else first
    return first


def reference_step_times(job, mode, device: torch.device, weights: dict, recipe: str,
                         window) -> float:
    """Train `job.optim.steps` steps by hand, marked in `window`; the first step's loss."""
    model, loss_fn = build(job, mode, device, weights, recipe)
    o = job.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                  eps=o.eps, weight_decay=o.weight_decay, fused=True)
    autocast = (contextlib.nullcontext() if mode.precision == "fp32"
                else torch.autocast(device.type, dtype=torch.bfloat16))

    def train_step(batch) -> torch.Tensor:
        with autocast:
            logits = model(batch["input_ids"].to(device, non_blocking=True))
            loss = loss_fn(logits, batch["labels"].to(device, non_blocking=True))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return run_steps(batches(job), train_step, window)
