"""The planner's `sustained` factors, calibrated once per device on one published run, and how
the calibrated model lands on published runs that were not used for calibration.

Calibration (one run per device; machines.yaml shows the arithmetic):
- A100: seed 001's 1T row (Narayanan et al. 2021, Table 1; bench/planner_papers.py).
- H100: torchtitan's Llama 3.1 8B, FSDP on 8 GPUs, no torch.compile, no float8: 5,762
  tokens/s per GPU (torchtitan docs/performance.md, Table 1; H100 96 GB HBM2e at 500 W).
- Max 1550: seed 000 (Navilarekal Rajgopal and Solmsdorf, "A Scalable Recipe on SuperMUC-NG
  Phase 2", arXiv 2605.07726): 175B at 10% of the tile's bf16 peak, 29.8 TFLOP/s per tile.
  Its abstract does not give the layout; the one priced is jobs/gpt-175b.yaml's (tp 8 x pp 12,
  interleaved, full recompute: the Megatron-LM layout of that model) on 1536 tiles.

Checks: every other row of RUNS. torchtitan's float8 and torch.compile rows are left out: the
model prices neither.

    .venv/bin/python bench/planner_calibration.py [--markdown]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from optimus.config import load_job, validate_job
from optimus.planner.machines import get_machine
from optimus.planner.memory import PlanLayout
from optimus.planner.steptime import StepTime, step_time
from optimus.runtime.dims import ParallelDims

LLAMA3_8B = {"vocab_size": 128256, "dim": 4096, "n_layers": 32, "n_heads": 32,
             "n_kv_heads": 8, "ffn_dim": 14336, "max_seq_len": 8192}
LLAMA3_70B = {"vocab_size": 128256, "dim": 8192, "n_layers": 80, "n_heads": 64,
              "n_kv_heads": 8, "ffn_dim": 28672, "max_seq_len": 8192}
LLAMA2_13B = {"vocab_size": 32000, "dim": 5120, "n_layers": 40, "n_heads": 40,
              "n_kv_heads": 40, "ffn_dim": 13824, "max_seq_len": 4096}
LLAMA2_70B = {"vocab_size": 32000, "dim": 8192, "n_layers": 80, "n_heads": 64,
              "n_kv_heads": 8, "ffn_dim": 28672, "max_seq_len": 4096}
TITAN = "torchtitan docs/performance.md"
TITAN_A100 = "torchtitan docs/performance.md (2024, 64 A100 80GB)"


@dataclass(frozen=True)
class Run:
    """One published run: the model, the layout it ran, what it reached."""

    name: str
    source: str
    machine: str
    model: dict | str  # a model section, or a job file whose model it is
    seq: int
    batch: int  # sequences a step
    layout: dict = field(default_factory=dict)  # PlanLayout fields besides seq_len
    published: float = 0.0
    unit: str = "tokens/s"  # or "TFLOP/s": per device, recompute counted (seed 000, 001)
    calibrates: bool = False


def _fsdp(devices: int, local: int, recompute: str) -> dict:
    return {"dp": devices, "microbatch_size": local, "recompute": recompute}


RUNS = [
    Run("Llama 3.1 8B, FSDP 8, op recompute", TITAN + ", Table 1", "h100-ndr", LLAMA3_8B,
        8192, 16, _fsdp(8, 2, "op"), 5762, calibrates=True),
    Run("GPT 175B, tp 8 x pp 12 x dp 16", "seed 000 (arXiv 2605.07726)", "max1550-supermuc",
        "jobs/gpt-175b.yaml", 2048, 1536,
        {"dp": 16, "tp": 8, "pp": 12, "v": 2, "schedule": "interleaved_1f1b",
         "microbatches": 96, "recompute": "full"}, 29.8, "TFLOP/s", calibrates=True),
    Run("Llama 3.1 8B, FSDP 128, op recompute", TITAN + ", Table 3", "h100-ndr", LLAMA3_8B,
        8192, 256, _fsdp(128, 2, "op"), 5605),
    Run("Llama 3 8B, FSDP 64, op recompute", TITAN_A100, "a100-hdr", LLAMA3_8B, 8192, 64,
        _fsdp(64, 1, "op"), 2973),
    Run("Llama 3 8B, FSDP 64, selective (every 2nd block)", TITAN_A100, "a100-hdr", LLAMA3_8B,
        8192, 64, _fsdp(64, 1, "selective"), 2904),
    Run("Llama 3 70B, FSDP 64, full recompute", TITAN_A100, "a100-hdr", LLAMA3_70B, 8192, 64,
        _fsdp(64, 1, "full"), 331),
    Run("Llama 2 13B, FSDP 64, no recompute", TITAN_A100, "a100-hdr", LLAMA2_13B, 4096, 128,
        _fsdp(64, 2, "none"), 2162),
    Run("Llama 2 13B, FSDP 64, selective (every 2nd block)", TITAN_A100, "a100-hdr",
        LLAMA2_13B, 4096, 128, _fsdp(64, 2, "selective"), 1914),
    Run("Llama 2 13B, FSDP 64, op recompute", TITAN_A100, "a100-hdr", LLAMA2_13B, 4096, 128,
        _fsdp(64, 2, "op"), 1904),
    Run("Llama 2 70B, FSDP 64, op recompute", TITAN_A100, "a100-hdr", LLAMA2_70B, 4096, 64,
        _fsdp(64, 1, "op"), 355),
    Run("Llama 2 70B, FSDP 64, full recompute", TITAN_A100, "a100-hdr", LLAMA2_70B, 4096, 128,
        _fsdp(64, 2, "full"), 353),
    Run("GPT 175B, tp 8 x pp 12 x dp 16 (PTD)", "seed 001, Table 2", "a100-hdr",
        "jobs/gpt-175b.yaml", 2048, 1536,
        {"dp": 16, "tp": 8, "pp": 12, "v": 2, "schedule": "interleaved_1f1b",
         "microbatches": 96, "recompute": "full", "param_gather": "step"}, 141, "TFLOP/s"),
    *(Run(f"GPT 175B, ZeRO-3 on {n}, microbatch {size}", "seed 001, Table 2", "a100-hdr",
          "jobs/gpt-175b.yaml", 2048, 1536, _fsdp(n, size, "full"), published, "TFLOP/s")
      for n, size, published in ((384, 4, 144), (768, 2, 88), (1536, 1, 44))),
]


def layout_of(run: Run) -> PlanLayout:
    fields = dict(run.layout)
    dims = ParallelDims(**{("virtual_stages" if k == "v" else k): fields.pop(k)
                           for k in ("dp", "tp", "pp", "ep", "v") if k in fields})
    fields.setdefault("microbatches",
                      run.batch // (dims.size("batch") * fields.get("microbatch_size", 1)))
    return PlanLayout(dims, seq_len=run.seq, precision="bf16", **fields)


def model_of(run: Run):
    if isinstance(run.model, str):
        return load_job(run.model).model
    return validate_job({"name": "run", "model": run.model,
                         "data": {"seq_len": run.seq, "batch_size": run.batch}}).model


def predict(run: Run, sustained: float | None = None) -> tuple[float, StepTime]:
    """(the run's predicted figure in its unit, the step's terms)."""
    machine = get_machine(run.machine)
    if sustained is not None:
        machine = machine.model_copy(update={"sustained": sustained})
    t = step_time(model_of(run), layout_of(run), machine, run.batch)
    return (t.tokens_per_s_per_device if run.unit == "tokens/s" else t.tflops_per_device), t


def calibrated(run: Run) -> float:
    """The `sustained` that makes the model give the published figure. The compute term
    scales with 1 / sustained, the bubble with it, the rest not: solve published = work /
    (compute x s0 / s + the rest) for s, and again from there until it settles."""
    s = get_machine(run.machine).sustained
    for _ in range(20):
        got, t = predict(run, s)
        step = t.total * got / run.published  # the published step, in the model's seconds
        s = s * (t.compute + t.bubble) / (step - (t.total - t.compute - t.bubble))
    return s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    head = ("run", "source", "machine", "use", "published", "predicted", "error",
            "largest terms of the step")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for run in RUNS:
        got, t = predict(run)
        terms = sorted(((v / t.total, k) for k, v in t.terms().items() if v), reverse=True)
        use = (f"calibrates (sustained {calibrated(run):.3f})" if run.calibrates else "check")
        cells = (run.name, run.source, run.machine, use, f"{run.published:g} {run.unit}",
                 f"{got:,.0f}" if got >= 100 else f"{got:.1f}",
                 f"{got / run.published - 1:+.0%}",
                 ", ".join(f"{k} {share:.0%}" for share, k in terms[:3]))
        print(("| " + " | ".join(cells) + " |") if args.markdown else "  ".join(cells))


if __name__ == "__main__":
    main()
