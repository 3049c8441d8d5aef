"""Enumerate a job's layouts on N devices, keep those that fit, rank them by tokens/s.

A layout is (tp, pp, virtual stages, schedule, dp, ep, cp and its method, microbatch size,
recompute, and whether FSDP2 keeps the parameters gathered through the step: `param_gather`);
the global batch, the model and `parallel.cp_split` are the job's. Candidates are those
`optimus config check` would accept (heads, ffn and vocabulary divide by tp, layers fill the
stages, the schedule's microbatch rules, ep dividing dp and the experts, ep a multiple of cp,
the context rules of optimus/config/context_rules.py); tensor parallel stays inside a node.
Context parallel is tried in powers of two from `context.CP_FROM` positions (context.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from optimus.config import JobConfig
from optimus.config.schedule_rules import schedule_problem
from optimus.planner.context import context_degrees
from optimus.planner.machines import Machine
from optimus.planner.memory import Memory, PlanLayout, rank_memory, shape_of
from optimus.planner.steptime import StepTime, step_time
from optimus.runtime.dims import ParallelDims

GIB = 2**30
RECOMPUTE = ("none", "selective", "op", "full")
CP_METHODS = ("alltoall", "ring")
MICROBATCH_SIZES = (1, 2, 4, 8, 16)
# (schedule, virtual stages per rank) tried for pp > 1.
PIPELINES = (("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4),
             ("interleaved_1f1b", 8), ("zbv_zero_bubble", 2), ("interleaved_zero_bubble", 2),
             ("gpipe", 1))


@dataclass(frozen=True)
class Candidate:
    layout: PlanLayout
    memory: Memory
    time: StepTime


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def worst_rank(cfg, lay: PlanLayout) -> Memory:
    """The largest rank's memory. Only the first, second and last pipeline positions are
    candidates: the first holds the most microbatches in flight (and the embedding), the last
    the loss's logits, and under V-shaped schedules rank 0 holds both ends."""
    positions = sorted({0, min(1, lay.dims.pp - 1), lay.dims.pp - 1})
    return max((rank_memory(cfg, lay, r) for r in positions), key=lambda m: m.total)


def layouts(job: JobConfig, devices: int, machine: Machine, precision: str):
    """Every valid layout of `job` on `devices` devices (a generator)."""
    cfg, batch, seq = job.model, job.data.batch_size, job.data.seq_len
    experts = cfg.moe.experts
    for tp in _divisors(devices):
        if tp > machine.devices_per_node or cfg.n_heads % tp or cfg.ffn_dim % tp \
                or cfg.vocab_size % tp or seq % tp:
            continue
        if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
            continue
        for cp, method in context_degrees(job, tp, devices // tp):
            if (devices // tp) % cp:
                continue
            for pp in _divisors(devices // (tp * cp)):
                if pp > cfg.n_layers:
                    continue
                dp = devices // (tp * cp * pp)
                if batch % dp:
                    continue
                for ep in _expert_degrees(experts, dp, cp):
                    dims = ParallelDims(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp)
                    yield from _shapes(job, dims, method, precision)


def _expert_degrees(experts: int, dp: int, cp: int) -> list[int]:
    """ep degrees with `experts` experts: 1, or whole cp groups of data-parallel ranks
    (ep / cp dividing dp) that divide the experts."""
    if not experts:
        return [1]
    return [1] + [n * cp for n in _divisors(dp) if n * cp > 1 and experts % (n * cp) == 0]


def _shapes(job: JobConfig, dims: ParallelDims, method: str, precision: str):
    """Every microbatch shape, schedule, recompute and `param_gather` of one set of degrees."""
    batch, dp, pp = job.data.batch_size, dims.dp, dims.pp
    for size in MICROBATCH_SIZES:
        if (batch // dp) % size:
            continue
        m = batch // (dp * size)
        for schedule, v in (PIPELINES if pp > 1 else (("1f1b", 1),)):
            if pp * v > job.model.n_layers or (pp > 1 and schedule_problem(schedule, pp, v, m)):
                continue
            for recompute in RECOMPUTE:
                lay = PlanLayout(replace(dims, virtual_stages=v), schedule=schedule,
                                 microbatches=m, microbatch_size=size, seq_len=job.data.seq_len,
                                 recompute=recompute, precision=precision,
                                 z_loss=job.optim.z_loss > 0, cp_method=method,
                                 cp_split=job.parallel.cp_split,
                                 compiled=job.training.compile,
                                 float8=job.training.float8 != "off")
                yield lay
                if lay.shard > 1 and not lay.keeps_gathered:  # else the same layout
                    yield replace(lay, param_gather="step")


def plan(job: JobConfig, devices: int, machine: Machine, precision: str,
         capacity_gib: float | None = None) -> tuple[list[Candidate], int]:
    """(the layouts that fit, fastest first; how many were considered). A layout fits when
    its largest rank needs at most `capacity_gib`, by default the profile's memory less its
    headroom (`Machine.usable_gib`)."""
    cfg = shape_of(job.model)
    capacity = (capacity_gib or machine.usable_gib) * GIB
    fits, seen = [], 0
    for lay in layouts(job, devices, machine, precision):
        seen += 1
        memory = worst_rank(cfg, lay)
        if memory.total > capacity:
            continue
        fits.append(Candidate(lay, memory, step_time(cfg, lay, machine, job.data.batch_size)))
    fits.sort(key=lambda c: -c.time.tokens_per_s_per_device)
    return fits, seen


def parse_layout(text: str, job: JobConfig, precision: str) -> PlanLayout:
    """A layout from its label (`PlanLayout.label`), e.g. tp8.pp4.dp32.1f1b.mb1x48.full."""
    from optimus.config import ConfigError

    degrees = {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "cp": 1, "virtual_stages": 1}
    fields = {"schedule": "1f1b", "recompute": "none", "microbatch_size": 1, "microbatches": 1,
              "param_gather": "microbatch", "cp_method": job.parallel.cp_method,
              "cp_split": job.parallel.cp_split}
    try:
        for part in text.split("."):
            if part == "gathered":
                fields["param_gather"] = "step"
            elif part in RECOMPUTE:
                fields["recompute"] = part
            elif part in CP_METHODS:
                fields["cp_method"] = part
            elif part in {s for s, _ in PIPELINES} | {"looped_bfs", "dualpipev"}:
                fields["schedule"] = part
            elif part.startswith("mb"):
                size, count = part[2:].split("x")
                fields["microbatch_size"], fields["microbatches"] = int(size), int(count)
            else:
                key = part.rstrip("0123456789")
                if key not in ("dp", "tp", "pp", "ep", "cp", "v"):
                    raise ValueError(part)
                degrees["virtual_stages" if key == "v" else key] = int(part[len(key):])
    except ValueError:
        raise ConfigError("--explain", f"cannot read layout {text!r}",
                          "write it as optimus plan prints it, e.g. "
                          "tp8.pp4.dp32.interleaved_1f1b.v2.mb1x48.full") from None
    try:
        dims = ParallelDims(**degrees)
    except ValueError as e:
        raise ConfigError("--explain", f"layout {text!r}: {e}") from None
    return PlanLayout(dims, seq_len=job.data.seq_len, precision=precision,
                      z_loss=job.optim.z_loss > 0, compiled=job.training.compile,
                      float8=job.training.float8 != "off", **fields)
