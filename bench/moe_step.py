"""The job's training step on one GPU (bench/moe.py, `--device cuda`): tokens/s and MFU, with
the experts' grouped GEMMs in bf16 and in float8.

The job's model with its layers cut to `--layers` (the first `moe.dense_layers` stay dense, the
rest are MoE layers as in the job), trained by `optimus.train.train` as one rank (dp 1, ep 1)
on synthetic tokens: one sequence of the job's length a step, bf16 mixed precision, the job's
activation recompute. Timed as bench/mfu.py times it (bench/mfu_window.py: marks at each
step's start, the first steps dropped, the window's mean step). MFU: `flops_per_token` (the
active experts' weights, attention) times tokens/s over the device's bf16 peak
(optimus/runtime/peaks.py).

Float8: a second run with `training.float8_experts: rowwise` (torchao's float8 grouped GEMMs,
optimus/parallel/float8_experts.py), where this Optimus has it and the device can run it (else
one line says why); the figure is its tokens/s over bf16's.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch
import yaml

from bench.mfu_window import StepWindow, optimus_step_starts
from optimus.config import validate_job
from optimus.metrics import logs_step
from optimus.models import flops_per_token
from optimus.runtime import device_name
from optimus.runtime.peaks import peak_flops

LOG_EVERY = 3


def step_job(path: Path, layers: int, steps: int, device: torch.device, float8: str,
             run_dir: str) -> dict:
    raw = yaml.safe_load(path.read_text())
    p = raw.get("parallel", {})
    return {
        "name": "bench-moe-step", "run_dir": run_dir, "seed": 1234,
        "model": {**raw["model"], "n_layers": layers},
        "optim": {"steps": steps, "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 2},
        "data": {"source": "synthetic", "seq_len": raw["data"]["seq_len"], "batch_size": 1,
                 "microbatches": 1, "num_workers": 2},
        "parallel": {"device": device.type, "dp": 1, "ep": 1,
                     "activation_checkpoint": p.get("activation_checkpoint", "none"),
                     **({"ac_every": p["ac_every"]} if "ac_every" in p else {})},
        "training": {"mixed_precision": "bf16",
                     **({"float8_experts": float8} if float8 != "off" else {})},
        "checkpoint": {"interval": 0}, "supervision": {"log_every": LOG_EVERY},
    }


def tokens_per_s(path: Path, layers: int, steps: int, warmup: int, device: torch.device,
                 float8: str = "off") -> tuple[float, object]:
    """(tokens/s, the job) of one run of `optimus.train.train`."""
    from optimus.train import train

    with tempfile.TemporaryDirectory(prefix="bench-moe-step-") as tmp:
        job = validate_job(step_job(path, layers, steps, device, float8, tmp), world=1)
        window = StepWindow(device, steps, warmup,
                            logged=lambda step: logs_step(step, LOG_EVERY, steps))
        with window, optimus_step_starts(window.step_start):
            train(job, quiet=True)
    step = statistics.fmean(window.figures()["step_times_s"])
    return job.data.seq_len * job.data.batch_size / step, job


def float8_problem(device: torch.device) -> str | None:
    """Why the rowwise float8 experts cannot run here, or None."""
    try:
        from optimus.parallel.float8_experts import float8_experts_problem
    except ImportError as e:
        return f"this Optimus has no optimus.parallel.float8_experts ({e})"
    return float8_experts_problem("rowwise", device)


def training_step(path: Path, layers: int, steps: int, warmup: int,
                  device: torch.device) -> list[str]:
    """The lines bench/moe.py prints: bf16 tokens/s and MFU, float8 experts against bf16."""
    rate, job = tokens_per_s(path, layers, steps, warmup, device)
    cfg = job.model
    flops = flops_per_token(cfg, job.data.seq_len)
    peak = peak_flops(device_name(device), None, "bf16")
    mfu = f"MFU {flops * rate / peak:.1%}" if peak else "MFU n/a (no peak for this device)"
    lines = [f"{cfg.n_layers} layers ({cfg.moe.dense_layers} dense), {job.data.seq_len:,} tokens "
             f"a step, bf16: {rate:,.0f} tokens/s, {flops * rate / 1e12:.1f} TFLOP/s, {mfu} "
             f"({flops / 1e9:.2f} GFLOP/token)"]
    why = float8_problem(device)
    if why:
        lines.append(f"float8 experts (rowwise): n/a ({why})")
        return lines
    try:
        rate8, _ = tokens_per_s(path, layers, steps, warmup, device, "rowwise")
    except Exception as e:  # noqa: BLE001 (the bf16 figure stands; say why float8 did not)
        lines.append(f"float8 experts (rowwise): FAILED: {type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}")
        return lines
    lines.append(f"float8 experts (rowwise): {rate8:,.0f} tokens/s: {rate8 / rate:.2f}x bf16")
    return lines
