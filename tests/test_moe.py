"""The mixture-of-experts layer: routing, dispatch and combine, capacity, balancing, and MoE
models training like one process under data, pipeline, tensor and expert parallelism.

Tests marked `expert_parallel` exercise expert parallelism (`pytest -m expert_parallel` runs
only them).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_parallel_matrix import relative_error

from optimus.config import ConfigError, check_job, validate_job
from optimus.models import build_model, param_count
from optimus.models.moe import MoE, grouped_mm, moe_pass, padded_grouped_mm
from optimus.train import train


def moe_job(**moe) -> dict:
    return {"name": "moe",
            "model": {"vocab_size": 256, "dim": 64, "n_layers": 4, "n_heads": 4,
                      "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 32,
                      "moe": {"experts": 4, "top_k": 2, "expert_ffn_dim": 32,
                              "shared_experts": 1, "dense_layers": 1, **moe}},
            "optim": {"steps": 5, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2},
            "data": {"seq_len": 32, "batch_size": 8, "microbatches": 4},
            "parallel": {"device": "cpu"}}


def layer(**moe) -> MoE:
    model = build_model(validate_job(moe_job(**moe)).model, seed=7)
    return model.layers["1"].feed_forward


def naive(m: MoE, tokens: torch.Tensor, keep=None) -> torch.Tensor:
    """Token by token: the weighted sum of its k experts (those `keep` allows), + shared."""
    _, chosen, weights = m.route(tokens)
    out = torch.zeros_like(tokens)
    w = m.experts
    for t in range(tokens.shape[0]):
        for j in range(m.top_k):
            e = int(chosen[t, j])
            if keep is not None and not keep(t, e):
                continue
            x = tokens[t]
            h = torch.nn.functional.silu(x @ w.w1[e]) * (x @ w.w3[e])
            out[t] += weights[t, j] * (h @ w.w2[e])
    return out + (m.shared(tokens) if m.shared is not None else 0)


def test_dropless_every_token_reaches_exactly_k_experts_and_comes_back():
    m = layer()
    tokens = torch.randn(40, 64)
    out = m(tokens.view(2, 20, 64)).view(40, 64)  # a training pass: its load is counted
    with torch.no_grad():
        assert torch.allclose(out, naive(m, tokens), atol=1e-5)
    assert m.load.sum() == 40 * 2 and m.dropped == 0  # k slots per token, none dropped
    _, chosen, _ = m.route(tokens)
    assert m.load.tolist() == torch.bincount(chosen.flatten(), minlength=4).float().tolist()


def test_a_capacity_factor_drops_the_slots_past_an_experts_capacity_and_counts_them():
    m = layer(capacity_factor=0.5)
    tokens = torch.randn(40, 64)
    _, chosen, _ = m.route(tokens)
    capacity = math.ceil(0.5 * 40 * 2 / 4)  # 10 slots per expert
    seen = torch.zeros(4, dtype=torch.long)
    kept = set()
    for t in range(40):  # the first slots in token order are kept
        for j in range(2):
            e = int(chosen[t, j])
            if seen[e] < capacity:
                kept.add((t, e))
            seen[e] += 1
    out = m(tokens.view(1, 40, 64)).view(40, 64)
    with torch.no_grad():
        assert torch.allclose(out, naive(m, tokens, keep=lambda t, e: (t, e) in kept),
                              atol=1e-5)
    assert int(m.dropped) == 80 - len(kept) > 0


def test_padded_grouped_mm_equals_one_matmul_per_expert_with_gradients():
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 6, requires_grad=True)
    w = torch.randn(4, 6, 5, requires_grad=True)
    out = grouped_mm(x, w, counts)  # on CPU: the padded batched matmul
    starts = [0, 3, 3, 8]
    ref = torch.cat([x[s:s + c] @ w[e] for e, (s, c) in enumerate(zip(starts, counts.tolist(),
                                                                       strict=True))])
    assert torch.allclose(out, ref, atol=1e-6)
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    assert torch.allclose(gx, rx, atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)
    assert padded_grouped_mm(x[:0], w, torch.zeros(4, dtype=torch.long)).shape == (0, 5)


def test_the_aux_loss_pulls_on_the_router_only_when_balancing_by_loss():
    tokens = torch.randn(2, 16, 64)
    grads = {}
    for balance in ("aux_loss", "none"):
        m = layer(balance=balance, aux_loss_coeff=0.5)
        m.step_tokens = 32
        (m(tokens) * 0).sum().backward()  # nothing but the auxiliary loss
        grads[balance] = m.router.weight.grad
    assert grads["none"].abs().max() == 0
    assert grads["aux_loss"].abs().max() > 0
    for scope in ("global", "sequence"):
        balanced = layer(aux_loss_scope=scope)  # a fresh layer: nothing counted yet
        balanced.step_tokens = 8
        scores = torch.full((8, 4), 0.25)  # perfectly balanced: the loss is 1
        chosen = torch.tensor([[0, 1], [2, 3]] * 4).view(1, 8, 2)
        assert float(balanced.balance_loss(scores, chosen)) == pytest.approx(1.0)
        skewed = layer(aux_loss_scope=scope)
        skewed.step_tokens = 8
        assert float(skewed.balance_loss(torch.tensor([[0.5, 0.5, 0, 0]] * 8),
                                         torch.tensor([[0, 1]] * 8).view(1, 8, 2))) == 2.0


def naive_aux(scores: torch.Tensor, chosen: torch.Tensor, experts: int = 4) -> torch.Tensor:
    """experts x sum(fraction of slots x mean probability) over exactly these tokens."""
    fraction = torch.bincount(chosen.flatten(), minlength=experts) / chosen.numel()
    return experts * (fraction * scores.detach().mean(0)).sum()


def test_global_scope_uses_the_counts_of_the_steps_microbatches_so_far():
    m = layer(aux_loss_scope="global")
    m.step_tokens = 32  # two microbatches of 2 x 8 tokens
    x1, x2 = torch.randn(16, 64), torch.randn(16, 64)
    (s1, c1, _), (s2, c2, _) = m.route(x1), m.route(x2)
    first = m.balance_loss(s1, c1.view(2, 8, 2)).detach()
    second = m.balance_loss(s2, c2.view(2, 8, 2)).detach()
    both = torch.bincount(torch.cat([c1, c2]).flatten(), minlength=4) / (32 * 2)
    # Microbatch 1 sees its own counts; microbatch 2 the counts of both.
    assert float(first) == pytest.approx(float(naive_aux(s1, c1) * 16 / 32), rel=1e-6)
    want = 4 * (both * s2.detach().sum(0)).sum() / 32
    assert float(second) == pytest.approx(float(want), rel=1e-6)
    assert m.batch_slots.tolist() == (both * 64).tolist() and float(m.batch_tokens) == 32
    m.reset_counters()  # the trainer, after the step
    assert m.batch_slots.abs().sum() == 0 and float(m.batch_tokens) == 0


def test_sequence_scope_balances_each_sequence_on_its_own():
    m = layer(aux_loss_scope="sequence")
    m.step_tokens = 24  # three sequences of 8 positions
    tokens = torch.randn(24, 64, generator=torch.Generator().manual_seed(5))
    tokens[:8] = tokens[0]  # the first sequence sends all its tokens to the same two experts
    scores, chosen, _ = m.route(tokens)
    got = m.balance_loss(scores, chosen.view(3, 8, 2)).detach()
    want = sum(naive_aux(scores[i * 8:(i + 1) * 8], chosen[i * 8:(i + 1) * 8])
               for i in range(3)) / 3  # the sequences' mean, each 8 of 24 tokens
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert float(got) > float(naive_aux(scores, chosen)) + 0.02  # the skewed sequence shows


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_recompute_counts_each_forward_once(mode):
    """A recomputed block replays its first forward: the load, the dropped slots and the
    auxiliary loss are counted once, and the gradients are those without recompute."""
    from optimus.parallel.activation_checkpoint import apply_activation_checkpointing

    cfg = validate_job(moe_job(capacity_factor=0.75)).model  # drops some slots
    models = [build_model(cfg, seed=3), build_model(cfg, seed=3)]
    wrapped = apply_activation_checkpointing(models[1], mode, every=2)
    assert wrapped == (4 if mode == "full" else 2)  # selective: layers 0 and 2 (an MoE one)
    batch = torch.randint(0, 256, (2, 4, 17), generator=torch.Generator().manual_seed(0))
    for model in models:
        model.train()
        for mb in batch:  # two microbatches, as gradient accumulation runs them
            for moe in model.modules():
                if isinstance(moe, MoE):
                    moe.step_tokens = 2 * 4 * 16
            logits = model(mb[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb[:, 1:].flatten(),
                                                     reduction="sum") / (2 * 4 * 16)
            loss.backward()
    plain, recomputed = ([m for m in model.modules() if isinstance(m, MoE)] for model in models)
    for a, b in zip(plain, recomputed, strict=True):
        assert a.load.sum() == 2 * 4 * 16 * 2  # each token's two slots, once
        assert torch.equal(a.load, b.load) and torch.equal(a.dropped, b.dropped)
        assert float(a.dropped) > 0
        assert float(b.aux_total) == pytest.approx(float(a.aux_total), rel=1e-6)
        assert torch.equal(a.batch_slots, b.batch_slots)
    grads = dict(models[0].named_parameters())
    for name, p in models[1].named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        assert torch.allclose(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7), name
    # A pipeline's shape-inference pass (dry) counts nothing, in a recomputed block or not.
    before = [(m.load.clone(), m.batch_slots.clone()) for m in recomputed]
    with moe_pass("dry"):
        models[1](batch[0, :, :-1])
    for m, (load, slots) in zip(recomputed, before, strict=True):
        assert torch.equal(m.load, load) and torch.equal(m.batch_slots, slots)


def test_moe_runs_forward_and_backward_under_bf16_autocast():
    """The accelerators' path, on CPU: experts in bf16, their weighted sum in float32."""
    m = layer()
    m.step_tokens = 32
    # Seeded: with unlucky inputs a token's two best experts score within bf16's rounding of
    # each other, bf16 routes it elsewhere, and its output differs by far more than rounding.
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    reference = m(x)
    (reference.float() ** 2).sum().backward()
    want = m.router.weight.grad.clone()
    m.zero_grad()
    m.reset_counters()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
        (out.float() ** 2).sum().backward()
    assert out.dtype == torch.bfloat16 and reference.dtype == torch.float32
    # bf16 keeps 8 bits of mantissa: ~0.4% per rounding, a few roundings deep.
    assert relative_error(out.float(), reference) < 2e-2
    assert relative_error(m.router.weight.grad, want) < 5e-2
    assert not torch.equal(out.float(), reference)  # it did compute in bf16


