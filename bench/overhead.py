"""Trainer overhead: Optimus's step on one CPU rank against a plain PyTorch loop.

Both run the same model (same code, same weights), the same batches from the same loader and
the same fused AdamW, in this one process, in alternating rounds so that drift in the
machine's speed hits both. Two figures:

- what a step asks of a device, counted (bench/step_counts.py): host reads per unlogged and per
  logged step beyond the loop's (targets 0 and <= 1), and dispatched aten ops (target within 3%);
- time: the ratio of median step times, Optimus / plain, in two modes. `default`: a 3.1M-param
  model whose matmuls dominate (target <= 1.03); `launch`: a model so small that host work
  dominates the step, as on a fast device (target <= 1.05).

    .venv/bin/python bench/overhead.py [--mode default|launch|both] [--rounds 5] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import step_counts  # noqa: E402

WARMUP = 5  # steps dropped from each run: allocator and kernel warm-up
TARGETS = {"default": 1.03, "launch": 1.05}


def mode_job(mode: str, steps: int):
    """The job of a mode: the default model, or the launch-bound one (steps logged every 10)."""
    if mode == "launch":
        return step_counts.tiny_job(steps, 10)
    return step_counts.tiny_job(steps, 10, dim=256, layers=4, seq=256, batch=8)


def step_times(run, job) -> list[float]:
    steps = run(job, count_ops=False)
    return [s.seconds for s in steps[WARMUP:-1]]


def time_mode(mode: str, rounds: int, steps: int) -> dict:
    job = mode_job(mode, steps)
    runners = {"optimus": step_counts.optimus_steps, "plain": step_counts.plain_steps}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for name in order:
            times[name].extend(step_times(runners[name], job))
        print(f"{mode} round {r + 1}/{rounds}: " + ", ".join(
            f"{name} {statistics.median(t) * 1e3:.2f} ms" for name, t in times.items()),
            flush=True)
    ours, plain = statistics.median(times["optimus"]), statistics.median(times["plain"])
    tokens = job.data.batch_size * job.data.seq_len
    return {"mode": mode, "tokens_per_step": tokens, "optimus_ms": ours * 1e3,
            "plain_ms": plain * 1e3, "ratio": ours / plain, "target": TARGETS[mode]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("default", "launch", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < WARMUP + 3:
        parser.error(f"--rounds must be >= 1 and --steps >= {WARMUP + 3}")
    counts = step_counts.compare(step_counts.tiny_job(16, 4))
    print("per step, beyond the plain loop (bench/step_counts.py, a 0.13M-param model):")
    for kind in ("unlogged", "logged"):
        ours, plain = counts["optimus"][kind], counts["plain"][kind]
        print(f"  {kind:8s} host reads {ours['host_reads']:g} (loop {plain['host_reads']:g}, "
              f"extra {counts[kind]['extra_host_reads']:g}; target "
              f"{0 if kind == 'unlogged' else '<= 1'}), aten ops {ours['ops']:g} "
              f"(loop {plain['ops']:g}, ratio {counts[kind]['ops_ratio']:.3f}; target <= 1.03)")
    results = {"counts": counts, "modes": []}
    for mode in (("default", "launch") if args.mode == "both" else (args.mode,)):
        row = time_mode(mode, args.rounds, args.steps)
        results["modes"].append(row)
        print(f"{mode}: optimus {row['optimus_ms']:.2f} ms, plain {row['plain_ms']:.2f} ms a "
              f"step ({row['tokens_per_step']} tokens): ratio optimus/plain = "
              f"{row['ratio']:.3f}  (target <= {row['target']})", flush=True)
    return results


if __name__ == "__main__":
    main()
