"""Mixture of experts: the job's MoE layer, forward and backward, before and after, and peers.

    .venv/bin/python bench/moe.py [--job jobs/mula-7b-a1b.yaml] [--tokens N | --small]
                                  [--device cpu|cuda] [--dtype bf16|float32] [--layers N]

The layer is the job's (`MoE(cfg.model, layer=0)`: its dim, experts, expert width, top k,
score function, balancing) at one microbatch of one rank: seq_len x batch_size / (dp x
microbatches) tokens on the job's world (bench/moe_layers.py); for Mula-7B-A1B 4,096 tokens.
On a CPU the default cuts that to 512 (the whole layer's forward and backward is ~1 TFLOP at
4,096) and says so; `--tokens N` sets it. `--small`: the case this bench measured before it
read a job (4,096 tokens x 512, 16 experts of 1,024, top 2; the job's other settings). The
experts and tokens are bf16 by default, as training runs them (FSDP2's bf16 parameters), on a
CPU too (one with avx512_bf16 runs them faster than float32); the router scores in float32.

1. The layer, forward and backward (bench/moe_measure.py says how each figure is taken), in
   up to four columns: the working tree's layer ("after"); the same router and expert weights
   through the dispatch and combine of before (bench/moe_reference.py: a copy of them, the
   same run); torchtitan 0.3.0's MoE with our configuration and weights (bench/moe_peer.py,
   where it imports); a dense SwiGLU with the same active parameters (top_k experts wide).
   For each: time, whole and in its expert GEMMs and router (the rest is dispatch and
   combine, and its share); bytes per token of dispatch and combine, of the experts, of the
   layer; aten ops; host reads; peak memory, and what the forward leaves for the backward.
   Then after against before (time; dispatch and combine bytes), against the dense SwiGLU and
   against torchtitan, and the grouped GEMM's rate against one dense matmul of its FLOPs.
2. Aten ops per layer, forward and backward, at 8 and at 64 experts (dim 64, 32 wide, 256
   tokens, top 2): a layer whose op count grows with its experts launches per expert.
3. All-to-all bytes under expert parallelism, EP 2 and EP 4 on 4 gloo processes, top 8 of 64
   (bench/moe_ep.py): the dispatch's counters, deduplicated against one row per slot.
4. `--device cuda` only: the job's training step on one GPU, its layers cut to `--layers`:
   tokens/s and MFU, and float8 experts against bf16 (bench/moe_step.py).

Targets: dispatch + combine bytes per token at least 2x fewer after than before (at
Mula-7B-A1B's shape; bytes do not depend on the device), aten ops flat in the expert count;
on a GPU, dispatch + combine <= 20% of the layer's time, the grouped GEMM >= 70% of the dense
matmul's rate, Optimus / torchtitan >= 1.00 (their time over ours). On a CPU the times are
recorded, not judged.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.moe_ep import WORLD, all_to_all_bytes  # noqa: E402
from bench.moe_layers import (  # noqa: E402
    build_moe,
    dense_mlp,
    job_shape,
    random_tokens,
    small_model,
)
from bench.moe_measure import Figures, counted, gemm_rate, measure  # noqa: E402
from bench.moe_peer import VERSION, agreement, torchtitan_moe  # noqa: E402
from bench.moe_reference import MoEBefore  # noqa: E402
from bench.moe_report import KIB, MIB, judged, print_table  # noqa: E402
from optimus.models.moe import grouped_mm  # noqa: E402

CPU_TOKENS = 512
BYTES_TARGET = 2.0  # before / after, dispatch + combine bytes per token
SHARE_TARGET, GEMM_TARGET, PEER_TARGET = 0.20, 0.70, 1.00  # at the job's shape


def with_peer(moe, x, dtype, cases: dict) -> None:
    """torchtitan's layer into `cases` where it imports and runs here; else one line why."""
    peer = torchtitan_moe(moe, dtype)
    if isinstance(peer, str):
        print(f"   torchtitan {VERSION}: left out: {peer}")
        return
    try:
        difference = agreement(moe, peer[0], x)
    except Exception as e:  # noqa: BLE001 (its forward cannot run here: say why, go on)
        print(f"   torchtitan {VERSION}: left out: its forward failed here: "
              f"{type(e).__name__}: {str(e).splitlines()[0]}")
        return
    cases["torchtitan"] = peer
    print(f"   torchtitan {VERSION}: its output against ours {difference:.1e} (relative; same "
          "routing, bf16 rounding apart)")