def test_sigmoid_scores_and_the_bias_choose_but_do_not_weigh():
    m = layer(score="sigmoid", balance="bias")
    tokens = torch.randn(10, 64)
    with torch.no_grad():
        m.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))
        scores, chosen, weights = m.route(tokens)
    assert (chosen == 3).any(-1).all()  # the bias made expert 3 everybody's choice
    assert torch.allclose(weights.sum(-1), torch.ones(10))  # renormalised over the top k
    assert torch.allclose(weights, scores.gather(-1, chosen) / scores.gather(
        -1, chosen).sum(-1, keepdim=True))


def test_moe_configs_are_checked_and_counted():
    cfg = validate_job(moe_job()).model
    model = build_model(cfg, seed=1)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert [type(b.feed_forward).__name__ for b in model.layers.values()] == [
        "FeedForward", "MoE", "MoE", "MoE"]
    # Active: top_k of 4 experts: 2 x 3 x 64 x 32 fewer weights per MoE layer.
    assert param_count(cfg) - param_count(cfg, active=True) == 3 * 2 * 3 * 64 * 32
    with pytest.raises(ConfigError, match="top_k"):
        check_job(validate_job(moe_job(top_k=5)))
    with pytest.raises(ConfigError, match="ep=2 needs experts"):
        check_job(validate_job({**moe_job(), "model": {**moe_job()["model"], "moe": {}},
                                "parallel": {"ep": 2}}))


