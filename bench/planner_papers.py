"""The planner against seed 001 (Narayanan et al., SC'21, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473), Table 1: GPT 1.7B to 1T on
A100s.

The table below was checked against a text transcription of the paper (its section 5.1 and
Table 1; docs/planner.md says where). Section 5.1 also says how the rows ran: the interleaved
pipeline schedule with the scatter/gather optimisation, microbatch size 1 (section 5.4), full
activation recompute (its FLOP count, equation 3, includes the recomputed forward), and plain
data parallelism: replicated parameters, one gradient all-reduce a step, which moves the
bytes of Optimus's `param_gather: step` (one all-gather and one reduce-scatter a step).

For each row: the planner's predicted TFLOP/s per GPU on the paper's layout (tp, pp, the rest
data parallel, as above; Table 1 does not give the interleaving depth v, so the best v the
planner finds for that tp x pp), beside the published figure; and the planner's own top 3
layouts, and whether the paper's tp x pp is among them.

Then the job files (`--jobs`): seed 000's 175B (run on SuperMUC-NG Phase 2's Max 1550 tiles;
here jobs/gpt-175b.yaml on Aurora's profile, on as many tiles as its own layout has) and the
Mula models on 64 Aurora nodes (768 tiles): the planner's prediction for the job file's own
layout beside its best layout.

    .venv/bin/python bench/planner_papers.py [--markdown] [--terms] [--jobs]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from optimus.config import load_job, resolve_layout, validate_job
from optimus.config.schedule_rules import schedule_problem
from optimus.planner.fit import job_layout
from optimus.planner.machines import get_machine
from optimus.planner.memory import PlanLayout, shape_of
from optimus.planner.search import plan, worst_rank
from optimus.planner.steptime import step_time
from optimus.runtime.dims import ParallelDims

PAPER = "megatron-lm-2021"  # the stack the paper's figures were reached with (stacks.yaml)
# params (B), heads, hidden, layers, tp, pp, GPUs, batch, published TFLOP/s per GPU, % of peak
SEED_001_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
]


def job_of(heads: int, hidden: int, layers: int, batch: int):
    return validate_job({"name": "seed001", "model": {
        "vocab_size": 51200, "dim": hidden, "n_layers": layers, "n_heads": heads,
        "max_seq_len": 2048}, "data": {"seq_len": 2048, "batch_size": batch},
        "training": {"compile": True}})


def paper_layout(job, tp: int, pp: int, gpus: int, machine) -> PlanLayout:
    """The paper's layout in Optimus's terms; for pp > 1 the interleaving depth the planner
    likes best among those that divide the layers (the paper does not give it)."""
    dp, batch = gpus // (tp * pp), job.data.batch_size
    base = PlanLayout(ParallelDims(dp=dp, tp=tp, pp=pp), microbatches=batch // dp,
                      microbatch_size=1,
                      seq_len=2048, recompute="full", schedule="1f1b",
                      param_gather="step" if dp > 1 else "microbatch", compiled=True)
    if pp == 1:
        return base
    layers, m = job.model.n_layers, batch // dp
    options = [replace(base, schedule="interleaved_1f1b",
                       dims=replace(base.dims, virtual_stages=v)) for v in range(2, 9)
               if layers % (pp * v) == 0
               and not schedule_problem("interleaved_1f1b", pp, v, m)] or [base]
    return max(options, key=lambda lay: step_time(job.model, lay, machine, batch, PAPER)
               .tokens_per_s_per_device)


def megatron_2021(job, lay: PlanLayout) -> bool:
    """A layout Megatron-LM ran in 2021: full recompute (all of Table 1; without sequence
    parallelism its activations did not fit otherwise, which Optimus's memory model, built
    with sequence parallelism, cannot say), 1F1B or interleaved 1F1B, replicated data
    parallelism (one gradient exchange a step: param_gather step), and no sharded optimizer:
    every replica holds its tp x pp share of the master weights and Adam's moments whole, so
    it must fit as it would at dp 1."""
    if lay.recompute != "full" or lay.schedule not in ("1f1b", "interleaved_1f1b"):
        return False
    if lay.dims.dp > 1 and lay.param_gather != "step":
        return False
    one = replace(lay, dims=replace(lay.dims, dp=1))
    return worst_rank(shape_of(job.model), one).total <= 80 * 2**30


# job file, machine profile, devices
JOB_FILES = [("jobs/gpt-175b.yaml", "max1550-aurora", 1536),
             ("jobs/gpt-175b.yaml", "a100-hdr", 1536),
             ("jobs/mula-1b.yaml", "max1550-aurora", 768),
             ("jobs/mula-7b-a1b.yaml", "max1550-aurora", 768)]


def job_files(markdown: bool) -> None:
    """The job file's own layout against the planner's best, per device."""
    head = ("job", "machine", "devices", "job file's layout", "its tokens/s/device",
            "its TFLOP/s", "GiB/rank", "planner's best", "its tokens/s/device", "its TFLOP/s",
            "job file's layout ranks")
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for path, name, devices in JOB_FILES:
        machine = get_machine(name)
        job = load_job(path)
        own = job_layout(job, resolve_layout(job, devices), "bf16")
        mine = step_time(job.model, own, machine, job.data.batch_size)
        memory = worst_rank(shape_of(job.model), own).total / 2**30
        fits, _ = plan(job, devices, machine, "bf16")
        best = fits[0]
        rank = next((i + 1 for i, c in enumerate(fits) if c.layout == own), None)
        cells = (path, name, str(devices), own.label(), f"{mine.tokens_per_s_per_device:.0f}",
                 f"{mine.tflops_per_device:.0f}", f"{memory:.1f}", best.layout.label(),
                 f"{best.time.tokens_per_s_per_device:.0f}",
                 f"{best.time.tflops_per_device:.0f}",
                 f"{rank} of {len(fits)}" if rank else f"does not fit ({len(fits)} do)")
        print(("| " + " | ".join(cells) + " |") if markdown else "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--terms", action="store_true",
                        help="also print each step-time term's share on the paper's layout")
    parser.add_argument("--jobs", action="store_true",
                        help="the job files (seed 000's 175B, Mula) instead of seed 001")
    args = parser.parse_args()
    if args.jobs:
        job_files(args.markdown)
        return
    a100 = get_machine("a100-hdr")
    rows = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, published, _ in SEED_001_TABLE_1:
        job = job_of(heads, hidden, layers, batch)
        theirs = paper_layout(job, tp, pp, gpus, a100)
        predicted = step_time(job.model, theirs, a100, batch, PAPER)
        memory = worst_rank(shape_of(job.model), theirs).total / 2**30
        started = time.perf_counter()
        fits, _ = plan(job, gpus, a100, "bf16")
        took = time.perf_counter() - started
        top = fits[:3]
        shapes = [(c.layout.dims.tp, c.layout.dims.pp) for c in top]
        rank = next((i + 1 for i, c in enumerate(fits)
                     if (c.layout.dims.tp, c.layout.dims.pp) == (tp, pp)), None)
        # the same ranking within the choices Megatron-LM had in 2021
        own = [c for c in fits if megatron_2021(job, c.layout)]
        own_top = [(c.layout.dims.tp, c.layout.dims.pp) for c in own[:3]]
        rows.append((size, f"{tp}x{pp}", published, predicted, memory, theirs,
                     top[0] if top else None, (tp, pp) in shapes, rank, took,
                     (tp, pp) in own_top, " ".join(f"{t}x{p}" for t, p in own_top)))
    head = ("params B", "paper tp x pp", "paper TFLOP/s", "predicted on paper's layout",
            "error", "GiB/rank there", "planner's best", "its TFLOP/s",
            "paper's tp x pp in top 3 (first at)", "plan s",
            "top 3 tp x pp within Megatron-LM 2021's choices")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for size, shape, published, t, memory, _, best, in_top, rank, took, in_own, own in rows:
        cells = (f"{size:g}", shape, f"{published}", f"{t.tflops_per_device:.0f}",
                 f"{t.tflops_per_device / published - 1:+.0%}", f"{memory:.1f}",
                 best.layout.label() if best else "-",
                 f"{best.time.tflops_per_device:.0f}" if best else "-",
                 ("yes" if in_top else "no") + f" ({rank})", f"{took:.1f}",
                 ("yes: " if in_own else "no: ") + own)
        print(("| " + " | ".join(cells) + " |") if args.markdown else "  ".join(cells))
    if args.terms:
        print()
        for size, _, _, t, _, lay, best, *_ in rows:
            for name, layout, times in (("paper", lay, t), ("best", best.layout, best.time)):
                shares = ", ".join(f"{k} {v / times.total:.0%}"
                                   for k, v in times.terms().items() if v)
                print(f"{size:g}B {name} {layout.label()}: {shares}")


if __name__ == "__main__":
    main()
