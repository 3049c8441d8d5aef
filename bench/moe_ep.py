"""All-to-all bytes under expert parallelism, with and without deduplication (bench/moe.py).

Four gloo processes on the CPU run the MoE layer under `apply_expert_parallel` over EP 2 (two
groups of two) and then EP 4, one forward and backward each, on their own tokens. Each layer's
dispatch object (`moe.dispatch` under EP) counts what the token all-to-alls move:
`sent_bytes`, the bytes this rank sent to other ranks, each token once per destination rank,
and `undeduplicated_bytes`, what one row per slot would have sent. Read with getattr: a
dispatch without them prints n/a.

Beside them, the routing's own count, from the experts each token chose: the rows that leave
the rank one per slot (the slots whose expert another rank holds) against one per token and
destination rank. Its ratio is what deduplication saves whatever the counters include (both
directions, the backward's exchanges): the counters' ratio should match it.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
EPS = (2, 4)


class Routed:
    """A dispatch that keeps each call's chosen experts, then calls the layer's own."""

    def __init__(self, inner):
        self.inner = inner
        self.chosen: list[torch.Tensor] = []

    def __call__(self, tokens: torch.Tensor, chosen: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        self.chosen.append(chosen.detach())
        return self.inner(tokens, chosen, weights)


def routed_rows(chosen: torch.Tensor, ep: int, me: int, experts: int) -> tuple[int, int]:
    """(rows one per slot, rows one per token and rank) this rank sends other ranks."""
    dest = chosen // (experts // ep)  # [tokens, k]: the rank holding each chosen expert
    away = dest != me
    ranks = torch.zeros(chosen.shape[0], ep, dtype=torch.bool).scatter_(1, dest, True)
    ranks[:, me] = False
    return int(away.sum()), int(ranks.sum())


def worker(rank: int, port: int, model, tokens: int, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from bench.moe_layers import build_moe
    from optimus.parallel.expert_parallel import apply_expert_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    cpu = torch.device("cpu")
    for ep in EPS:
        mesh = init_device_mesh("cpu", (WORLD // ep, ep), mesh_dim_names=("edp", "ep"))["ep"]
        moe = build_moe(model, cpu, torch.float32)
        apply_expert_parallel(moe, mesh)
        dispatch = Routed(moe.dispatch)
        moe.dispatch = dispatch
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(1, tokens, model.dim, generator=g).requires_grad_()
        moe(x).backward(torch.randn(1, tokens, model.dim, generator=g))
        slot_rows, token_rows = routed_rows(dispatch.chosen[0].cpu(), ep, mesh.get_local_rank(),
                                            model.moe.experts)
        queue.put((ep, rank, getattr(dispatch.inner, "sent_bytes", None),
                   getattr(dispatch.inner, "undeduplicated_bytes", None), slot_rows,
                   token_rows))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_to_all_bytes(model, tokens: int) -> dict[int, dict]:
    """Per EP size: the counters summed over ranks (None where absent) and the routing's rows."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, model, tokens, queue))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    rows = [queue.get(timeout=300) for _ in range(WORLD * len(EPS))]
    for p in procs:
        p.join()
    out = {}
    for ep in EPS:
        mine = [r for r in rows if r[0] == ep]
        sent = [r[2] for r in mine]
        undup = [r[3] for r in mine]
        out[ep] = {"sent": None if None in sent else sum(sent),
                   "undeduplicated": None if None in undup else sum(undup),
                   "slot_rows": sum(r[4] for r in mine), "token_rows": sum(r[5] for r in mine)}
    return out