def _train(rank: int, world_size: int, raw: dict) -> dict:
    result = train(validate_job(raw, world=world_size), keep_state=True, quiet=True)
    return {"losses": result.losses, "state": result.state,
            "moe": [m.moe for m in result.metrics]}


_reference: dict[tuple, dict] = {}
BATCH, MICROBATCHES = 16, 2  # every layout: 2 global microbatches of 8 sequences


def matrix_job(balance: str, scope: str = "global", stable: bool = False) -> dict:
    """With `stable`: QK-norm, the z-loss and the router z-loss (coefficients large enough
    that their gradients move the weights well past the tolerance)."""
    raw = moe_job(balance=balance, bias_update_rate=0.01, aux_loss_scope=scope,
                  router_z_loss=1e-2 if stable else 0.0)
    raw["data"].update(batch_size=BATCH, microbatches=MICROBATCHES)
    raw["model"]["qk_norm"] = stable
    raw["optim"]["z_loss"] = 1e-2 if stable else 0.0
    return raw


def one_process(run_ranks, balance: str, scope: str = "global", stable: bool = False) -> dict:
    """The single-process run: the same global batch in the same two microbatches."""
    if (balance, scope, stable) not in _reference:
        (_reference[balance, scope, stable],) = run_ranks(
            _train, 1, matrix_job(balance, scope, stable), timeout=120)
    return _reference[balance, scope, stable]


