"""What a training step asks of the device, counted on a CPU: host reads and dispatched ops.

A device pays for every time the host waits for it: an `.item()`, `bool()`, `float()` or
`int()` of a device tensor (each is an `aten::_local_scalar_dense`), and a wait for a step's own
figures at its own boundary (optimus/boundary.py reads an unlogged step while the next one's
work is queued, so that one costs nothing). Every dispatched aten op is a kernel launch or more
on a device: where host work dominates (a small model, a fast device), their count is the step.
So both are counted per step on a CPU, where CI runs, for `optimus train` and for the plain
loop one would write by hand (same model, same batches from the same loader, the same fused
AdamW with the same parameter groups, torch's clip, the loss read where the step is logged):
the difference is what a device would pay for the trainer.

Counted with a TorchDispatchMode (every op the dispatcher runs, backward included: autograd
runs a CPU graph on the caller's thread), bracketed per step at `train_step`'s entry.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import optimus.boundary
import optimus.train
from optimus.config import validate_job
from optimus.data import build_loader, build_source
from optimus.metrics import logs_step
from optimus.models import build_model
from optimus.optim import build_optimizer

HOST_READ = "aten._local_scalar_dense"


class OpCount(TorchDispatchMode):
    """Every aten op dispatched while it is on, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Step:
    """One step's counts: ops by name, and its figures read at its own boundary (waits)."""

    step: int
    logged: bool
    ops: Counter = field(default_factory=Counter)
    waits: int = 0
    began: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0  # to the next step's beginning (counting slows it: time apart)

    @property
    def host_reads(self) -> int:
        return self.ops[HOST_READ] + self.waits

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def tiny_job(steps: int, log_every: int, *, dim: int = 64, layers: int = 2, seq: int = 64,
             batch: int = 4, microbatches: int = 2, run_dir: str | None = None, world: int = 1,
             **extra):
    """A job small enough that host work dominates its step (the launch-bound case)."""
    raw = {"name": "step-counts", "run_dir": run_dir or tempfile.mkdtemp(prefix="counts-"),
           "model": {"vocab_size": 256, "dim": dim, "n_layers": layers, "n_heads": 4,
                     "n_kv_heads": 2, "max_seq_len": seq},
           "optim": {"steps": steps, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2},
           "data": {"source": "synthetic", "seq_len": seq, "batch_size": batch,
                    "microbatches": microbatches},
           "checkpoint": {"interval": 0}, "eval": {"every": 0},
           "supervision": {"log_every": log_every}, "parallel": {"device": "cpu"}}
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    return validate_job(raw, world=world)


def optimus_steps(job, count_ops: bool = True) -> list[Step]:
    """Each step of `optimus train` on this process (one rank), counted from its `train_step`
    to the next one's: the step and its boundary. `count_ops` False: timed only."""
    steps: list[Step] = []
    count = OpCount()
    inner_step, inner_settle = optimus.train.train_step, optimus.boundary.Boundary.settle

    def counted_step(parts, step, *args, **kwargs):
        _close(steps, count)
        steps.append(Step(step, logs_step(step, job.supervision.log_every, job.optim.steps)))
        return inner_step(parts, step, *args, **kwargs)

    def counted_settle(self):
        if self.pending is not None and steps and self.pending.step == steps[-1].step:
            steps[-1].waits += 1  # read at its own boundary: the host waited for it
        return inner_settle(self)

    optimus.train.train_step, optimus.boundary.Boundary.settle = counted_step, counted_settle
    try:
        with count if count_ops else contextlib.nullcontext():
            optimus.train.train(job, quiet=True)
    finally:
        optimus.train.train_step, optimus.boundary.Boundary.settle = inner_step, inner_settle
    _close(steps, count)
    return steps


def plain_steps(job, count_ops: bool = True) -> list[Step]:
    """The reference loop, counted (or timed) the same way."""
    cfg, d = job.model, job.data
    torch.manual_seed(job.seed)
    model = build_model(cfg, seed=job.seed, device=torch.device("cpu"))
    optimizer = build_optimizer(model, job.optim, torch.device("cpu"))
    optimizer = torch.optim.AdamW(optimizer.param_groups, lr=job.optim.lr, fused=True,
                                  betas=(job.optim.beta1, job.optim.beta2), eps=job.optim.eps)
    loader = iter(build_loader(build_source(d, vocab_size=cfg.vocab_size, seed=job.seed),
                               seq_len=d.seq_len, batch_size=d.batch_size,
                               microbatches=d.microbatches, dp_rank=0, dp_size=1,
                               seed=job.seed))
    steps: list[Step] = []
    count = OpCount()
    with count if count_ops else contextlib.nullcontext():
        for step in range(1, job.optim.steps + 1):
            _close(steps, count)
            logged = logs_step(step, job.supervision.log_every, job.optim.steps)
            steps.append(Step(step, logged))
            for _ in range(d.microbatches):
                mb = next(loader)
                logits = model(mb["input_ids"])
                loss = F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten())
                (loss / d.microbatches).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), job.optim.grad_clip, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if logged:
                loss.item()
    _close(steps, count)
    return steps


def _close(steps: list[Step], count: OpCount) -> None:
    """Give the step in progress the ops counted since it began."""
    if steps:
        steps[-1].ops = count.ops
        steps[-1].seconds = time.perf_counter() - steps[-1].began
    count.ops = Counter()


def steady(steps: list[Step], logged: bool, skip: int = 3) -> list[Step]:
    """The steps of one kind past the first `skip` (warm-up) and before the last (the run's end)."""
    return [s for s in steps[skip:-1] if s.logged == logged]


def summary(steps: list[Step]) -> dict:
    """Median host reads and ops per step of each kind."""
    out = {}
    for logged in (False, True):
        kind = steady(steps, logged)
        if kind:
            out["logged" if logged else "unlogged"] = {
                "steps": len(kind),
                "host_reads": statistics.median(s.host_reads for s in kind),
                "ops": statistics.median(s.total for s in kind)}
    return out


def compare(job) -> dict:
    """Optimus's counts, the plain loop's, and their differences, per step kind."""
    ours, plain = summary(optimus_steps(job)), summary(plain_steps(job))
    out = {"optimus": ours, "plain": plain}
    for kind in ours:
        if kind in plain:
            out[kind] = {"extra_host_reads": ours[kind]["host_reads"] - plain[kind]["host_reads"],
                         "ops_ratio": ours[kind]["ops"] / plain[kind]["ops"]}
    return out


def extra_ops(job, logged: bool = False) -> Counter:
    """Which ops Optimus's step dispatches beyond the plain loop's (median step of a kind)."""
    def median_step(steps):
        kind = steady(steps, logged)
        return sorted(kind, key=lambda s: s.total)[len(kind) // 2].ops
    diff = Counter(median_step(optimus_steps(job)))
    diff.subtract(median_step(plain_steps(job)))
    return Counter({k: v for k, v in diff.items() if v})


def profiled_reads(runner, short: int = 12, long: int = 20, **job) -> float:
    """Host reads a step as torch's profiler counts them, nested ones included (reads made
    inside other ops' kernels, which a dispatch mode does not see): `runner`'s run of `long`
    steps less its run of `short`, over the difference, steps logged every 4."""
    from torch.profiler import ProfilerActivity, profile

    counts = []
    for steps in (short, long):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner(tiny_job(steps, 4, **job), count_ops=False)
        counts.append(sum(e.count for e in prof.key_averages()
                          if e.key == "aten::_local_scalar_dense"))
    return (counts[1] - counts[0]) / (long - short)
