"""The layers bench/moe.py measures, built from a job file: the job's MoE layer at one
microbatch of one rank, the dense SwiGLU of the same active parameters, small variants.

One rank's microbatch: seq_len x batch_size / (dp x microbatches) tokens, dp resolved on the
job's world. A job file states its world in its header (`--world N` in its "Validate:" line,
as jobs/mula-7b-a1b.yaml does); `--world` gives it otherwise, or the job's own dp x tp x pp.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from optimus.config import load_job, resolve_layout
from optimus.models.gpt import FeedForward
from optimus.models.moe import MoE

# The small case: the figures bench/moe.py measured before it read a job (4,096 tokens).
SMALL = {"model.dim": 512, "model.moe.experts": 16, "model.moe.expert_ffn_dim": 1024,
         "model.moe.top_k": 2}
SMALL_TOKENS = 4096


@dataclass(frozen=True)
class Shape:
    """One MoE layer's configuration and the tokens it takes at once."""

    model: object  # the job's ModelConfig (with the small case's dims under --small)
    tokens: int  # one microbatch of one rank, or what --tokens says
    job_tokens: int  # the job's own: one microbatch of one rank
    world: int
    dp: int
    microbatches: int
    seq_len: int
    small: bool  # --small's dims, not the job's

    @property
    def dim(self) -> int:
        return self.model.dim

    @property
    def moe(self):
        return self.model.moe

    def describe(self) -> str:
        m = self.moe
        return (f"dim {self.dim}, {m.experts} experts of {m.expert_ffn_dim}, top {m.top_k}, "
                f"{m.score}, balance {m.balance}"
                + (f", capacity {m.capacity_factor}" if m.capacity_factor else "")
                + (f", {m.shared_experts} shared experts (left out)" if m.shared_experts
                   else ""))


def job_world(path: Path) -> int | None:
    """The world a job file states in its header (`--world N`), or None."""
    found = re.search(r"--world\s+(\d+)", path.read_text())
    return int(found.group(1)) if found else None


def job_shape(path: Path, world: int | None, tokens: int | None, small: bool) -> Shape:
    """The MoE layer of the job at `path` (the small case's dims with `small`), and its
    tokens: one rank's microbatch on the job's world, or `tokens`."""
    overrides = [f"{k}={v}" for k, v in SMALL.items()] if small else []
    job = load_job(path, overrides)
    p = job.parallel
    world = world or job_world(path) or (p.dp * p.tp * p.pp if p.dp > 0 else None)
    if world is None:
        raise SystemExit(f"{path}: no world in its header and dp -1: give --world N")
    if not job.model.moe.experts:
        raise SystemExit(f"{path}: model.moe.experts is 0: a dense model has no MoE layer")
    layout = resolve_layout(job, world)
    d = job.data
    per_rank = d.seq_len * d.batch_size // (layout.dp * d.microbatches)
    own = SMALL_TOKENS if small else per_rank
    return Shape(model=job.model, tokens=tokens or own, job_tokens=own, world=world,
                 dp=layout.dp, microbatches=d.microbatches, seq_len=d.seq_len, small=small)


def batch_shape(shape: Shape) -> tuple[int, int]:
    """[sequences, positions] of the tokens: whole sequences where they divide."""
    if shape.tokens % shape.seq_len == 0:
        return shape.tokens // shape.seq_len, shape.seq_len
    return 1, shape.tokens


def small_model(model, experts: int, dim: int = 64, width: int = 32, top_k: int = 2):
    """`model` with a small MoE layer of `experts` experts (the other settings its own)."""
    moe = model.moe.model_copy(update={"experts": experts, "expert_ffn_dim": width,
                                       "top_k": min(top_k, experts)})
    return model.model_copy(update={"dim": dim, "moe": moe})


def build_moe(model, device: torch.device, dtype: torch.dtype, seed: int = 0) -> MoE:
    """`MoE(model, layer=0)`, its weights normal(0, init_std) from `seed` (the same on every
    rank), in training mode. In bf16 only the experts are: the router scores in float32, its
    own unit under mixed precision (optimus/parallel/data_parallel.py)."""
    torch.manual_seed(seed)
    with torch.device(device):
        moe = MoE(model, layer=0)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, model.init_std)
        moe.reset_buffers()
    moe.experts.to(dtype)
    return moe.train()


def dense_mlp(shape: Shape, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The dense SwiGLU with the MoE layer's active parameters: top_k experts wide."""
    m = shape.moe
    torch.manual_seed(1)
    with torch.device(device):
        mlp = FeedForward(shape.dim, m.top_k * m.expert_ffn_dim)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, shape.model.init_std)
    return mlp.to(dtype).train()


def random_tokens(shape: Shape, device: torch.device, dtype: torch.dtype,
                  seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*batch_shape(shape), shape.dim, generator=g).to(device, dtype)