# name: (world, parallel, balancing, aux-loss scope). Each rank's microbatch holds 8 / dp
# sequences: several on most layouts, one under EP4 (dp 8). Layouts named `stable` also train
# with QK-norm, the z-loss and the router z-loss (`matrix_job`).
LAYOUTS = {
    "DP2": (2, {}, "aux_loss", "global"),
    "PP2": (2, {"pp": 2, "schedule": "1f1b"}, "aux_loss", "global"),
    "EP2-bias": (2, {"ep": 2}, "bias", "global"),
    "EP2xDP2": (4, {"ep": 2}, "aux_loss", "global"),
    "EP2xDP2-sequence": (4, {"ep": 2}, "aux_loss", "sequence"),
    "EP2xPP2-stable": (4, {"ep": 2, "pp": 2, "schedule": "1f1b"}, "aux_loss", "global"),
    "EP4": (8, {"ep": 4}, "aux_loss", "global"),
    "TP2xEP2-stable": (4, {"tp": 2, "ep": 2}, "aux_loss", "global"),
    "TP2-sequence": (2, {"tp": 2}, "aux_loss", "sequence"),
    "TP2xEP2-recompute": (4, {"tp": 2, "ep": 2, "activation_checkpoint": "full"}, "aux_loss",
                          "global"),
    "PP2-selective-recompute": (2, {"pp": 2, "activation_checkpoint": "selective"}, "aux_loss",
                                "sequence"),
    "TP2": (2, {"tp": 2}, "bias", "global"),
    # Context parallel: each rank routes its slice of every sequence; experts borrow the cp
    # ranks (ep 2 on cp 2); the sequence-scoped counts sum over the cp ranks' slices.
    "CP2xEP2": (2, {"cp": 2, "ep": 2}, "aux_loss", "global"),
    "CP2-ring-sequence": (2, {"cp": 2, "cp_method": "ring"}, "aux_loss", "sequence"),
    "EP2xHSDP2": (4, {"ep": 2, "replicas": 2}, "aux_loss", "global"),  # ep inside 2 replicas
}
EP = pytest.mark.expert_parallel


@pytest.mark.parametrize("name", [pytest.param(n, marks=EP) if "ep" in LAYOUTS[n][1] else n
                                  for n in LAYOUTS])