def layer_section(shape, device, dtype, repeat: int, warmup: int) -> dict[str, Figures]:
    on_gpu = device.type == "cuda"
    moe = build_moe(shape.model, device, dtype)
    x = random_tokens(shape, device, dtype)
    before = MoEBefore(moe)
    cases = {"after": (moe, {"experts": moe.experts, "router": moe.router}),
             "before": (before, {"experts": before.experts, "router": before.router})}
    with_peer(moe, x, dtype, cases)
    cases["dense"] = (dense_mlp(shape, device, dtype), {})
    weights = sum(p.numel() * p.element_size() for p in moe.parameters())
    how = "max_memory_allocated" if on_gpu else "the storages PeakMemory tracks"
    print(f"   times: the shortest of {repeat}" + (f" after {warmup} untimed" if warmup else "")
          + f"; memory: {how}, above the weights ({weights / MIB:,.0f} MiB; their gradients "
          "are in the peak)", flush=True)
    figures, failed = measure(cases, x, repeat, warmup, optional=("torchtitan",))
    for name, why in failed.items():
        print(f"   {name}: left out: its forward and backward failed here: {why}")
    print_table(figures)

    after, was = figures["after"], figures["before"]
    fewer = was.per_token() / after.per_token()
    verdict = ("not judged: --small's dims" if shape.small else
               ("met" if fewer >= BYTES_TARGET else "MISSED")
               + ("" if shape.tokens == shape.job_tokens else f", at {shape.tokens:,} tokens"))
    print(f"   after / before: layer time {after.both('seconds') / was.both('seconds'):.2f}x; "
          f"dispatch + combine bytes/token {fewer:.2f}x fewer (target >= {BYTES_TARGET:.0f}x "
          f"at the job's shape: {verdict})")
    share = after.share()
    print(f"   dispatch + combine {share:.0%} of the layer's time (target <= {SHARE_TARGET:.0%}: "
          f"{judged(share <= SHARE_TARGET, on_gpu)})")
    m = shape.moe
    print(f"   MoE layer / dense SwiGLU of the same active parameters ({m.top_k} x "
          f"{m.expert_ffn_dim} wide), time: "
          f"{after.both('seconds') / figures['dense'].both('seconds'):.2f}x")
    if "torchtitan" in figures:
        ratio = figures["torchtitan"].both("seconds") / after.both("seconds")
        print(f"   Optimus / torchtitan {VERSION} (their time over ours): {ratio:.2f}x (target "
              f">= {PEER_TARGET:.2f}: {judged(ratio >= PEER_TARGET, on_gpu)})")
    call = after.calls.get("experts")
    if call is not None and call.args[0].dim() == 2 and call.args[1] is not None:
        rate = gemm_rate(call.args[0].detach(), moe.experts.w1.detach(), call.args[1],
                         grouped_mm, 10 if on_gpu else 3)
        print(f"   grouped GEMM (the layer's rows and counts, forward) at {rate:.0%} of one "
              f"dense matmul's rate (target >= {GEMM_TARGET:.0%}: "
              f"{judged(rate >= GEMM_TARGET, on_gpu)})")
    return figures


