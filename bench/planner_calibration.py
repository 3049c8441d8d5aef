"""The planner against every run it is checked on (bench/planner_runs.py): predicted beside
published or measured, the error, and what each run was used for.

Calibration (one run per machine; machines.yaml and bench/planner_machines.yaml show it):
- H100 SXM and H200 (one die, one power limit): our own Mula-1B on one H200, the plain loop
  compiled (docs/gpu.md, median of three runs).
- torchtitan's Grand Teton H100s (500 W, HBM2e): its Llama 3.1 8B, FSDP on 8, eager.
- Max 1550: seed 000's 175B at 10% of the tile's peak (layout: jobs/gpt-175b.yaml's).
- A100: seed 001's 1T row (Table 1).
Every run is predicted with its stack's factor (optimus/planner/stacks.yaml, with sources);
the Optimus rows of our own runs are where Optimus's factor was measured. The model prices
neither float8 nor Megatron's overlap of tensor-parallel communication; the rows where that
matters say so.

    .venv/bin/python bench/planner_calibration.py [--markdown] [--calibrate]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_papers import SEED_001_TABLE_1, job_of, paper_layout  # noqa: E402
from planner_runs import LLAMA3_8B, RUNS, Run  # noqa: E402, F401  (LLAMA3_8B: tests)

from optimus.config import load_job, validate_job  # noqa: E402
from optimus.planner.machines import Machine, load_machines  # noqa: E402
from optimus.planner.memory import PlanLayout  # noqa: E402
from optimus.planner.steptime import StepTime, step_time  # noqa: E402
from optimus.runtime.dims import ParallelDims  # noqa: E402

EVIDENCE = Path(__file__).with_name("planner_machines.yaml")


@lru_cache(maxsize=1)
def machines() -> dict[str, Machine]:
    return load_machines(EVIDENCE)


@lru_cache(maxsize=64)
def _job_model(path: str):
    return load_job(path).model


def model_of(run: Run):
    if run.model == "seed001":
        size = run.layout["row"]
        _, heads, hidden, layers, *_ = next(r for r in SEED_001_TABLE_1 if r[0] == size)
        return job_of(heads, hidden, layers, run.batch).model
    if isinstance(run.model, str):
        return _job_model(run.model)
    return validate_job({"name": "run", "model": run.model,
                         "data": {"seq_len": run.seq, "batch_size": run.batch}}).model


def layout_of(run: Run, machine: Machine | None = None) -> PlanLayout:
    if "paper" in run.layout:  # seed 001's Table 1: the paper's layout, the best v for it
        tp, pp, gpus = run.layout["paper"]
        job = validate_job({"name": "seed001", "model": model_of(run).model_dump(),
                            "data": {"seq_len": run.seq, "batch_size": run.batch},
                            "training": {"compile": run.compiled}})
        lay = paper_layout(job, tp, pp, gpus, machine or machines()[run.machine])
        return replace(lay, compiled=run.compiled)
    fields = dict(run.layout)
    dims = ParallelDims(**{("virtual_stages" if k == "v" else k): fields.pop(k)
                           for k in ("dp", "tp", "pp", "ep", "cp", "v") if k in fields})
    fields.setdefault("microbatches",
                      run.batch // (dims.size("batch") * fields.get("microbatch_size", 1)))
    return PlanLayout(dims, seq_len=run.seq, precision="bf16", compiled=run.compiled, **fields)


def predict(run: Run, sustained: float | None = None) -> tuple[float, StepTime]:
    """(the run's predicted figure in its unit, the step's terms)."""
    machine = machines()[run.machine]
    if sustained is not None:
        machine = machine.model_copy(update={"sustained": sustained})
    t = step_time(model_of(run), layout_of(run, machine), machine, run.batch, run.stack)
    return (t.tokens_per_s_per_device if run.unit == "tokens/s" else t.tflops_per_device), t


def calibrated(run: Run) -> float:
    """The `sustained` that makes the model give the run's figure (bisection: the
    prediction rises with it)."""
    low, high = 0.02, 1.0
    for _ in range(40):
        mid = (low * high) ** 0.5
        if predict(run, mid)[0] < run.published:
            low = mid
        else:
            high = mid
    return (low * high) ** 0.5


def error(run: Run) -> float:
    return predict(run)[0] / run.published - 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--calibrate", action="store_true",
                        help="print the sustained each calibration run gives, and stop")
    args = parser.parse_args()
    if args.calibrate:
        for run in RUNS:
            if run.use == "calibrates":
                print(f"{run.machine}: sustained {calibrated(run):.4f} ({run.name})")
        return
    head = ("run", "source", "machine", "stack", "use", "published", "predicted", "error",
            "largest terms of the step")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for run in RUNS:
        got, t = predict(run)
        terms = sorted(((v / t.total, k) for k, v in t.terms().items() if v > 0),
                       reverse=True)
        use = {"calibrates": "calibration", "stack": "stack factor's source"}.get(run.use,
                                                                                 "check")
        mode = "compiled" if run.compiled else "eager"
        cells = (run.name + (f" ({run.note})" if run.note else ""), run.source, run.machine,
                 f"{run.stack}, {mode}", use, f"{run.published:,g} {run.unit}",
                 f"{got:,.0f}" if got >= 100 else f"{got:.1f}", f"{got / run.published - 1:+.1%}",
                 ", ".join(f"{k} {share:.0%}" for share, k in terms[:3]))
        print(("| " + " | ".join(cells) + " |") if args.markdown else "  ".join(cells))


if __name__ == "__main__":
    main()
