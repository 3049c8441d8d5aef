"""Mixture of experts: dispatch cost, throughput against dense, optimizer state per rank.

    .venv/bin/python bench/moe.py [--device cpu|cuda] [--ep 2]

1. Dispatch + combine as a share of MoE-layer time: one MoE layer (4,096 tokens, dim 512,
   16 experts of 1,024, top 2) forward, on `--ep` ranks with expert parallelism (all-to-all
   over gloo on a CPU, NCCL on GPUs), timed whole and in its expert GEMMs and router; the rest
   is dispatch and combine (routing bookkeeping, permutations, the all-to-alls, the weighted
   sum). Also the grouped GEMM's rate against one dense matmul of the same FLOPs.
2. Tokens/s of a small MoE model against a dense model with the same active parameters (its
   feed-forward as wide as top_k experts), one rank, the trainer's own step.
3. Optimizer-state bytes per rank under EP2 x EDP2 (4 ranks) against an unsharded AdamW.

Targets on a GPU: dispatch + combine <= 15% of layer time, grouped GEMM >= 70% of the dense
matmul rate. On a CPU the figures are recorded, not judged.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from optimus.config import validate_job  # noqa: E402
from optimus.models import build_model, param_count  # noqa: E402
from optimus.models.moe import grouped_mm  # noqa: E402

TOKENS, DIM, EXPERTS, HIDDEN, TOP_K = 4096, 512, 16, 1024, 2


def moe_job(**model) -> dict:
    return {"name": "bench-moe",
            "model": {"vocab_size": 4096, "dim": DIM, "n_layers": 1, "n_heads": 8,
                      "n_kv_heads": 8, "max_seq_len": 512, **model},
            "data": {"seq_len": 256, "batch_size": 8, "microbatches": 1},
            "optim": {"steps": 12, "warmup_steps": 2},
            "checkpoint": {"interval": 0}, "parallel": {"device": "cpu"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- 1. the layer ------------------------------------------------------------------------------

def layer_worker(rank: int, world: int, port: int, device: str, queue) -> None:
    from optimus.parallel.expert_parallel import apply_expert_parallel

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if device == "cuda" else "gloo"
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = validate_job(moe_job(moe={"experts": EXPERTS, "top_k": TOP_K,
                                    "expert_ffn_dim": HIDDEN})).model
    model = build_model(cfg, seed=1, device=dev).to(dtype)
    moe = model.layers["0"].feed_forward
    if world > 1:
        mesh = dist.device_mesh.init_device_mesh(device, (world,), mesh_dim_names=("ep",))
        apply_expert_parallel(model, mesh["ep"])
    spent = {"experts": 0.0, "router": 0.0}

    def timed(name, fn):
        def run(*args, **kwargs):
            sync(dev)
            began = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(dev)
            spent[name] += time.perf_counter() - began
            return out
        return run
    moe.experts.forward = timed("experts", moe.experts.forward)
    moe.router.forward = timed("router", moe.router.forward)
    g = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randn(1, TOKENS, DIM, generator=g).to(dev, dtype)
    totals = []
    with torch.no_grad():
        for i in range(13):
            for k in spent:
                spent[k] = 0.0
            sync(dev)
            began = time.perf_counter()
            moe(x)
            sync(dev)
            if i >= 3:
                totals.append((time.perf_counter() - began, dict(spent)))
    total = statistics.median(t for t, _ in totals)
    experts = statistics.median(s["experts"] for _, s in totals)
    router = statistics.median(s["router"] for _, s in totals)
    # The grouped GEMM against one dense matmul of the same shape and FLOPs.
    local = EXPERTS // world
    counts = torch.full((local,), TOKENS * TOP_K // EXPERTS, device=dev)
    a = torch.randn(int(counts.sum()), DIM, generator=g).to(dev, dtype)
    w = torch.randn(local, DIM, HIDDEN, generator=g).to(dev, dtype)
    dense = torch.randn(DIM, HIDDEN, generator=g).to(dev, dtype)
    grouped_s = best_of(lambda: grouped_mm(a, w, counts), dev)
    dense_s = best_of(lambda: a @ dense, dev)
    queue.put((rank, total, experts, router, dense_s / grouped_s))
    dist.destroy_process_group()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def best_of(fn, dev: torch.device, n: int = 10) -> float:
    fn()
    times = []
    for _ in range(n):
        sync(dev)
        began = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - began)
    return min(times)


def layer_share(ep: int, device: str) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=layer_worker, args=(r, ep, port, device, queue))
             for r in range(ep)]
    for p in procs:
        p.start()
    rows = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    total = max(r[1] for r in rows)
    experts = statistics.mean(r[2] for r in rows)
    router = statistics.mean(r[3] for r in rows)
    share = (total - experts - router) / total
    rate = statistics.mean(r[4] for r in rows)
    print(f"1. MoE layer forward on {ep} rank(s) ({device}), {TOKENS} tokens x {DIM}, "
          f"{EXPERTS} experts of {HIDDEN}, top {TOP_K}: {1e3 * total:.1f} ms; expert GEMMs "
          f"{1e3 * experts:.1f} ms, router {1e3 * router:.2f} ms; dispatch + combine "
          f"{100 * share:.1f}% of the layer (target on a GPU <= 15%)")
    print(f"   grouped GEMM at {100 * rate:.0f}% of one dense matmul's rate (target on a GPU "
          f">= 70%)")


# --- 2. throughput against dense ---------------------------------------------------------------

def tokens_per_s(raw: dict) -> float:
    from optimus.train import train

    with tempfile.TemporaryDirectory() as tmp:
        raw = {**raw, "run_dir": tmp}
        result = train(validate_job(raw, world=1), quiet=True)
    return statistics.median(m.tokens_per_s for m in result.metrics[2:])


def throughput() -> None:
    moe = moe_job(n_layers=4, moe={"experts": 8, "top_k": 2, "expert_ffn_dim": 512,
                                   "balance": "bias"})
    dense = moe_job(n_layers=4, ffn_dim=2 * 512)  # top_k experts' worth of feed-forward
    a, b = validate_job(moe).model, validate_job(dense).model
    assert param_count(a, active=True) == param_count(b) + 4 * DIM * 8  # + the routers
    moe_rate, dense_rate = tokens_per_s(moe), tokens_per_s(dense)
    print(f"2. tokens/s, one CPU rank: MoE {moe_rate:,.0f} ({param_count(a) / 1e6:.1f}M "
          f"parameters, {param_count(a, active=True) / 1e6:.1f}M active) against dense "
          f"{dense_rate:,.0f} ({param_count(b) / 1e6:.1f}M): ratio {moe_rate / dense_rate:.2f}")


# --- 3. optimizer state per rank ----------------------------------------------------------------

def state_worker(rank: int, world: int, port: int, queue) -> None:
    from torch.distributed.tensor import DTensor

    from optimus.config import resolve_layout
    from optimus.optim import build_optimizer
    from optimus.parallel.plan import build_parallel_model
    from optimus.runtime import ParallelDims

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    raw = moe_job(n_layers=4, moe={"experts": 8, "top_k": 2, "expert_ffn_dim": 512})
    raw["parallel"]["ep"] = 2
    job = validate_job(raw, world=world)
    layout = resolve_layout(job, world)
    mesh = ParallelDims(dp=layout.dp, tp=1, pp=1, ep=2, world_size=world).build_mesh("cpu")
    cpu = torch.device("cpu")
    model = build_parallel_model(job, layout, mesh, cpu)
    optimizer = build_optimizer(model.state_view(), job.optim, cpu)
    tokens = torch.randint(0, 4096, (2, 257))
    model.set_step_tokens(world * 2 * 256)
    model.forward_backward([{"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}], cpu)
    optimizer.step()
    local = sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()
                for state in optimizer.state.values()
                for k, t in state.items() if k != "step")
    queue.put((rank, local, param_count(job.model)))
    dist.destroy_process_group()


def optimizer_state() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=state_worker, args=(r, 4, port, queue)) for r in range(4)]
    for p in procs:
        p.start()
    rows = sorted(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    unsharded = 2 * 4 * rows[0][2]  # exp_avg and exp_avg_sq, fp32, every parameter
    per_rank = [r[1] for r in rows]
    print(f"3. optimizer state per rank, EP2 x EDP2 on 4 ranks: "
          f"{', '.join(f'{b / 2**20:.2f}' for b in per_rank)} MiB against "
          f"{unsharded / 2**20:.2f} MiB unsharded: {max(per_rank) / unsharded:.3f}x "
          f"(ideal 1/4 = 0.250)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ep", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s)"
          + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    layer_share(args.ep, args.device)
    throughput()
    optimizer_state()