def ops_section(shape, device, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(1, 256, 64, generator=g).to(device, dtype)
    ops = {}  # experts -> [after, before]
    for experts in (8, 64):
        moe = build_moe(small_model(shape.model, experts), device, dtype)
        ops[experts] = [sum(counted(layer, tokens).ops.values())
                        for layer in (moe, MoEBefore(moe))]
    (a8, b8), (a64, b64) = ops[8], ops[64]
    flat = "flat" if a8 == a64 else f"NOT flat ({a64 - a8:+d})"
    print(f"2. aten ops per layer, forward + backward (dim 64, 32 wide, 256 tokens, top 2): "
          f"8 experts {a8}, 64 experts {a64}: {flat} (before: {b8} and {b64})")


def ep_section(shape) -> None:
    model = small_model(shape.model, 64, dim=256, width=64, top_k=8)
    tokens = 256
    print(f"3. all-to-all bytes under EP, {WORLD} gloo processes, top 8 of 64 experts, dim "
          f"{model.dim} (float32), {tokens} tokens a rank, one forward and backward, summed "
          "over the ranks:", flush=True)
    for ep, r in all_to_all_bytes(model, tokens).items():
        own = r["token_rows"] / r["slot_rows"]
        routing = (f"the routing's own rows: {r['token_rows']:,} one per token and rank "
                   f"against {r['slot_rows']:,} one per slot: {own:.2f}x")
        if r["sent"] is None or r["undeduplicated"] is None:
            print(f"   EP {ep}: sent n/a, undeduplicated n/a (the dispatch has no sent_bytes / "
                  f"undeduplicated_bytes); {routing}")
            continue
        print(f"   EP {ep}: sent {r['sent'] / KIB:,.1f} KiB, undeduplicated "
              f"{r['undeduplicated'] / KIB:,.1f} KiB: {r['sent'] / r['undeduplicated']:.2f}x; "
              f"{routing}")


def header(args, shape, on_gpu: bool) -> None:
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s), {torch.get_num_threads()} "
          f"threads" + (f", {torch.cuda.get_device_name()}" if on_gpu else "")
          + f"; {args.dtype} experts and tokens, float32 router")
    where = (f"{args.job.name} with --small's dims" if args.small else
             f"{args.job.name} on its world of {shape.world} (dp {shape.dp}, "
             f"{shape.microbatches} microbatch{'es' if shape.microbatches > 1 else ''})")
    tokens = f"{shape.tokens:,} tokens"
    if shape.tokens != shape.job_tokens:
        why = "--tokens" if args.tokens else f"on a CPU by default; --tokens {shape.job_tokens}"
        tokens += f" (one microbatch of a rank is {shape.job_tokens:,}: cut, {why})"
    print(f"MoE layer of {where}: {tokens}, {shape.describe()}")
    if shape.moe.balance == "aux_loss" or shape.moe.router_z_loss:
        print("   (the job has auxiliary losses: after computes them, before does not)")


def main() -> None:
    args = parse_args()
    began = time.perf_counter()
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    device = torch.device("cuda:0" if on_gpu else "cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dtype = {"bf16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    shape = job_shape(args.job, args.world, args.tokens, args.small)
    if not (on_gpu or args.small or args.tokens) and shape.tokens > CPU_TOKENS:
        shape = replace(shape, tokens=CPU_TOKENS)
    header(args, shape, on_gpu)
    print(f"1. the layer, forward and backward: after (the working tree), before "
          f"(bench/moe_reference.py), torchtitan {VERSION}, dense SwiGLU", flush=True)
    layer_section(shape, device, dtype, args.repeat or (10 if on_gpu else 3),
                  warmup=3 if on_gpu else 0)
    ops_section(shape, device, dtype)
    ep_section(shape)
    if on_gpu:
        from bench.moe_step import training_step

        print(f"4. the job's training step on one GPU, {args.layers} layers, ep 1:", flush=True)
        for line in training_step(args.job, args.layers, steps=10, warmup=3, device=device):
            print(f"   {line}", flush=True)
    else:
        print("4. the job's training step on one GPU: n/a on a CPU (--device cuda)")
    print(f"{time.perf_counter() - began:.0f} s")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", type=Path, default=REPO / "jobs" / "mula-7b-a1b.yaml")
    p.add_argument("--world", type=int, help="the job's world (default: its header's --world N, "
                   "else its dp x tp x pp)")
    p.add_argument("--tokens", type=int, help="tokens of the layer's input (default: one "
                   f"microbatch of one rank; on a CPU at most {CPU_TOKENS})")
    p.add_argument("--small", action="store_true", help="4,096 tokens x 512, 16 experts of "
                   "1,024, top 2 (the job's other settings)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["bf16", "float32"], default="bf16",
                   help="the experts' and the tokens' (the router's is float32)")
    p.add_argument("--repeat", type=int, help="timed runs, the shortest taken (default 10 "
                   "cuda, 3 cpu)")
    p.add_argument("--layers", type=int, default=4, help="the training step's layers (cuda)")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: all)")
    return p.parse_args()


if __name__ == "__main__":
    main()
