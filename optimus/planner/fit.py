"""Will a job fit? The memory model applied to a job file's own layout, and the fixes to try.

`optimus config check --machine/--memory-gib` calls `check_fits`; it refuses a job whose
largest rank needs more than the device holds, naming the term that overflows and changes of
the job file that the same model says would fit.
"""

from __future__ import annotations

from dataclasses import replace

from optimus.config import ConfigError, JobConfig
from optimus.config.schedule_rules import schedule_problem
from optimus.planner.memory import Memory, PlanLayout, peak_memory
from optimus.runtime.dims import ParallelDims

GIB = 2**30
_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
           "activations": "activations", "logits": "logits of the loss",
           "gathered": "gathered parameters", "backward": "backward working memory",
           "slack": "slack"}


def job_layout(job: JobConfig, layout: ParallelDims, precision: str) -> PlanLayout:
    """The planner's view of a job file on its resolved layout."""
    d, p = job.data, job.parallel
    per_replica = d.batch_size // (layout.size("batch") * d.microbatches)
    return PlanLayout(layout, schedule=p.schedule, microbatches=d.microbatches,
                      microbatch_size=max(1, per_replica),
                      seq_len=d.seq_len, recompute=p.activation_checkpoint,
                      ac_every=p.ac_every, precision=precision, param_gather=p.param_gather,
                      z_loss=job.optim.z_loss > 0, cp_method=p.cp_method,
                      cp_split=p.cp_split, compiled=job.training.compile,
                      float8=job.training.float8 != "off")


def job_precision(job: JobConfig, machine_precision: str = "bf16") -> str:
    """fp32 or bf16: the job's choice, or on `auto` what the machine runs (bf16 on
    accelerators, fp32 on a CPU)."""
    chosen = job.training.mixed_precision
    return machine_precision if chosen == "auto" else chosen


def fixes(cfg, lay: PlanLayout, capacity: float) -> list[str]:
    """Changes of the job file, one at a time, after which the model says it fits."""
    out = []
    if lay.param_gather == "step" and lay.dims.dp > 1 and peak_memory(
            cfg, replace(lay, param_gather="microbatch")).total <= capacity:
        out.append("parallel.param_gather: microbatch")
    order = ("none", "selective", "op", "full")  # ever less kept
    for mode in order[order.index(lay.recompute) + 1:]:
        if peak_memory(cfg, replace(lay, recompute=mode)).total <= capacity:
            out.append(f"parallel.activation_checkpoint: {mode}")
            break
    if lay.microbatch_size > 1:
        size = lay.microbatch_size
        while size > 1:
            size //= 2
            more = lay.microbatches * lay.microbatch_size // size
            if peak_memory(cfg, replace(lay, microbatch_size=size,
                                        microbatches=more)).total <= capacity:
                out.append(f"data.microbatches: {more}")
                break
    if lay.microbatches > 1 and lay.dims.pp == 1 and lay.dims.dp > 1:
        # FSDP2 accumulates unsharded gradients across microbatches; one microbatch of the
        # same sequences reduce-scatters each block's gradient as it is made
        whole = replace(lay, microbatch_size=lay.microbatch_size * lay.microbatches,
                        microbatches=1)
        if peak_memory(cfg, whole).total <= capacity:
            out.append("data.microbatches: 1")
    for axis in ("pp", "tp"):
        for times in (2, 4, 8):  # the smallest growth that fits, dp shrinking to match
            if lay.dims.dp % times or (lay.dims.dp // times) % lay.dims.ep:
                break
            # the job file's one change: the same global batch and data.microbatches over
            # fewer replicas, so each microbatch holds `times` more sequences
            dims = replace(lay.dims, **{axis: getattr(lay.dims, axis) * times,
                                        "dp": lay.dims.dp // times})
            grown = replace(lay, dims=dims, microbatch_size=lay.microbatch_size * times)
            if axis == "pp" and (cfg.n_layers < dims.stages or schedule_problem(
                    grown.schedule, dims.pp, dims.virtual_stages, grown.microbatches)):
                break
            if axis == "tp" and (cfg.n_heads % dims.tp or cfg.ffn_dim % dims.tp
                                 or cfg.vocab_size % dims.tp):
                break
            if peak_memory(cfg, grown).total <= capacity:
                out.append(f"parallel.{axis}: {getattr(dims, axis)} (dp {dims.dp})")
                break
    return out


def more_devices(cfg, lay: PlanLayout, capacity: float) -> int | None:
    """The fewest devices (dp doubled up to 8 times, the global batch kept) on which the job
    fits, by the same model; None when growing dp does not make it fit (what it does not
    shard: the activations, the unsharded gradients a step accumulates)."""
    grown = lay
    for _ in range(8):
        if grown.microbatch_size * grown.microbatches % 2:
            return None
        wider = replace(grown.dims, dp=grown.dims.dp * 2)
        if grown.microbatches % 2 == 0:
            grown = replace(grown, dims=wider, microbatches=grown.microbatches // 2)
        else:
            grown = replace(grown, dims=wider, microbatch_size=grown.microbatch_size // 2)
        if peak_memory(cfg, grown).total <= capacity:
            return grown.devices
    return None


def check_fits(job: JobConfig, layout: ParallelDims, capacity_gib: float, device: str,
               precision: str, source: str = "job") -> Memory:
    """The largest rank's memory; ConfigError when it exceeds `capacity_gib`."""
    lay = job_layout(job, layout, precision)
    memory = peak_memory(job.model, lay)
    capacity = capacity_gib * GIB
    if memory.total <= capacity:
        return memory
    term, size = memory.largest()
    found = fixes(job.model, lay, capacity)
    if not found:  # name more devices only where the model says they make it fit
        devices = more_devices(job.model, lay, capacity)
        if devices:
            found = [f"{devices} devices (a larger dp shards the state; the same global batch)"]
    fix = " or ".join(found) if found else (
        "none of the changes the planner tries fits (recompute, smaller microbatches, one "
        "microbatch, more tp or pp, more devices): a smaller model or data.batch_size, or a "
        "device with more memory; `optimus plan` ranks what fits")
    where = f" (pipeline rank {memory.pp_rank})" if lay.dims.pp > 1 else ""
    raise ConfigError(source, f"needs {memory.total / GIB:.1f} GiB per rank{where} on {device} "
                      f"with {capacity_gib:g} GiB: {_LABELS[term]} {size / GIB:.1f} GiB", fix)
