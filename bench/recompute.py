"""Activation recompute: peak memory and step time of each mode, on one rank.

The same model and batch in every mode (`parallel.activation_checkpoint`): none keeps every
activation; full recomputes every block; selective every second block; op keeps the matmul and
attention outputs of every block and recomputes the element-wise ops. Peak memory is PyTorch's
MemTracker's (parameters, gradients and activations of one forward and backward; it works on
CPU, where the allocator keeps no statistics); time is the median of `--steps` forward and
backward passes, modes interleaved so that drift in the machine's speed hits all alike.

    .venv/bin/python bench/recompute.py [--dim 256] [--layers 4] [--seq 512] [--batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from optimus.config import validate_job
from optimus.models import build_model
from optimus.parallel.activation_checkpoint import apply_activation_checkpointing
from optimus.parallel.plan import cross_entropy_sum

MODES = ("none", "full", "selective", "op")


def step(model: torch.nn.Module, batch: torch.Tensor) -> None:
    cross_entropy_sum(model(batch[:, :-1]), batch[:, 1:]).backward()
    model.zero_grad(set_to_none=True)


def peak_bytes(model: torch.nn.Module, batch: torch.Tensor) -> int:
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        cross_entropy_sum(model(batch[:, :-1]), batch[:, 1:]).backward()
    peak = tracker.get_tracker_snapshot("peak")
    model.zero_grad(set_to_none=True)
    return int(sum(v.get("Total", 0) for v in peak.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    cfg = validate_job({"name": "bench-recompute", "model": {
        "vocab_size": 256, "dim": args.dim, "n_layers": args.layers, "n_heads": 8,
        "max_seq_len": args.seq}}).model
    batch = torch.randint(0, 256, (args.batch, args.seq + 1),
                          generator=torch.Generator().manual_seed(0))
    models = {}
    for mode in MODES:
        models[mode] = build_model(cfg, seed=1)
        apply_activation_checkpointing(models[mode], mode)
    peaks = {mode: peak_bytes(model, batch) for mode, model in models.items()}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.steps):
        for mode, model in models.items():
            started = time.perf_counter()
            step(model, batch)
            times[mode].append(time.perf_counter() - started)
    print(f"dim {args.dim}, {args.layers} layers, batch {args.batch} x seq {args.seq}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'mode':<10} {'peak MiB':>9} {'vs none':>8} {'step ms':>8} {'vs none':>8}")
    base_peak, base_time = peaks["none"], statistics.median(times["none"])
    for mode in MODES:
        t = statistics.median(times[mode])
        print(f"{mode:<10} {peaks[mode] / 2**20:>9.1f} {peaks[mode] / base_peak:>8.2f} "
              f"{t * 1e3:>8.0f} {t / base_time:>8.2f}")


if __name__ == "__main__":
    main()
