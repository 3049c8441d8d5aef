"""One training step as the device runs it: forward, backward, clip, update, no host read.

The host never waits on the device inside a step. What the boundary needs of a step (its
global loss, gradient norm and token count, whether its update was held back, whether this
rank's own loss and gradients were finite, the experts' load) is gathered into one tensor and
copied into host memory behind the step (`Readback`: a pinned buffer and an event on an
accelerator); the boundary reads it once the device is done with it, normally while the next
step's backward runs (optimus/boundary.py). The decisions that must come before the update are
taken on the device from that step's own figures: a non-finite gradient norm, and a spike by
the stability rules (the thresholds the host computed from the history before the step),
hold the update back (the optimizer's `found_inf`: no parameter, moment or step count moves).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from optimus.parallel.experts import expert_step
from optimus.parallel.float8 import precompute_float8_scales
from optimus.parallel.grads import clip_grads_
from optimus.parallel.plan import IGNORE_INDEX, ParallelModel
from optimus.runtime.mesh import LayoutMesh
from optimus.runtime.readback import Pending, Readback

# The step's figures, in this order, in the one tensor the boundary reads (then the experts').
FIGURES = ("loss", "grad_norm", "tokens", "held", "local_loss", "local_grads_squared")


@dataclass(frozen=True)
class Limits:
    """What holds the next update back besides a non-finite gradient norm: a global loss or a
    gradient norm above these (None: that rule does not hold an update back now)."""

    loss: float | None = None
    grad_norm: float | None = None


@dataclass
class StepParts:
    """What a step runs with: the model, its optimizer, the mesh its figures are summed over."""

    model: ParallelModel
    optimizer: torch.optim.Optimizer
    job: object
    mesh: LayoutMesh
    device: torch.device
    faults: object
    heartbeat: object
    replicas: object | None = None  # the quorum's exchange (optimus/parallel/replica_mode.py)
    readback: Readback = field(init=False)

    def __post_init__(self):
        self.readback = Readback(self.device)


@dataclass
class StepOutput:
    """A step the device may still be running: its figures on their way (`pending`), and
    what the host knew of it when it was queued."""

    step: int
    pending: Pending
    lr: float
    started: float
    loss_reduced: bool  # whether `loss` is the global loss (else only this rank's share)
    data: dict | None = None  # its samples' fingerprint (rank 0)
    moe: bool = False  # the experts' figures follow FIGURES


def train_step(parts: StepParts, step: int, microbatches: list[dict], *, lr: float,
               reduce_loss: bool, before_update: Callable[[], Limits]) -> StepOutput:
    """Forward and backward over the step's microbatches (the loss divided by the global token
    count), the gradients clipped, the update applied unless held back on the device.
    `before_update` runs once the step's work is queued and before its update: the boundary
    reads the previous step there and says what holds this update back. `reduce_loss`: sum
    the loss over stages and replicas (the rules or the log read it)."""
    started = time.perf_counter()
    model, job, beat, faults = parts.model, parts.job, parts.heartbeat, parts.faults
    mesh = parts.mesh
    with beat.phase("grad_sync"):
        tokens = count_tokens(microbatches, mesh)
    model.set_step_tokens(tokens)
    loss = model.forward_backward(microbatches, parts.device, beat)
    faults.after_backward(step, model.parameters(), loss)
    local_loss = loss  # this rank's own share, and its own gradients': a bad tile's sign
    limits = None
    if parts.replicas is not None:  # the step summed over the quorum's replicas
        limits = before_update()  # first: a heal after a failed exchange carries its figures
        with beat.phase("grad_sync"):
            tokens, loss = parts.replicas.exchange(model.parameters(), tokens, loss, step)
    with beat.phase("grad_sync"):
        # A non-finite norm turns the gradients NaN: their update is held back below, and
        # whether this rank's own were the bad ones is told by its figures, taken before.
        norm = clip_grads_(model.parameters(), job.optim.grad_clip, mesh.size("pipeline"))
        if reduce_loss and mesh.size("loss") > 1:  # only last stages hold losses
            loss = mesh.all_reduce("loss", loss.clone())
    if limits is None:
        limits = before_update()
    held = hold_back(loss, norm.total, limits)
    with beat.phase("optim"):
        faults.in_optimizer(step)
        parts.optimizer.step(found_inf=held)
        parts.optimizer.zero_grad(set_to_none=True)
        if job.training.float8 == "tensorwise" and mesh.size("shard") * mesh.size("replicas") > 1:
            precompute_float8_scales(model.parts)  # float8 all-gather's scales
    with beat.phase("grad_sync"):  # the experts' load, all ranks; their balance
        experts = expert_step(model.moe, job.model, mesh, parts.device, held)
    figures = torch.stack([loss.double(), norm.total, tokens, held, local_loss,
                           norm.local_squared])
    if experts is not None:
        figures = torch.cat([figures, experts.flatten()])
    return StepOutput(step, parts.readback.start(figures), lr, started, reduce_loss,
                      moe=experts is not None)


def count_tokens(microbatches: list[dict], mesh: LayoutMesh) -> torch.Tensor:
    """Tokens that carry loss in the global batch (all replicas, all microbatches), as a
    tensor on the device: the loss divides by it, nobody reads it on the host."""
    count = None
    for mb in microbatches:
        n = mb["labels"].ne(IGNORE_INDEX).sum()
        count = n if count is None else count.add_(n)
    return mesh.all_reduce("tokens", count)


def hold_back(loss: torch.Tensor, norm: torch.Tensor, limits: Limits) -> torch.Tensor:
    """1.0 where the update must not be applied, else 0.0, decided on the device: a non-finite
    gradient norm, or a spike by a rule whose verdict holds the update back. Compared in
    float64 against the host's float64 thresholds, so the host's verdict on the figures later
    is the same comparison (stability.py `_spike`)."""
    held = norm.sub(norm).isnan()  # x - x is NaN exactly where x is NaN or infinite
    if limits.loss is not None:
        wide = loss.double()
        held |= wide.sub(wide).isnan() | wide.gt(limits.loss)
    if limits.grad_norm is not None:
        held |= norm.double().gt(limits.grad_norm)
    return held.float()
