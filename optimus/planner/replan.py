"""The layout a job runs on with fewer nodes than it was started with: its own, or the planner's.

When a node is lost and no spare is left, the controller may go on on the nodes that remain
(`supervision.when_no_spare: shrink`) instead of waiting. For each node count it asks
`replan`: the job file's own layout, its data-parallel degree shrunk to the devices left,
when the configuration accepts that world and the memory model says its largest rank fits;
otherwise the fastest layout of the same model and global batch that the planner finds on
those devices (another pp, tp inside a node, more microbatches, more recompute) and that
`optimus config check` accepts. The answer is the `--set` assignments that make the job file
that layout, or why no layout runs there. Every layout trains the same model exactly (the
layout matrix), and a checkpoint loads into any of them (DCP reshards), so the change costs
only the reshard from disk.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from optimus.config import ConfigError, JobConfig, check_job
from optimus.config.load import apply_override, validate_job
from optimus.planner.fit import job_layout, job_precision
from optimus.planner.machines import Machine
from optimus.planner.memory import PlanLayout, shape_of
from optimus.planner.search import plan, worst_rank
from optimus.planner.steptime import step_time

GIB = 2**30


@dataclass(frozen=True)
class Replanned:
    """How a job runs on `devices` devices."""

    devices: int
    label: str  # the planner's name of the layout (PlanLayout.label)
    overrides: tuple[str, ...]  # `--set` assignments; () when the job file's own layout runs
    tokens_per_s: float  # predicted for the whole job, on the machine profile asked
    gib: float  # the largest rank's predicted peak

    @property
    def own(self) -> bool:
        return not self.overrides

    def as_dict(self) -> dict:
        return {"devices": self.devices, "layout": self.label, "overrides": list(self.overrides),
                "tokens_per_s": round(self.tokens_per_s, 1), "gib": round(self.gib, 2)}


def overrides(lay: PlanLayout) -> tuple[str, ...]:
    """The job file's changes that make it `lay` (the global batch and the model untouched)."""
    out = [f"parallel.{name}={value}" for name, value in asdict(lay.dims).items()]
    out += [f"parallel.activation_checkpoint={lay.recompute}",
            f"parallel.param_gather={lay.param_gather}", f"data.microbatches={lay.microbatches}"]
    if lay.dims.cp > 1:  # with cp 1 the method is not used; left as written
        out.append(f"parallel.cp_method={lay.cp_method}")
    if lay.dims.pp > 1:  # with one stage the job's schedule is not used; left as written
        out.append(f"parallel.schedule={lay.schedule}")
    return tuple(out)


def with_overrides(job: JobConfig, assignments) -> JobConfig:
    """`job` with `--set` assignments applied, validated as a job file is (ConfigError)."""
    raw = job.model_dump(mode="json")
    for assignment in assignments:
        apply_override(raw, assignment)
    return validate_job(raw, source="the re-planned layout")


def replan(job: JobConfig, devices: int, ranks_per_node: int, machine: Machine,
           search: bool = True) -> Replanned | str:
    """How `job` runs on `devices` devices of `machine`, `ranks_per_node` to a node (tensor
    parallelism stays inside one), or why it cannot: the planner's reason. Without `search`,
    only the job's own layout is tried (what costs nothing: no planner search)."""
    precision = job_precision(job, machine.precision)
    capacity = machine.usable_gib * GIB
    cfg = shape_of(job.model)
    try:
        own = check_job(job, world=devices)
    except ConfigError:
        own = None
    if own is not None and ranks_per_node % own.tp == 0:
        lay = job_layout(job, own, precision)
        memory = worst_rank(cfg, lay)
        if memory.total <= capacity:
            return Replanned(devices, lay.label(), (), _tokens(cfg, lay, machine, job),
                             memory.total / GIB)
    if not search:
        return (f"the job's own layout does not run or fit on {devices} devices, and the "
                "planner was not asked (supervision.min_nodes: fewer counts)")
    node = machine.model_copy(update={"devices_per_node": ranks_per_node})
    fits, seen = plan(job, devices, node, precision, capacity / GIB)
    for candidate in fits:
        lay = candidate.layout
        if ranks_per_node % lay.dims.tp:
            continue
        assignments = overrides(lay)
        try:
            check_job(with_overrides(job, assignments), world=devices)
        except ConfigError:
            continue  # a rule the planner does not model (the job's own checks decide)
        return Replanned(devices, lay.label(), assignments,
                         candidate.time.tokens_per_s_per_device * devices,
                         candidate.memory.total / GIB)
    if not seen:
        return (f"no layout of this model and global batch ({job.data.batch_size} sequences) "
                f"divides {devices} devices")
    return (f"none of {seen} layouts on {devices} devices fits {machine.name}'s "
            f"{machine.usable_gib:g} GiB, or passes the job's checks")


def _tokens(cfg, lay: PlanLayout, machine: Machine, job: JobConfig) -> float:
    return step_time(cfg, lay, machine, job.data.batch_size).tokens_per_s_per_device * lay.devices