def test_moe_layouts_train_like_one_process(run_ranks, name):
    world, parallel, balance, scope = LAYOUTS[name]
    stable = name.endswith("-stable")
    one = one_process(run_ranks, balance, scope, stable)
    raw = matrix_job(balance, scope, stable)
    raw["parallel"].update(parallel)
    ranks = run_ranks(_train, world, raw, timeout=240)
    merged: dict[str, torch.Tensor] = {}
    for result in ranks:
        assert result["losses"] == pytest.approx(one["losses"], rel=1e-5)
        merged.update(result["state"])
        # Every rank saw the whole model's load, summed over replicas, stages and sequence
        # shards; from the first step (a pipeline's metadata inference is not counted).
        for got, want in zip(result["moe"], one["moe"], strict=True):
            assert (got["load"], got["dropped"]) == (want["load"], want["dropped"])
            assert got["aux_loss"] == pytest.approx(want["aux_loss"], rel=1e-5)
            assert got.keys() == want.keys()  # router_z_loss when there is one
            # What crossed between ranks: the same sum on every rank, none without EP.
            assert (got["alltoall_bytes"] > 0) == ("ep" in parallel)
            if "router_z_loss" in want:
                assert got["router_z_loss"] == pytest.approx(want["router_z_loss"], rel=1e-5)
    assert len({tuple(m["alltoall_bytes"] for m in r["moe"]) for r in ranks}) == 1
    assert sum(one["moe"][0]["load"][0]) == BATCH * 32 * 2  # every token of the step, twice
    assert merged.keys() == one["state"].keys()
    for key, value in one["state"].items():
        if value.norm() == 0:  # an expert bias that never moves (balanced by the loss)
            assert torch.equal(merged[key], value), key
        else:
            assert relative_error(merged[key], value) <= 1e-5, key
    if balance == "bias":  # the bias moved, the same on every replica
        assert one["state"]["layers.1.feed_forward.expert_bias"].abs().sum() > 0
    else:
        assert one["moe"][-1]["aux_loss"] >= 1.0  # 1 when perfectly balanced
    if stable:  # at first the router's logits are near 0: log Z near log 4; then it falls
        first, last = (one["moe"][i]["router_z_loss"] for i in (0, -1))
        assert first == pytest.approx(math.log(4) ** 2, rel=0.05) and last < first
    else:
        assert "router_z_loss" not in one["moe"][-1]


def _ep_model(world_size: int, ep: int):
    """An EP model, its optimizer and mesh, built as the trainer builds them."""
    from optimus.config import resolve_layout
    from optimus.optim import build_optimizer
    from optimus.parallel.plan import build_parallel_model

    raw = {**moe_job(), "parallel": {"device": "cpu", "ep": ep}}
    raw["data"]["microbatches"] = 1
    job = validate_job(raw, world=world_size)
    mesh = resolve_layout(job, world_size).build_mesh("cpu")
    model = build_parallel_model(job, mesh, torch.device("cpu"))
    return job, model, build_optimizer(model.state_view(), job.optim, torch.device("cpu")), mesh


def _steps(job, model, optimizer, mesh, seed: int):
    """Training steps on random tokens, forever (one per `next`)."""
    from optimus.parallel.experts import expert_step

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(seed)
    dp = mesh.size("batch")
    while True:
        batch = torch.randint(0, 256, (4, 33), generator=g)
        model.set_step_tokens(dp * 4 * 32)
        model.forward_backward([{"input_ids": batch[:, :-1], "labels": batch[:, 1:]}], cpu)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        expert_step(model.moe, job.model, mesh, cpu)
        yield


def _ep_steps(rank: int, world_size: int, steps: int) -> dict:
    """`steps` training steps of an EP2 model: live tensors and peak memory as they go."""
    import gc
    import resource

    job, model, optimizer, mesh = _ep_model(world_size, ep=2)
    run = _steps(job, model, optimizer, mesh, seed=rank)
    tensors, peak = [], []
    for step in range(1, steps + 1):
        next(run)
        if step % 10 == 0:  # live tensors and peak memory every 10 steps
            gc.collect()
            tensors.append(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))
            peak.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return {"tensors": tensors, "peak_kib": peak}


def _optimizer_shares(rank: int, world_size: int) -> list[tuple]:
    """Per parameter: its global size, this rank's optimizer-state elements, its mesh."""
    from torch.distributed.tensor import DTensor

    job, model, optimizer, mesh = _ep_model(world_size, ep=2)
    next(_steps(job, model, optimizer, mesh, seed=rank))
    out = []
    for name, p in model.state_view().named_parameters():
        state = optimizer.state[p]
        local = sum((t.to_local() if isinstance(t, DTensor) else t).numel()
                    for key, t in state.items() if key != "step")
        out.append((name, p.numel(), local, p.shape[0] if p.dim() else 1,
                    p.device_mesh.mesh_dim_names))
    return out


