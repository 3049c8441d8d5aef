"""One rank of a replica (tests/test_replicas.py, bench/replicas.py): a small MLP trained through
optimus/parallel/replicas.py, its replica's world of `--shard` ranks (FSDP2 when more than one),
the quorum read from `--quorum-file`. Each applied step is a line of `--out`/r<R>p<P>.jsonl:
the step, the quorum it was applied in, its loss, the time; at the end the rank's local state
is saved beside it (`r<R>p<P>.pt`).

The data are a function of (step, replica, position): rows of which a random ~3/4 carry loss,
so replicas count different tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from optimus.parallel.positions import Positions
from optimus.parallel.replicas import Reduced, ReplicaOut, Replicas, state_tensors

WIDTHS, ROWS = (32, 64, 32), 24  # the tests'; bench/replicas.py asks for ~1M parameters


def model(widths=WIDTHS) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for i, (n, m) in enumerate(zip(widths, widths[1:], strict=False)):
        layers += [torch.nn.Linear(n, m)] + ([torch.nn.Tanh()] if i < len(widths) - 2 else [])
    return torch.nn.Sequential(*layers)


def batch(step: int, replica: int, position: int, widths=WIDTHS, rows: int = ROWS):
    g = torch.Generator().manual_seed(step * 1000 + replica * 10 + position)
    x = torch.randn(rows, widths[0], generator=g)
    y = torch.randn(rows, widths[-1], generator=g)
    mask = (torch.rand(rows, generator=g) < 0.75).float()
    return x, y, mask


def loss_sum(net, x, y, mask) -> torch.Tensor:
    return (((net(x) - y) ** 2).mean(-1) * mask).sum()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--position", type=int, default=0)
    p.add_argument("--shard", type=int, default=1)
    p.add_argument("--world-port", type=int, default=0)
    p.add_argument("--quorum-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-s", type=float, default=0.0, help="sleep a step (a longer step)")
    p.add_argument("--timeout-s", type=float, default=3.0)
    p.add_argument("--after", type=int, default=0,
                   help="a standby: join only a quorum newer than this id")
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    p.add_argument("--rows", type=int, default=ROWS)
    p.add_argument("--alternate-until", type=int, default=0, metavar="STEP",
                   help="up to STEP, every other block of 5 steps exchanges by a bare "
                        "all-reduce on the same group (bench/replicas.py's reference)")
    p.add_argument("--die-healing", action="store_true",
                   help="exit (status 3) as its heal begins: a rank lost mid-heal")
    p.add_argument("--die-giving", action="store_true",
                   help="exit (status 4) as it first gives its state to heal another: the "
                        "healer lost mid-heal")
    p.add_argument("--die-before-exchange", type=int, default=0, metavar="STEP",
                   help="exit (status 5) as step STEP's exchange begins, its replica's own "
                        "sums done: a rank lost while the other positions' exchanges go on")
    p.add_argument("--die-position", type=int, default=-1,
                   help="only the rank at this position dies by a --die-* option (default: "
                        "every rank)")
    p.add_argument("--no-positions", action="store_true",
                   help="the replica's ranks do not agree before they apply (a check that "
                        "tests/test_replicas.py's half-applied case fails without it)")
    a = p.parse_args()
    torch.set_num_threads(1)  # several ranks share the machine's cores: one thread each
    widths = tuple(int(w) for w in a.widths.split(","))
    net = model(widths)
    if a.shard > 1:
        store = dist.TCPStore("127.0.0.1", a.world_port, a.shard, is_master=a.position == 0,
                              timeout=timedelta(seconds=30), wait_for_workers=False)
        dist.init_process_group("gloo", store=store, rank=a.position, world_size=a.shard,
                                timeout=timedelta(seconds=a.timeout_s))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (a.shard,))
        fully_shard(net, mesh=mesh)
        net.set_gradient_divide_factor(1.0)
        net.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    progress = torch.zeros(1, dtype=torch.int64)  # the last step applied

    dies = a.die_position in (-1, a.position)

    def tensors():
        if a.die_healing and int(progress) == 0 and dies:
            os._exit(3)
        if a.die_giving and int(progress) > 0 and dies:
            os._exit(4)
        return made()

    def made():
        return state_tensors(get_model_state_dict(net),
                             get_optimizer_state_dict(net, opt, options=flat),
                             {"progress": progress})

    if a.after:  # a standby makes its optimizer's state before it waits, as the trainer's
        made()  # relaunched replica does (ReplicaSteps.join): the heal then carries only bytes

    out = Path(a.out)
    name = f"r{a.replica}p{a.position}"
    log = open(out / f"{name}.jsonl", "a", buffering=1)  # noqa: SIM115 (closed at the end)
    wait_s = 600.0
    positions = None if a.shard == 1 or a.no_positions else Positions(
        None, a.shard, a.timeout_s + wait_s)
    rep = Replicas(Path(a.quorum_file), replica=a.replica, position=a.position, backend="gloo",
                   timeout_s=a.timeout_s, wait_s=wait_s, state=tensors, positions=positions)

    def event(kind: str, **fields) -> None:
        log.write(json.dumps({"event": kind, "time": time.time(), **fields}) + "\n")

    logged = missed = 0

    def formed() -> None:  # every quorum formed (or missed) since the last call
        nonlocal logged, missed
        for heal in rep.heals[logged:]:
            event("formed", **heal)
        for miss in rep.missed[missed:]:
            event("missed", **miss)
        logged, missed = len(rep.heals), len(rep.missed)

    event("waiting", pid=os.getpid())  # ready to join: the controller may let it in
    rep.join(int(progress), after=a.after)
    try:
        step = int(progress) + 1
        while step <= a.steps:
            try:
                inside = rep.before(step, int(progress))
            except ReplicaOut:
                raise
            except RuntimeError as e:  # the newer quorum did not meet
                event("failed", step=step, error=str(e)[:200])
                inside = False
            if not inside:
                rep.recover(int(progress))
                formed()
                step = int(progress) + 1
                continue
            formed()
            began = time.perf_counter()
            bare = step <= a.alternate_until and (step - 1) // 5 % 2 == 1
            x, y, mask = batch(step, a.replica, a.position, widths, a.rows)
            tokens = mask.sum()
            summed = loss_sum(net, x, y, mask)
            if a.shard > 1:
                both = torch.stack([tokens, summed.detach()])
                dist.all_reduce(both)
                tokens, replica_loss = both[0], both[1]
                # the newest quorum id any of the replica's ranks read, as `optimus train`'s
                # ranks agree on it at the boundary: every position switches at the same step
                seen = torch.tensor([rep.seen])
                dist.all_reduce(seen, op=dist.ReduceOp.MAX)
                rep.seen = int(seen)
            else:
                replica_loss = summed.detach()
            (summed / tokens).backward()
            grads = [q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad
                     for q in net.parameters()]
            if a.step_s:
                time.sleep(a.step_s)
            failures = len(rep.failed)
            if step == a.die_before_exchange and dies:
                os._exit(5)
            cpu, wall = time.thread_time(), time.perf_counter()  # its host work; its time
            if bare:
                reduced = bare_exchange(rep, grads, tokens, replica_loss)
            else:
                reduced = rep.exchange(grads, tokens, replica_loss, int(progress))
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            for failure in rep.failed[failures:]:
                event("failed", step=step, **failure)
            formed()
            if reduced is None:  # healed past it: the others applied this step, and so has it
                opt.zero_grad(set_to_none=True)
                step = int(progress) + 1
                continue
            opt.step()
            opt.zero_grad(set_to_none=True)
            progress.fill_(step)
            event("step", step=step, quorum=rep.quorum.id, members=list(rep.quorum.members),
                  loss=reduced.loss(), tokens=reduced.tokens(), pid=os.getpid(),
                  seconds=time.perf_counter() - began, bare=bare, exchange_cpu_s=cpu,
                  exchange_s=wall)
            rep.look()
            rep.after(step, reduced)
            step += 1
    except ReplicaOut as e:  # its replica was taken out: this process's part is over
        event("out", error=str(e)[:200])
        log.close()
        os._exit(0)
    torch.save({k: v.clone() for k, v in enumerate(tensors())}, out / f"{name}.pt")
    event("done", step=int(progress))
    log.close()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads and a peer gone: leave without tearing groups down


def bare_exchange(rep: Replicas, grads, tokens, loss) -> Reduced:
    """What a plain data-parallel loop does on the same group: the weighted gradients and the
    token count in one all-reduce, waited on; no poll, no quorum bookkeeping."""
    buffer = torch.cat([*(g.reshape(-1) for g in grads), tokens.reshape(1), loss.reshape(1)])
    buffer[:-2].mul_(tokens)
    rep.group.group.allreduce([buffer]).wait()
    buffer[:-2].div_(buffer[-2])
    flat = buffer[:-2].split([g.numel() for g in grads])
    torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat, grads, strict=True)])
    return Reduced(torch.stack([buffer[-2], buffer[-1],
                                torch.tensor(float(rep.quorum.id))]))


if __name__ == "__main__":
    main()
