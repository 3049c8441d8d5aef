"""One rank of bench/context_parallel.py: the model at each sequence length, cp and method.

Every rank of a 4-rank gloo world runs this. At each sequence length rank 0 first runs the
one-process model (cp 1, the reference: the model's own SDPA attention on every position);
then for each method at cp 2 and cp 4 the first cp ranks build the model the trainer would
(`build_model` on the meta device, `apply_context_parallel`, `materialize`: the order of
optimus/parallel/plan.py, without FSDP2, so that the parameters are the same fixed part on
every rank) and run one microbatch on their slices of the same tokens, while the others wait.

Per run, on each rank:
- held: the bytes autograd holds from the forward (the loss included) to the backward, the
  storages of the tensors it saves (`saved_tensors_hooks`), each storage once, parameters
  and buffers left out: the activation memory of the microbatch;
- sent: the bytes this rank sends other ranks, forward and backward, counted where they are
  handed to torch.distributed: the all-to-all's inputs (`_c10d_functional.all_to_all_single`,
  seen by a dispatch mode; the chunk a rank keeps is not sent) and the ring's sends
  (`dist.batch_isend_irecv`'s isend ops);
- seconds: forward and backward, each repeat started together on the group (a barrier);
- the loss and the gradients summed over the group (on rank 0, against the reference).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from optimus.config import validate_job
from optimus.models import build_model, materialize
from optimus.parallel.context_parallel import (
    SequenceSlice,
    apply_context_parallel,
    take_microbatches,
)
from optimus.parallel.plan import cross_entropy_sum

CPS = (2, 4)
METHODS = ("alltoall", "ring")
WORLD = max(CPS)
FLOAT = 4  # bytes: fp32 throughout (the check against one process is at fp32's rounding)


@dataclass(frozen=True)
class Spec:
    seqs: tuple[int, ...]
    dim: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    repeat: int

    def model(self):
        return validate_job({"name": "bench-context-parallel", "model": {
            "vocab_size": self.vocab, "dim": self.dim, "n_layers": self.layers,
            "n_heads": self.heads, "n_kv_heads": self.kv_heads,
            "max_seq_len": max(self.seqs)}}).model

    def sent_formula(self, method: str, cp: int, seq: int) -> dict[str, int]:
        """Bytes one rank sends other ranks per layer, forward and backward."""
        local, head_dim = self.batch * seq // cp, self.dim // self.heads
        if method == "alltoall":  # q, k, v (kv heads repeated unless they split) and out
            kv = self.kv_heads if self.kv_heads % cp == 0 else self.heads
            both = (cp - 1) * local * head_dim * (2 * self.heads + 2 * kv) * FLOAT // cp
            return {"forward": both, "backward": both}  # the gradients, the other way
        # ring: k and v, at their own (kv) head count, go around (cp - 1 shifts); backward
        # they go around again with their gradients' accumulators (float32), and one last
        # shift takes each accumulator home
        block = 2 * local * self.kv_heads * head_dim * FLOAT
        return {"forward": (cp - 1) * block, "backward": (2 * cp - 1) * block}


class Held:
    """The storages autograd saves for the backward, each once, the fixed ones left out."""

    def __init__(self, model: torch.nn.Module):
        tensors = [*model.parameters(), *model.buffers()]
        self.fixed = {t.untyped_storage().data_ptr() for t in tensors}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.fixed:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def bytes(self) -> int:
        return sum(self.storages.values())


class Sent(TorchDispatchMode):
    """Bytes this rank hands torch.distributed for other ranks, by phase."""

    def __init__(self, cp: int):
        super().__init__()
        self.cp, self.phase = cp, "forward"
        self.bytes = {"forward": 0, "backward": 0}
        self._batch = dist.batch_isend_irecv

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            self.bytes[self.phase] += args[0].nbytes * (self.cp - 1) // self.cp  # equal splits
        return func(*args, **(kwargs or {}))

    def _counted(self, ops):
        self.bytes[self.phase] += sum(op.tensor.nbytes for op in ops if op.op is dist.isend)
        return self._batch(ops)

    def __enter__(self):
        dist.batch_isend_irecv = self._counted  # context_parallel calls it as dist.<name>
        return super().__enter__()

    def __exit__(self, *exc):
        dist.batch_isend_irecv = self._batch
        return super().__exit__(*exc)


def microbatch(spec: Spec, seq: int) -> dict:
    g = torch.Generator().manual_seed(seq)
    batch = torch.randint(0, spec.vocab, (spec.batch, seq + 1), generator=g)
    return {"input_ids": batch[:, :-1], "labels": batch[:, 1:]}


def loss_of(model, mb: dict) -> torch.Tensor:
    return cross_entropy_sum(model(mb["input_ids"]), mb["labels"])


def measured(spec: Spec, model, mb: dict, cp: int, group) -> dict:
    """One forward and backward counted (held, sent), then `spec.repeat` timed."""
    held, sent = Held(model), Sent(cp)
    with sent, torch.autograd.graph.saved_tensors_hooks(held.pack, lambda t: t):
        loss = loss_of(model, mb)
    with sent:
        sent.phase = "backward"
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    seconds = []
    for _ in range(spec.repeat):
        model.zero_grad(set_to_none=True)
        if group is not None:
            dist.barrier(group)
        started = time.perf_counter()
        loss_of(model, mb).backward()
        seconds.append(time.perf_counter() - started)
    return {"held": held.bytes(), "fixed": sum(p.nbytes for p in model.parameters()),
            "sent": sent.bytes, "seconds": seconds, "loss": loss.detach(), "grads": grads}


def errors(loss: torch.Tensor, grads: dict, ref: dict, group) -> tuple[float, float]:
    """The group's loss and gradients (summed over it) against one process's: the loss's
    relative difference, and the largest ||a - b|| / ||b|| of a parameter's gradient."""
    dist.all_reduce(loss, group=group)
    for g in grads.values():
        dist.all_reduce(g, group=group)
    if ref is None:
        return float("nan"), float("nan")
    loss_error = abs(float(loss) - float(ref["loss"])) / abs(float(ref["loss"]))
    grad_error = max(float((grads[n] - g).norm() / g.norm()) for n, g in ref["grads"].items())
    return loss_error, grad_error


