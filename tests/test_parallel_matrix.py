"""The equivalence matrix: every layout trains exactly like one process.

From the same weights and data, each layout's per-step loss and final weights match the
single-process run within 1e-5 relative in fp32, over 5 optimizer steps with 4 microbatches
of gradient accumulation (which the pipeline layouts use as their pipeline microbatches).
"""

from __future__ import annotations

import pytest
import torch

from optimus.config import validate_job
from optimus.train import train

STEPS = 5


def base_job(**parallel) -> dict:
    n_layers = parallel.pop("n_layers", 4)
    return {"name": "matrix",
            "model": {"vocab_size": 256, "dim": 64, "n_layers": n_layers, "n_heads": 4,
                      "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 32},
            "optim": {"steps": STEPS, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2},
            "data": {"seq_len": 32, "batch_size": 8, "microbatches": 4},
            "parallel": {"device": "cpu", **parallel}}


def _train(rank: int, world_size: int, raw: dict) -> dict:
    result = train(validate_job(raw, world=world_size), keep_state=True, quiet=True)
    return {"losses": result.losses, "state": result.state,
            "grad_norms": [m.grad_norm for m in result.metrics]}


LAYOUTS = {
    "TP2": (2, {"tp": 2}),
    "PP2-1f1b": (2, {"pp": 2, "schedule": "1f1b"}),
    "PP2v2-interleaved": (2, {"pp": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"}),
    "DP2": (2, {}),
    "TP2xPP2": (4, {"tp": 2, "pp": 2}),
    "TP2xDP2": (4, {"tp": 2, "dp": 2}),
    "PP2xDP2": (4, {"pp": 2, "dp": 2}),
    "TP2xPP2xDP2": (8, {"tp": 2, "pp": 2, "dp": 2}),
    "PP3-7-layers": (3, {"pp": 3, "n_layers": 7}),
}

_reference: dict[int, dict] = {}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||: the tensor's error relative to its size.

    Element by element would be the wrong yardstick after Adam: it divides each update by
    that element's own gradient scale, so a weight whose gradient is ~1e-9 (rounding noise)
    can move by ~lr either way while the tensor as a whole agrees to 1e-7.
    """
    return float((actual - expected).norm() / expected.norm())


def reference(run_ranks, n_layers: int) -> dict:
    if n_layers not in _reference:
        (_reference[n_layers],) = run_ranks(_train, 1, base_job(n_layers=n_layers), timeout=120)
    return _reference[n_layers]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(run_ranks, name):
    world, parallel = LAYOUTS[name]
    raw = base_job(**parallel)
    one = reference(run_ranks, raw["model"]["n_layers"])
    ranks = run_ranks(_train, world, raw, timeout=240)
    merged: dict[str, torch.Tensor] = {}
    for result in ranks:
        assert len(result["losses"]) == STEPS
        assert result["losses"] == pytest.approx(one["losses"], rel=1e-5)
        assert result["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
        merged.update(result["state"])
    assert merged.keys() == one["state"].keys()
    for key, value in one["state"].items():
        assert relative_error(merged[key], value) <= 1e-5, key
    assert one["losses"][-1] < one["losses"][0]  # it trained, so agreeing is not trivial


def test_activation_checkpointing_changes_nothing_but_memory(run_ranks):
    one = reference(run_ranks, 4)
    for mode in ("full", "selective"):
        raw = base_job(activation_checkpoint=mode)
        (result,) = run_ranks(_train, 1, raw, timeout=120)
        assert result["losses"] == pytest.approx(one["losses"], rel=1e-6)
        for key, value in one["state"].items():
            assert relative_error(result["state"][key], value) <= 1e-6, key
