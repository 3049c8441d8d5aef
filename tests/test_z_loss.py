"""The z-losses: PaLM's on the output logits (`optim.z_loss`) and ST-MoE's on the routers'
(`model.moe.router_z_loss`), against gradients worked out by hand on tiny cases.

Every layout computes them like one process: tests/test_parallel_matrix.py, test_moe.py and
test_tensor_parallel.py (the `stable` cases) check that.
"""

from __future__ import annotations

import pytest
import torch
from test_moe import layer, moe_job

from optimus.config import ConfigError, check_job, validate_job
from optimus.parallel.loss import IGNORE_INDEX, TokenSumLoss, cross_entropy_sum


def _tiny(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(2, 3, 5, generator=g) + 2  # log Z well away from 0
    labels = torch.randint(0, 5, (2, 3), generator=g)
    labels[1, 0] = IGNORE_INDEX
    return logits, labels


def test_z_loss_adds_its_gradient_but_leaves_the_loss_value_the_cross_entropy():
    logits, labels = _tiny()
    coef, tokens = 0.1, 7  # the step's global token count (other ranks hold the rest)
    x = logits.clone().requires_grad_()
    loss_fn = TokenSumLoss(z_loss=coef)
    loss_fn.tokens = tokens
    loss = loss_fn(x, labels)
    loss.backward()
    # The value: the cross-entropy alone, exactly as without the z-loss.
    plain = TokenSumLoss()
    plain.tokens = tokens
    assert torch.equal(loss.detach(), plain(logits, labels))
    # The gradient, by hand: per labelled token (softmax - onehot) / T for the cross-entropy,
    # and d(coef log(Z)^2)/dx = 2 coef log Z softmax, over the same T; nothing elsewhere.
    p = logits.softmax(-1)
    log_z = logits.logsumexp(-1, keepdim=True)
    onehot = torch.nn.functional.one_hot(labels.clamp(min=0), 5).float()
    keep = (labels != IGNORE_INDEX).unsqueeze(-1).float()
    want = keep * (p - onehot + 2 * coef * log_z * p) / tokens
    torch.testing.assert_close(x.grad, want, rtol=1e-6, atol=1e-7)
    assert float(x.grad[1, 0].abs().max()) == 0.0  # an unlabelled token pulls nothing
    # The z-loss's share is not negligible here, so the check above would see it missing.
    assert float((2 * coef * log_z * p * keep).abs().max()) > 0.05 / tokens


def test_z_loss_pulls_log_z_towards_zero():
    """A step along its gradient lowers every token's |log Z| (the cross-entropy's own
    gradient sums to zero over the vocabulary, so it cannot shift log Z to first order)."""
    logits, labels = _tiny(1)
    x = logits.clone().requires_grad_()
    loss_fn = TokenSumLoss(z_loss=1.0)
    loss_fn(x, labels).backward()
    keep = labels != IGNORE_INDEX
    after = (logits - 0.1 * x.grad).logsumexp(-1)
    assert bool((after.abs() < logits.logsumexp(-1).abs())[keep].all())


def test_validation_and_the_logged_loss_never_compute_the_z_loss():
    logits, labels = _tiny()
    loss_fn = TokenSumLoss(z_loss=0.1)
    with torch.no_grad():
        value = loss_fn(logits, labels)
    assert torch.equal(value, cross_entropy_sum(logits, labels))


def test_router_z_loss_gradient_and_figure_match_a_hand_computation():
    """ST-MoE: coef x the mean over tokens of logsumexp(router logits)^2. Each layer adds its
    tokens' squares over the step's token count; its gradient joins the backward whatever the
    balancing (here none, so it is the router's only auxiliary gradient)."""
    coef = 0.5
    m = layer(router_z_loss=coef, balance="none")
    m.step_tokens = 40
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(3))
    m(x).sum().backward()
    with_z = m.router.weight.grad.clone()
    assert m.z_total is not None
    tokens = x.reshape(-1, 64)
    logits = (tokens @ m.router.weight.T).detach()
    log_z = logits.logsumexp(-1)
    assert float(m.z_total) == pytest.approx(float(log_z.square().mean()), rel=1e-6)
    m.router.weight.grad = None
    m.router_z_coeff = 0.0
    m(x).sum().backward()
    # d/dW of coef * sum_t lse_t^2 / T = coef * 2 lse_t softmax_t x_t^T / T, summed over t.
    by_hand = coef * 2 * (log_z.unsqueeze(-1) * logits.softmax(-1)).T @ tokens / 40
    torch.testing.assert_close(with_z - m.router.weight.grad, by_hand, rtol=1e-4, atol=1e-7)
    assert float(by_hand.abs().max()) > 1e-4


def test_a_router_z_loss_on_a_dense_model_or_a_negative_z_loss_is_refused():
    raw = moe_job(router_z_loss=1e-3)
    raw["model"]["moe"]["experts"] = 0
    with pytest.raises(ConfigError, match="router_z_loss: 0.001 is set on a dense model"):
        check_job(validate_job(raw))
    with pytest.raises(ConfigError, match="z_loss"):
        validate_job({**moe_job(), "optim": {"z_loss": -1.0}})
