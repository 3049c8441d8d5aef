"""Snapshot overhead: the step time of one rank taking an in-memory snapshot after every step,
against the same rank taking none, in one run.

One rank (world 1 on a HashStore, gloo), the trainer's pieces (bench/checkpoint.py's `Rank`):
a GPT whose training state (fp32 weights and AdamW's two moments) is tens of MB, in alternating
rounds of `--steps` steps: without snapshots, then with `Snapshots(every=1)` into a folder on
/dev/shm (where an agent gives its ranks theirs), so that drift in the machine's speed hits
both. Each round drops its first WARMUP steps. Printed: the median step time of each, their
ratio (the slow-down; target: <= 0.5% of a step), and of the snapshot's cost the part the loop
waits for, blocked per snapshot (the host's time in the snapshot's calls: the references at
the step boundary, the copy's fence before the update; target <= 5% of a step), and the
background part (copy, write, checksum slowing the step).

The rank trains on `--threads` threads (default 1: this 2-core VM then has a core the rank does
not use, as a node whose ranks are bound to their cores has; OPTIMUS_CPU_BIND).

    .venv/bin/python bench/snapshot_overhead.py [--rounds 5] [--steps 12] [--threads 1]
                                                [--layers 2] [--dim 512] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from checkpoint import Rank, bench_job  # bench/checkpoint.py, beside this file

from optimus.checkpoint.snapshot import Snapshots
from optimus.config import validate_job

WARMUP = 2
TARGET = 0.005  # snapshots every step slow it by <= 0.5%
BLOCKED_TARGET = 0.05  # the host's wait per snapshot, against a step


def run_round(rank: Rank, steps: int, snapshots: Snapshots | None) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"step": [], "blocked": [], "taking": [], "fence": []}
    waited = [0.0, 0.0]  # this step's time in the snapshot's calls: the fence, the taking

    def timed(call, which: int) -> None:
        began = time.perf_counter()
        call()
        waited[which] += time.perf_counter() - began

    for i in range(steps):
        started, waited[:] = time.perf_counter(), [0.0, 0.0]
        if snapshots is None:
            rank.step()
        else:
            rank.step(lambda: timed(snapshots.fence, 0))  # as the trainer: before the update
            timed(lambda: snapshots.after_step(rank.progress.step, 0.0, rank.state), 1)
        elapsed = time.perf_counter() - started
        if i >= WARMUP:
            out["step"].append(elapsed)
            if snapshots is not None:  # the fence of the one taken a step before, this one
                out["blocked"].append(sum(waited))
                out["fence"].append(waited[0])
                out["taking"].append(waited[1])
    if snapshots is not None:
        snapshots.close()  # the last write lands inside the round it belongs to
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rank = Rank(validate_job(bench_job(args.layers, args.dim, args.device)))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="bench-snapshots-", dir=shm))
    state_mb = sum(t.numel() * t.element_size() for t in rank.model.parameters()) * 3 / 2**20
    print(f"one rank, {rank.params / 1e6:.1f} M parameters ({state_mb:.0f} MiB of weights and "
          f"AdamW state), {args.threads} thread(s); {args.rounds} rounds of {args.steps} steps "
          f"each way, the first {WARMUP} of each dropped; snapshots into {root}", flush=True)
    plain: list[float] = []
    taken: list[float] = []
    blocked: dict[str, list[float]] = {"blocked": [], "fence": [], "taking": []}
    try:
        for r in range(args.rounds):
            plain += run_round(rank, args.steps, None)["step"]
            snaps = Snapshots(root, rank=0, generation=r, every=1, layout="bench",
                              agree_device=torch.device("cpu"))
            out = run_round(rank, args.steps, snaps)
            taken += out["step"]
            for kind, values in blocked.items():
                values += out[kind]
            sizes = [f.stat().st_size for f in root.glob("*/rank_*.pt")]
            for old in root.iterdir():  # the agent's retention, here: keep shm from filling
                shutil.rmtree(old, ignore_errors=True)
            print(f"round {r + 1}: median step {statistics.median(plain[-len(out['step']):]):.3f} "
                  f"s without, {statistics.median(out['step']):.3f} s with a snapshot every "
                  "step", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"a snapshot: {max(sizes):,} bytes on this rank")
    without, with_ = statistics.median(plain), statistics.median(taken)
    waited = statistics.median(blocked["blocked"])
    slow = with_ / without - 1
    print(f"step: {without:.4f} s without snapshots, {with_:.4f} s with one every step: "
          f"{slow:+.2%} (target <= {TARGET:.1%}: {'met' if slow <= TARGET else 'MISSED'}); "
          f"of that the loop waits {waited:.4f} s in the snapshot's calls, the rest "
          f"({with_ - without - waited:+.4f} s) is the background copy and write slowing the "
          "step")
    met = "met" if waited / without <= BLOCKED_TARGET else "MISSED"
    print(f"blocked per snapshot / step time {waited:.4f} s / {without:.4f} s = "
          f"{waited / without:.2%} (target <= {BLOCKED_TARGET:.0%}: {met}); medians: taking "
          f"(references) {statistics.median(blocked['taking']):.4f} s, fence before the update "
          f"{statistics.median(blocked['fence']):.4f} s")


if __name__ == "__main__":
    main()
