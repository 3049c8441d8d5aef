"""The planner's memory model against one device's measured peak: `torch.cuda.max_memory_allocated`
on a GPU, the storage tracker `PeakMemory` on a CPU (and on a GPU too, beside it).

tests/test_planner.py checks the model on 4 gloo ranks of a tiny model; this runs the layouts
that fit one device (no sharding: tp, pp and dp 1; recompute none, selective, op and full; one
and two microbatches; a dense model and an MoE) on a model large enough that the caching
allocator's 512-byte rounding is noise, and prints each layout's predicted and measured peak
and the error. On a GPU the step runs in bf16 mixed precision (fp32 master weights and AdamW
state), as `training.mixed_precision: auto` does; on a CPU in fp32 with a small model, so the
fallback runs in seconds (bench/gpu.sh runs it on the GPU).

    python bench/planner_memory.py [--device cuda|cpu] [--precision bf16|fp32]
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist

from optimus.config import resolve_layout, validate_job
from optimus.planner.fit import job_layout
from optimus.planner.memory import rank_memory

MIB = 2**20
# (model size, seq, sequences per microbatch) per device: a GPU gets a model whose step
# holds GiBs; a CPU one that runs in seconds.
SHAPES = {
    "cuda": ({"vocab_size": 32768, "dim": 1024, "n_layers": 8, "n_heads": 16, "ffn_dim": 2816,
              "max_seq_len": 2048}, 2048, 4),
    "cpu": ({"vocab_size": 256, "dim": 128, "n_layers": 4, "n_heads": 4, "ffn_dim": 384,
             "max_seq_len": 128}, 128, 2),
}
# name: (MoE?, recompute, microbatches)
LAYOUTS = {
    "dense, no recompute": (False, "none", 1),
    "dense, no recompute, 2 microbatches": (False, "none", 2),
    "dense, selective": (False, "selective", 1),
    "dense, op": (False, "op", 1),
    "dense, full, 2 microbatches": (False, "full", 2),
    "MoE, full": (True, "full", 1),
    "MoE, no recompute": (True, "none", 1),
}


def job_for(device: str, moe: bool, recompute: str, microbatches: int, precision: str):
    model, seq, size = SHAPES[device]
    if moe:  # capacity 1: the padded expert matmul has the capacity's size, not the routing's
        model = {**model, "moe": {"experts": 8, "top_k": 2, "expert_ffn_dim": model["dim"],
                                  "capacity_factor": 1.0}}
    return validate_job({
        "name": "planner-memory", "model": model, "optim": {"steps": 1, "warmup_steps": 0},
        "data": {"seq_len": seq, "batch_size": size * microbatches,
                 "microbatches": microbatches},
        "parallel": {"device": device, "activation_checkpoint": recompute},
        "training": {"mixed_precision": precision}}, world=1)


def measure(job, device: torch.device) -> tuple[int, int]:
    """(max_memory_allocated on cuda else 0, PeakMemory's peak) over one steady step."""
    from optimus.optim import build_optimizer
    from optimus.parallel.plan import build_parallel_model
    from optimus.planner.measure import PeakMemory, state_tensors

    mesh = resolve_layout(job, 1).build_mesh(device.type)
    parts = build_parallel_model(job, mesh, device)
    optimizer = build_optimizer(parts.state_view(), job.optim, device)
    for p in parts.parameters():  # AdamW's state exists from here: a steady step
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    d, m = job.data, job.data.microbatches
    batch = torch.randint(0, job.model.vocab_size, (d.batch_size, d.seq_len + 1),
                          generator=torch.Generator().manual_seed(0)).to(device)
    pieces = [{"input_ids": x[:, :-1], "labels": x[:, 1:]} for x in batch.split(d.batch_size // m)]
    tracker = PeakMemory()
    tracker.track(state_tensors(parts.parts, optimizer))
    tracker.track([batch])
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with tracker:
        parts.set_step_tokens(batch.numel())
        parts.forward_backward(pieces, device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    allocated = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
        allocated = torch.cuda.max_memory_allocated()
    del parts, optimizer, pieces, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return allocated, tracker.peak


def init_one_rank(device: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=["bf16", "fp32"],
                        help="default: bf16 on cuda, fp32 on cpu (the cpu runs bf16 too)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    init_one_rank(args.device)
    device = torch.device(args.device)
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    print(f"planner memory model vs one {args.device} device ({precision}):")
    print(f"{'layout':<38} {'predicted':>10} {'allocated':>10} {'tracked':>10} {'error':>7}")
    worst = 0.0
    for name, (moe, recompute, microbatches) in LAYOUTS.items():
        job = job_for(args.device, moe, recompute, microbatches, precision)
        predicted = rank_memory(job.model, job_layout(job, resolve_layout(job, 1),
                                                      precision)).total
        allocated, tracked = measure(job, device)
        measured = allocated or tracked
        error = predicted / measured - 1
        worst = max(worst, abs(error))
        shown = f"{allocated / MIB:>8.1f}Mi" if allocated else f"{'-':>10}"
        print(f"{name:<38} {predicted / MIB:>8.1f}Mi {shown} {tracked / MIB:>8.1f}Mi "
              f"{error:>+7.1%}")
    print(f"largest error {worst:.1%} (error: predicted against "
          f"{'max_memory_allocated' if args.device == 'cuda' else 'the tracked peak'})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
