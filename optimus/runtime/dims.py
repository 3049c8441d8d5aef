"""The layout: a job's parallel degrees, checked once, and the ranks each purpose spans.

One `ParallelDims` is the layout everywhere: the config check resolves a job's on its world
(optimus/config/checks.py), the planner searches them (optimus/planner/search.py), and each
rank builds its mesh from one (`build_mesh`: a `LayoutMesh`, optimus/runtime/mesh.py). It is
plain Python: torch loads only when a mesh is built.

Rank order, outermost first: pp, rep, edp, epd, cp, tp (`MESH_DIMS`). Data parallelism is
dp = rep x edp x epd: `replicas` (rep) whole copies of the model, each sharded over its own
ranks (HSDP: FSDP2 shards inside a replica, the gradients are all-reduced across replicas),
and context parallelism cp splits each sequence over neighbouring ranks. Experts borrow their
ranks from the data- and context-parallel ones of a replica: an experts' group is epd x cp
(every context-parallel rank of a data-parallel rank joins it, as in torchtitan), their
gradients and optimizer state shard over the expert-data-parallel `edp`. "dp", "ep", "fsdp"
(the dense weights' shard group inside a replica: its data and context parallel ranks
together, as torchtitan folds cp into FSDP) and "eshard" (an expert's shard group) are
flattened from the mesh's own dimensions (`ParallelDims.inner`).

Code asks for the ranks of a purpose (`PURPOSES`), never for a dimension by name: the ranks
whose losses add up, those reading different samples, those the weights shard over. A new
dimension changes what some purposes span, here, not the code that asks for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from math import prod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optimus.runtime.mesh import LayoutMesh

MESH_DIMS = ("pp", "rep", "edp", "epd", "cp", "tp")  # the mesh's own dimensions, outermost first
FLATTENED = ("dp", "ep", "fsdp", "eshard")  # dimensions made of several (`ParallelDims.inner`)

# Each purpose: the dimensions its ranks span, in the order a sum over it reduces them.
PURPOSES: dict[str, tuple[str, ...]] = {
    # Ranks whose figures add up.
    "batch": ("dp",),  # read different samples: the loader's and validation's slices
    "tokens": ("dp",),  # count a step's labelled tokens, each over whole sequences
    "loss": ("pp", "dp", "cp"),  # hold shares of the step's loss: each replica's last stage
    "world": ("dp", "cp", "pp", "tp"),  # every rank, a dimension at a time: the experts' load
    # Ranks that split something.
    "pipeline": ("pp",),  # the stages of one pipeline
    "tensor": ("tp",),  # each tensor-parallel matmul, and the vocabulary of the loss
    "context": ("cp",),  # the positions of each sequence (context parallel)
    "sequence": ("cp", "tp"),  # the positions of one sequence: context and sequence parallel
    "stage": ("dp", "cp", "tp"),  # the tokens of one pipeline stage's global batch
    "shard": ("fsdp",),  # the dense weights, their gradients and optimizer state (FSDP2)
    "replicas": ("rep",),  # the copies of the model, each sharded over its "shard" (HSDP)
    "experts": ("ep",),  # the experts (expert parallel)
    "expert_shard": ("eshard",),  # each expert's weights (FSDP2): its replicas
}


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of one job: data, tensor, pipeline, expert and context parallelism,
    and the pipeline stages each pipeline rank holds. The fields are named as the job file's
    `parallel` keys (`of`, the planner's `--set` assignments and checkpoints' manifests read
    them by name)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    virtual_stages: int = 1
    cp: int = 1
    replicas: int = 1

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dp % self.replicas:
            raise ValueError(
                f"replicas={self.replicas} does not divide dp={self.dp}: each replica holds "
                f"dp / replicas ranks, so choose replicas among "
                f"{[n for n in range(1, self.dp + 1) if self.dp % n == 0]}")
        if self.ep > 1 and self.ep % self.cp:
            raise ValueError(
                f"ep={self.ep} is not a multiple of cp={self.cp}: experts borrow whole "
                f"context-parallel groups, so choose ep among {self._ep_choices()} or 1")
        if self.shard_dp % self.epd:
            borrowed = f" (ep / cp = {self.epd})" if self.cp > 1 else ""
            what = "dp" if self.replicas == 1 else "a replica's dp (dp / replicas)"
            raise ValueError(
                f"ep={self.ep} does not divide {what}={self.shard_dp}{borrowed}: experts "
                f"borrow their ranks from data parallelism, so choose ep among "
                f"{self._ep_choices()} or change dp"
            )

    def _ep_choices(self) -> list[int]:
        return [n * self.cp for n in range(1, self.shard_dp + 1) if self.shard_dp % n == 0]

    @classmethod
    def of(cls, section: object, **given: int) -> ParallelDims:
        """The degrees `section` names (an attribute per field: a job's `parallel` section),
        those `given` in their place."""
        return cls(**{f.name: getattr(section, f.name, f.default) for f in fields(cls)}
                   | given)

    @property
    def epd(self) -> int:
        """The data-parallel ranks of one experts' group (its context-parallel ranks are the
        rest of it)."""
        return self.ep // self.cp if self.ep > 1 else 1

    @property
    def shard_dp(self) -> int:
        """The data-parallel ranks of one replica."""
        return self.dp // self.replicas

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the data-parallel copies of each expert shard in a
        replica."""
        return self.shard_dp // self.epd

    @property
    def stages(self) -> int:
        """The pipeline's stages: virtual_stages on each pipeline rank."""
        return self.pp * self.virtual_stages

    @property
    def world_size(self) -> int:
        return prod(self.degree(dim) for dim in MESH_DIMS)

    def inner(self, dim: str) -> tuple[str, ...]:
        """The mesh dimensions (MESH_DIMS) a dimension is made of, outermost first."""
        if dim == "dp":
            return ("rep", "edp", "epd")
        if dim == "ep":
            return ("epd", "cp") if self.ep > 1 else ("epd",)
        if dim == "fsdp":
            return ("edp", "epd", "cp")
        if dim == "eshard":  # without expert parallelism experts shard as the dense weights
            return ("edp",) if self.ep > 1 else ("edp", "epd", "cp")
        if dim not in MESH_DIMS:
            raise ValueError(f"{dim!r} is not a dimension; use one of {MESH_DIMS + FLATTENED}")
        return (dim,)

    def degree(self, dim: str) -> int:
        """How many ranks one dimension (of MESH_DIMS or FLATTENED) spans."""
        inner = self.inner(dim)
        if len(inner) > 1:
            return prod(self.degree(d) for d in inner)
        return self.replicas if inner[0] == "rep" else getattr(self, inner[0])

    def size(self, purpose: str) -> int:
        """How many ranks a purpose spans."""
        return prod(self.degree(dim) for dim in spans(purpose))

    def coords(self, rank: int) -> dict[str, int]:
        """Each dimension's coordinate of a global rank, by arithmetic alone."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        out, rest = {}, rank
        for dim in reversed(MESH_DIMS):
            rest, out[dim] = divmod(rest, self.degree(dim))
        for name in FLATTENED:
            out[name] = 0
            for dim in self.inner(name):
                out[name] = out[name] * self.degree(dim) + out[dim]
        return out

    def key(self) -> str:
        """The degrees as one string: per-rank state (checkpoints' RNG, memory snapshots)
        restores only where it matches. Checkpoints hold it, so a layout's key stays what it
        was: a dimension added later names itself only where it is not 1."""
        key = f"dp{self.dp}.tp{self.tp}.pp{self.pp}.ep{self.ep}.vs{self.virtual_stages}"
        return (key + (f".cp{self.cp}" if self.cp > 1 else "")
                + (f".r{self.replicas}" if self.replicas > 1 else ""))

    def build_mesh(self, device_type: str) -> LayoutMesh:
        """This world's mesh; the default process group must already exist."""
        from optimus.runtime.mesh import LayoutMesh

        return LayoutMesh.build(self, device_type)


def spans(purpose: str) -> tuple[str, ...]:
    """The dimensions a purpose spans (PURPOSES)."""
    if purpose not in PURPOSES:
        raise ValueError(f"{purpose!r} is not a purpose; use one of {sorted(PURPOSES)}")
    return PURPOSES[purpose]