def row(kind: str, method: str, cp: int, seq: int, rank: int, got: dict,
        loss_error: float = 0.0, grad_error: float = 0.0) -> dict:
    return {"seq": seq, "method": method, "cp": cp, "rank": rank, "held": got["held"],
            "fixed": got["fixed"], "sent": got["sent"], "seconds": got["seconds"],
            "loss_error": loss_error, "grad_error": grad_error, "kind": kind}


def run(rank: int, port: int, spec: Spec, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    groups = {cp: dist.new_group(list(range(cp))) for cp in CPS}
    cfg, seed, rows = spec.model(), 1, []
    for seq in spec.seqs:
        mb, ref = microbatch(spec, seq), None
        if rank == 0:
            ref = measured(spec, build_model(cfg, seed=seed), mb, 1, None)
            rows.append(row("reference", "-", 1, seq, rank, ref))
        dist.barrier()
        for method in METHODS:
            for cp in CPS:
                if rank < cp:
                    where = SequenceSlice(rank, cp)
                    model = build_model(cfg, seed=seed, device="meta")
                    apply_context_parallel(model, groups[cp], method, where, seq)
                    materialize(model, seed, "cpu")
                    (mine,) = take_microbatches([mb], where)
                    got = measured(spec, model, mine, cp, groups[cp])
                    rows.append(row("cp", method, cp, seq, rank, got,
                                    *errors(got["loss"], got["grads"], ref, groups[cp])))
                dist.barrier()
    queue.put(rows)
    dist.destroy_process_group()
