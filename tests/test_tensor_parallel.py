"""Tensor + sequence parallel over tp ranks equals the same model on one process, in fp32."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from optimus.models import build_model
from optimus.models.gpt import GPT, init_weights
from optimus.parallel.grads import clip_grad_norm_
from optimus.parallel.loss import TokenSumLoss
from optimus.parallel.tensor_parallel import apply_tensor_parallel, loss_context
from optimus.runtime.dims import ParallelDims

SEED, BATCH, SEQ, TP = 7, 2, 16, 2
IGNORE = -100


def _cfg(n_kv_heads: int, n_heads: int = 4, qk_norm: bool = False) -> types.SimpleNamespace:
    return types.SimpleNamespace(vocab_size=256, dim=64, n_layers=2, n_heads=n_heads,
                                 n_kv_heads=n_kv_heads, ffn_dim=128, max_seq_len=64,
                                 rope_theta=10000.0, norm_eps=1e-5, init_std=0.02,
                                 qk_norm=qk_norm)


def _batch(cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels[0, :3] = IGNORE  # the trainer's loss skips these
    return tokens, labels


def _loss(logits: torch.Tensor, labels: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """The trainer's loss, written out: summed cross-entropy over the global token count;
    with `z_loss`, plus z_loss x log(Z)^2 of every labelled token over the same count (PaLM)."""
    tokens = int((labels != IGNORE).sum())
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE)
    if z_loss:
        log_z = torch.logsumexp(logits.float(), dim=-1)
        loss = loss + z_loss * log_z[labels != IGNORE].square().sum()
    return loss / tokens


def _trainer_loss(logits: torch.Tensor, labels: torch.Tensor, z_loss: float) -> torch.Tensor:
    """The trainer's own (vocab-parallel under tp): the cross-entropy's value, both
    gradients."""
    loss = TokenSumLoss(z_loss=z_loss)
    loss.tokens = int((labels != IGNORE).sum())
    return loss(logits, labels)


def _tp_mesh(tp: int = TP):
    return ParallelDims(tp=tp).build_mesh("cpu").mesh("tensor")


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 1e-7):
    if isinstance(actual, DTensor):
        actual = actual.full_tensor()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _check_grads(model, ref) -> None:
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        _close(param.grad, ref_params[name].grad, f"grad of {name}")


def _train_like_one_process(rank: int, tp: int, n_heads: int, n_kv_heads: int,
                            stable: bool) -> dict:
    """With `stable`: QK-norm and a z-loss (large enough to matter here)."""
    cfg = _cfg(n_kv_heads, n_heads, qk_norm=stable)
    z_loss = 0.05 if stable else 0.0
    ref = build_model(cfg, SEED, "cpu")
    # The production path: build on meta, shard, then materialise and initialise by name.
    with torch.device("meta"):
        model = GPT(cfg)
    apply_tensor_parallel(model, _tp_mesh(tp))
    model.to_empty(device="cpu")
    init_weights(model, SEED)

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    for step in range(3):
        tokens, labels = _batch(cfg, step)
        ref_logits = ref(tokens)
        ref_loss = _loss(ref_logits, labels)  # the value: the cross-entropy alone
        _loss(ref_logits, labels, z_loss).backward()
        with loss_context(True):
            logits = model(tokens)
            # Vocab-parallel logits: no rank holds the full vocabulary.
            assert logits.placements == (Shard(2),), logits.placements
            assert logits.to_local().shape == (BATCH, SEQ, cfg.vocab_size // tp)
            loss = _trainer_loss(logits, labels, z_loss)
            loss.backward()
        _close(loss, ref_loss, f"loss at step {step}", atol=0)
        if step == 0:
            _check_grads(model, ref)
        # A small max_norm clips: the global norm and the scale must both be right.
        _close(clip_grad_norm_(model.parameters(), 0.5),
               torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5), "grad norm", atol=0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()

    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        # Adam turns grads of ~1e-9 into steps of ~lr: float noise there moves weights ~1e-6.
        # With QK-norm and the z-loss an element of wq has a gradient within rounding of
        # Adam's eps (1.30e-8 here, 1.39e-8 there at step 2, from grads equal to 5e-7 of
        # their scale): g / (|g| + eps) differs by 0.017, so the weight by 1.7e-5
        # (tests/test_parallel_matrix.py explains it at length). The gradients themselves
        # were compared element by element above.
        _close(param, ref_params[name], f"{name} after 3 steps", atol=5e-5 if stable else 1e-5)
    if stable:  # the norms learnt something: their weights are no longer the initial ones
        assert float((ref.layers["0"].attention.q_norm.weight - 1).abs().max()) > 1e-3
    return {name: p.placements for name, p in model.layers["0"].attention.named_parameters()}


@pytest.mark.parametrize(
    "tp, n_heads, n_kv_heads, kv_placement, stable",
    [(2, 4, 2, Shard(0), False), (2, 4, 1, Replicate(), True),
     # Two kv heads on four ranks: ranks 0, 1 must use kv head 0 and ranks 2, 3 kv head 1.
     (4, 8, 2, Replicate(), True)],
    ids=["kv-heads-split", "kv-heads-replicated-qk-norm-z-loss",
         "kv-heads-replicated-tp4-qk-norm-z-loss"])
def test_tensor_parallel_trains_like_one_process(run_ranks, tp, n_heads, n_kv_heads,
                                                 kv_placement, stable):
    """Loss, every gradient (the first step), the clipped norm and the weights after 3
    steps, against one process. With QK-norm, the norms' weights are replicated and their
    gradients (each rank's heads' share, a pending sum) are whole; with the z-loss, the
    vocab-parallel log Z gives the one-process gradient and the loss stays the
    cross-entropy."""
    results = run_ranks(_train_like_one_process, tp, n_heads, n_kv_heads, stable, timeout=90)
    for placements in results:
        assert placements["wq.weight"] == (Shard(0),)
        assert placements["wk.weight"] == placements["wv.weight"] == (kv_placement,)
        if stable:
            assert placements["q_norm.weight"] == placements["k_norm.weight"] == (Replicate(),)


def _pipeline_stages(rank: int, world_size: int) -> tuple[int, ...]:
    cfg = _cfg(n_kv_heads=2)
    ref = build_model(cfg, SEED, "cpu")
    first, last = build_model(cfg, SEED, "cpu"), build_model(cfg, SEED, "cpu")
    first.norm = first.output = None
    del first.layers["1"]
    last.tok_embeddings = None
    del last.layers["0"]
    mesh = _tp_mesh()
    apply_tensor_parallel(first, mesh)
    apply_tensor_parallel(last, mesh)

    tokens, labels = _batch(cfg, 0)
    with torch.no_grad():
        ref_hidden = ref.layers["0"](ref.tok_embeddings(tokens), ref.rope_cos, ref.rope_sin)
    ref_loss = _loss(ref(tokens), labels)
    ref_loss.backward()
    with loss_context(True):
        hidden = first(tokens)
        # What a stage sends under sequence parallel: its local sequence shard.
        assert type(hidden) is torch.Tensor and hidden.shape == (BATCH, SEQ // TP, cfg.dim)
        shard = slice(rank * SEQ // TP, (rank + 1) * SEQ // TP)
        _close(hidden, ref_hidden[:, shard], "first stage's hidden states")
        loss = _loss(last(hidden), labels)
        loss.backward()
    _close(loss, ref_loss, "loss", atol=0)
    _check_grads(first, ref)
    _check_grads(last, ref)
    return tuple(hidden.shape)


def test_pipeline_stages_send_sequence_shards(run_ranks):
    # Each rank checks its hidden shard, loss and gradients against one process (asserting
    # inside); here: every rank sent its own sequence shard, not the whole sequence.
    shapes = run_ranks(_pipeline_stages, TP, timeout=90)
    assert shapes == [(BATCH, SEQ // TP, _cfg(n_kv_heads=2).dim)] * TP


def test_refuses_vocabulary_not_divisible_by_tp():
    cfg = _cfg(n_kv_heads=2)
    cfg.vocab_size = 255
    with torch.device("meta"):
        model = GPT(cfg)
    two_ranks = types.SimpleNamespace(size=lambda: 2)  # the check runs before the mesh is used
    with pytest.raises(AssertionError, match="vocab_size=255 divisible by tp=2"):
        apply_tensor_parallel(model, two_ranks)
