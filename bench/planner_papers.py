"""The planner against seed 001 (Narayanan et al., SC'21, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM"), Table 1: GPT 1.7B to 1T on A100s.

For each row: the planner's predicted TFLOP/s per GPU on the paper's own layout (tp, pp, the
rest data parallel; microbatch size 1, 1F1B, full recompute, as the paper's runs used
activation recompute), beside the published figure; and the planner's own top 3 layouts
(its best tp x pp) and whether the paper's tp x pp is among them.

    .venv/bin/python bench/planner_papers.py [--markdown]
"""

from __future__ import annotations

import argparse
import time

from optimus.config import validate_job
from optimus.planner.machines import get_machine
from optimus.planner.memory import PlanLayout, shape_of
from optimus.planner.search import plan, worst_rank
from optimus.planner.steptime import step_time

# params (B), heads, hidden, layers, tp, pp, GPUs, batch, published TFLOP/s per GPU
SEED_001_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def job_of(heads: int, hidden: int, layers: int, batch: int):
    return validate_job({"name": "seed001", "model": {
        "vocab_size": 51200, "dim": hidden, "n_layers": layers, "n_heads": heads,
        "max_seq_len": 2048}, "data": {"seq_len": 2048, "batch_size": batch}})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    a100 = get_machine("a100-hdr")
    rows = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, published in SEED_001_TABLE_1:
        job = job_of(heads, hidden, layers, batch)
        dp = gpus // (tp * pp)
        theirs = PlanLayout(dp=dp, tp=tp, pp=pp, microbatches=batch // dp, microbatch_size=1,
                            seq_len=2048, recompute="full", schedule="1f1b")
        predicted = step_time(job.model, theirs, a100, batch).tflops_per_device
        fits_80 = worst_rank(shape_of(job.model), theirs).total / 2**30
        started = time.perf_counter()
        fits, _ = plan(job, gpus, a100, "bf16")
        took = time.perf_counter() - started
        top = fits[:3]
        shapes = [(c.layout.tp, c.layout.pp) for c in top]
        rows.append((size, f"{tp}x{pp}", published, predicted, predicted / published - 1,
                     fits_80, top[0].layout.label() if top else "-",
                     top[0].time.tflops_per_device if top else 0.0,
                     (tp, pp) in shapes, took))
    head = ("params B", "paper tp x pp", "paper TFLOP/s", "predicted on paper's layout",
            "error", "GiB/rank there", "planner's best", "its TFLOP/s", "paper's tp x pp in top 3",
            "plan s")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for r in rows:
        cells = (f"{r[0]:g}", r[1], f"{r[2]}", f"{r[3]:.0f}", f"{r[4]:+.0%}", f"{r[5]:.1f}",
                 r[6], f"{r[7]:.0f}", "yes" if r[8] else "no", f"{r[9]:.1f}")
        print(("| " + " | ".join(cells) + " |") if args.markdown else "  ".join(cells))


if __name__ == "__main__":
    main()
