"""The training loss: summed cross-entropy over the step's global token count, and the z-loss.

Dividing by the tokens of the whole global batch (all microbatches, all dp replicas) makes the
gradients, summed over microbatches and ranks, those of the global mean loss. Under tensor
parallelism the logits are a DTensor sharded on the vocabulary and the cross-entropy is the
vocab-parallel one (`loss_context`); no rank ever holds a token's full-vocabulary logits.

The z-loss (`optim.z_loss`, PaLM): coef x log(Z)^2 per labelled token, log Z the logsumexp of
the token's output logits, summed and divided by the same global token count as the
cross-entropy. It pulls log Z towards 0, so the logits do not drift upwards together, which
the softmax cannot see but bf16 rounding and the logits' growth can. It enters the gradient
only: the loss's value (what the trainer logs, judges for spikes and validates) stays the
cross-entropy, so runs with and without it compare. `ce + coef x (z - z.detach())` does
that: the difference is exactly zero (NaN when z overflows, which should show), its gradient
is z's.

Vocab-parallel log Z: each rank's shard gives its max and its sum of exp(x - max); the max
is all-reduced (MAX, no gradient: the shift cancels in log Z), the sums (SUM, differentiable
through DTensor's Partial -> Replicate): [tokens] values cross ranks, never the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from optimus.models import IGNORE_INDEX  # noqa: F401 (re-exported: the loss's own)


class TokenSumLoss:
    """Summed cross-entropy over the global token count of the current step (`tokens`), with
    the z-loss's gradient when `z_loss` > 0 and autograd records (training)."""

    def __init__(self, compile_backend: str | None = None, z_loss: float = 0.0) -> None:
        self.tokens = 1
        self.z_loss = z_loss

        def compiled(fn):
            return torch.compile(fn, backend=compile_backend) if compile_backend else fn

        self._sum = compiled(cross_entropy_sum)
        self._z = compiled(log_z_squared_sum)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not (self.z_loss and torch.is_grad_enabled()):
            return self._sum(logits, labels) / self.tokens
        logits = logits.float()  # bf16 logits: one float32 copy for both terms, not two
        z = self._z(logits, labels)
        loss = self._sum(logits, labels) + self.z_loss * (z - z.detach())  # z: gradient only
        return loss / self.tokens


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of every labelled token, its softmax taken in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def log_z_squared_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over labelled tokens of log(Z)^2, log Z = logsumexp of the token's logits (float32).

    Vocab-parallel logits (a DTensor sharded on the vocabulary) give a replicated DTensor."""
    x = logits.flatten(0, 1).float()
    keep = (labels.flatten() != IGNORE_INDEX).to(torch.float32)
    if isinstance(x, DTensor):
        log_z = _sharded_logsumexp(x)
        keep = DTensor.from_local(keep, x.device_mesh, [Replicate()] * x.device_mesh.ndim,
                                  run_check=False)
    else:
        log_z = torch.logsumexp(x, dim=-1)
    return (log_z.square() * keep).sum()


def _sharded_logsumexp(x: DTensor) -> DTensor:
    """logsumexp over the last (sharded) dim of [tokens, vocab]: all-reduces of [tokens]
    only. DTensor's own logsumexp would all-gather the vocabulary (torch 2.13)."""
    shift = x.detach().amax(-1, keepdim=True).redistribute(
        x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return (x - shift).exp().sum(-1).log() + shift.squeeze(-1)