@EP
def test_the_optimizer_state_is_sharded_over_dp_and_experts_over_edp(run_ranks):
    """EP2 x EDP2: dense state over the 4 dp ranks; each expert's over its 2 edp replicas, of
    the experts its ep rank holds. Each rank holds its share to within one block (a row of
    dim 0, which FSDP splits unevenly when it does not divide)."""
    ranks = run_ranks(_optimizer_shares, 4, timeout=180)
    total_state = 0
    for params in zip(*ranks, strict=True):
        name, numel, _, rows, mesh = params[0]
        expert = ".experts." in name
        # ep is the mesh's epd here (experts borrow no context-parallel ranks)
        assert mesh == (("edp", "epd") if expert else ("dp",)), name
        group = 2 * 2 if expert else 4  # ep x edp, or dp: a quarter of the state either way
        block = 2 * numel // rows  # exp_avg and exp_avg_sq of one row
        for _, _, local, _, _ in params:
            assert abs(local - 2 * numel / group) <= block, (name, local, 2 * numel / group)
        assert sum(p[2] for p in params) == 2 * numel  # every element exactly once
        total_state += 2 * numel
    assert sum(p[2] for p in ranks[0]) <= total_state / 4 * 1.05




def _starved_rank(rank: int, world_size: int) -> list[float]:
    """EP2 with every token routed to ep rank 0's experts (a bias that outweighs any score):
    rank 1 receives no tokens at all. Each rank's expert-gradient norm after one backward."""
    job, model, optimizer, mesh = _ep_model(world_size, ep=2)
    for moe in model.moe:
        moe.balance = "bias"
        moe.expert_bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))  # experts 0, 1: rank 0
    batch = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(rank))
    norms = []
    for _ in range(2):  # a second step: the starved rank stays in step
        model.set_step_tokens(2 * 4 * 32)
        model.forward_backward([{"input_ids": batch[:, :-1], "labels": batch[:, 1:]}],
                               torch.device("cpu"))
        norms = [sum(float(p.grad.to_local().norm()) for p in moe.experts.parameters())
                 for moe in model.moe]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


@EP
def test_a_rank_whose_experts_receive_no_tokens_still_joins_the_backward_exchange(run_ranks):
    """Regression: an expert computation on zero rows used to fall out of the autograd graph,
    so that rank skipped the backward all-to-all its peers waited in (a deadlock)."""
    busy, starved = run_ranks(_starved_rank, 2, timeout=60)
    assert all(norm > 0 for norm in busy)  # rank 0's experts learned from every token
    assert starved == [0.0] * len(starved)  # rank 1's got zero gradients, not none


@EP
def test_expert_parallel_dispatch_keeps_no_memory_across_steps(run_ranks):
    for result in run_ranks(_ep_steps, 2, 50, timeout=240):
        assert len(set(result["tensors"])) == 1, result["tensors"]  # nothing accumulates
        grown = result["peak_kib"][-1] - result["peak_kib"][0]
        assert grown < 16 * 1024, f"peak memory grew {grown} KiB from step 10 to 50"


@EP
def test_an_ep2xdp2_checkpoint_resumes_at_ep4_and_on_one_rank(run_ranks, tmp_path):
    import shutil

    from test_checkpoint_resume import _keep_only, _per_step_samples
    from test_checkpoint_resume import _train as train_keeping_samples
    from test_checkpoint_resume import job as checkpointed_job

    from optimus.checkpoint import committed_steps

    moe = {"experts": 4, "top_k": 2, "expert_ffn_dim": 32, "balance": "bias",
           "bias_update_rate": 0.01}
    saved = tmp_path / "saved"
    raw = checkpointed_job(saved, model={"moe": moe}, parallel={"ep": 2},
                           data={"microbatches": 1})
    original = run_ranks(train_keeping_samples, 4, raw, timeout=240)  # EP2 x EDP2
    _keep_only(saved / "checkpoints", 4)
    reference = _per_step_samples(original)
    for name, world, parallel in (("ep4", 8, {"ep": 4}), ("one-rank", 1, {})):
        run_dir = tmp_path / name
        shutil.copytree(saved / "checkpoints", run_dir / "checkpoints")
        shutil.copytree(saved / "secrets", run_dir / "secrets")  # the run moves, with its key
        resumed = run_ranks(train_keeping_samples, world, checkpointed_job(
            run_dir, model={"moe": moe}, parallel=parallel, data={"microbatches": 1}),
            timeout=240)
        for result in resumed:
            assert result["steps"] == [5, 6, 7, 8]
            assert result["losses"] == pytest.approx(original[0]["losses"][4:], rel=1e-5)
        assert _per_step_samples(resumed) == reference[4:]  # the data goes on exactly
        assert committed_steps(run_dir / "checkpoints")[-1] == 8
