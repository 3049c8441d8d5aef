"""The accelerators' precision path, run on CPU: bf16 autocast for forward and backward.

On CUDA and XPU the trainer computes in bf16 (`parallel.precision: auto`); CI has no GPU, so
`precision: bf16` runs the same path on CPU, where autocast and bf16 kernels exist too. Dense
and MoE models train under tensor, pipeline, expert and sharded data parallelism in it, and are
compared with the float32 single-process run.

The tolerances: bf16 keeps 8 significant bits, so every matmul output is rounded by up to
2^-9 (0.2%) relative. Those roundings are independent across the thousands of tokens a loss
averages, and parameters, gradients and optimizer state stay float32, so over 5 steps the loss
stays within ~1e-4 of float32 (measured: at most 6e-5 relative on every layout here); the bound
is 1e-3. Weights move by ~lr per step under Adam whatever their gradient's size, and an
element whose gradient is near zero can move either way on rounding alone, so weights are
compared against their movement from the initial values: bf16 moves them like float32 to
within 15% of that movement (measured: at most 7.3%, on a norm weight). A real defect is far
outside both: autocast's cast cache lost gradient under FSDP2 accumulation (device.py), which
gave a loss 0.5% off and weights 40-50% of their movement off.
"""

from __future__ import annotations

import pytest
import torch
from test_moe import moe_job
from test_parallel_matrix import base_job

from optimus.config import validate_job
from optimus.models import build_model
from optimus.train import train

# name: (world, model kind, parallel)
LAYOUTS = {
    "dense-TP2xDP2": (4, "dense", {"tp": 2}),  # tensor parallel + FSDP2 over dp
    "dense-PP2": (2, "dense", {"pp": 2, "schedule": "1f1b"}),
    "moe-EP2xDP2": (4, "moe", {"ep": 2}),  # experts over ep, FSDP2 over dp and edp
    "moe-TP2xPP2": (4, "moe", {"tp": 2, "pp": 2, "schedule": "1f1b"}),
}


def job(kind: str, precision: str, **parallel) -> dict:
    raw = base_job() if kind == "dense" else moe_job()
    raw["data"].update(batch_size=8, microbatches=2)
    raw["parallel"].update(**parallel)
    raw["training"] = {"mixed_precision": precision}
    return raw


def _train(rank: int, world_size: int, raw: dict) -> dict:
    result = train(validate_job(raw, world=world_size), keep_state=True, quiet=True)
    return {"losses": result.losses, "state": result.state}


_fp32: dict[str, dict] = {}


def fp32_one_process(run_ranks, kind: str) -> dict:
    if kind not in _fp32:
        (_fp32[kind],) = run_ranks(_train, 1, job(kind, "fp32"), timeout=120)
    return _fp32[kind]


def _initial(raw: dict) -> dict[str, torch.Tensor]:
    cfg = validate_job(raw).model
    return build_model(cfg, seed=raw.get("seed", 1234)).state_dict()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_train_in_bf16_like_fp32(run_ranks, name):
    world, kind, parallel = LAYOUTS[name]
    want = fp32_one_process(run_ranks, kind)
    raw = job(kind, "bf16", **parallel)
    ranks = run_ranks(_train, world, raw, timeout=240)
    start = _initial(raw)
    merged: dict[str, torch.Tensor] = {}
    for result in ranks:
        assert result["losses"] == pytest.approx(want["losses"], rel=1e-3)
        assert result["losses"] != want["losses"]  # it did compute in bf16
        merged.update(result["state"])
    assert want["losses"][-1] < want["losses"][0]
    for key, value in want["state"].items():
        moved = value - start[key]
        if moved.norm() == 0:  # a buffer that never moves
            continue
        assert merged[key].dtype == torch.float32, key  # float32 master weights
        error = float((merged[key] - value).norm() / moved.norm())
        assert error <= 0.15, (key, error)


def test_auto_precision_is_bf16_on_accelerators_and_fp32_on_cpu():
    from optimus.runtime import compute_dtype

    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert compute_dtype("auto", torch.device("xpu", 0)) == torch.bfloat16
    assert compute_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert compute_dtype("fp32", torch.device("cuda", 0)) == torch.float32
