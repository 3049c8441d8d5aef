"""The layout: a job's parallel degrees, checked once, and the ranks each purpose spans.

One `ParallelDims` is the layout everywhere: the config check resolves a job's on its world
(optimus/config/checks.py), the planner searches them (optimus/planner/search.py), and each
rank builds its mesh from one (`build_mesh`: a `LayoutMesh`, optimus/runtime/mesh.py). It is
plain Python: torch loads only when a mesh is built.

Rank order, outermost first: pp, edp, ep, tp (`MESH_DIMS`). Data parallelism is dp = edp x ep:
experts shard over `ep` and borrow those ranks from data parallelism, their gradients and
optimizer state shard over the expert-data-parallel `edp`. "dp" is those two flattened.

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

MESH_DIMS = ("pp", "edp", "ep", "tp")  # the mesh's own dimensions, outermost first
FLATTENED = {"dp": ("edp", "ep")}  # dimensions made of several, flattened in the mesh

# Each purpose: the dimensions its ranks span, in the order a sum over it reduces them.
PURPOSES: dict[str, tuple[str, ...]] = {
    # Ranks whose figures add up.
    "batch": ("dp",),  # read different samples: the loader's and validation's slices
    "tokens": ("dp",),  # hold different tokens of a step: the token count sums over them
    "loss": ("pp", "dp"),  # hold shares of the step's loss: each replica's last stage
    "world": ("dp", "pp", "tp"),  # every rank, a dimension at a time: the experts' load
    # Ranks that split something.
    "pipeline": ("pp",),  # the stages of one pipeline
    "tensor": ("tp",),  # each tensor-parallel matmul, and the vocabulary of the loss
    "sequence": ("tp",),  # the positions of one sequence (sequence parallel)
    "stage": ("dp", "tp"),  # the tokens of one pipeline stage's global batch
    "shard": ("dp",),  # the dense weights, their gradients and optimizer state (FSDP2)
    "experts": ("ep",),  # the experts (expert parallel)
    "expert_shard": ("edp",),  # each expert's weights (FSDP2): its replicas
}


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of one job: data, tensor, pipeline and expert parallelism, and the
    pipeline stages each pipeline rank holds. The fields are named as the job file's
    `parallel` keys (`of`, the planner's `--set` assignments and checkpoints' manifests read
    them by name)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            choices = [n for n in range(1, self.dp + 1) if self.dp % n == 0]
            raise ValueError(
                f"ep={self.ep} does not divide dp={self.dp}: experts borrow their ranks from "
                f"data parallelism, so choose ep among {choices} or change dp"
            )

    @classmethod
    def of(cls, section: object, **given: int) -> ParallelDims:
        """The degrees `section` names (an attribute per field: a job's `parallel` section),
        those `given` in their place."""
        return cls(**{f.name: getattr(section, f.name) for f in fields(cls)} | given)

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the replicas of each expert shard."""
        return self.dp // self.ep

    @property
    def stages(self) -> int:
        """The pipeline's stages: virtual_stages on each pipeline rank."""
        return self.pp * self.virtual_stages

    @property
    def world_size(self) -> int:
        return prod(self.degree(dim) for dim in MESH_DIMS)

    def degree(self, dim: str) -> int:
        """How many ranks one dimension (of MESH_DIMS or FLATTENED) spans."""
        if dim in FLATTENED:
            return prod(self.degree(d) for d in FLATTENED[dim])
        if dim == "edp":
            return self.edp
        if dim not in MESH_DIMS:
            raise ValueError(f"{dim!r} is not a dimension; use one of {MESH_DIMS}")
        return getattr(self, dim)

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
        for name, inner in FLATTENED.items():
            out[name] = 0
            for dim in inner:
                out[name] = out[name] * self.degree(dim) + out[dim]
        return out

    def key(self) -> str:
        """The degrees as one string: per-rank state (checkpoints' RNG, memory snapshots)
        restores only where it matches. Checkpoints hold it, so a layout's key stays what it
        was (a new dimension would add itself only where it is not 1)."""
        return f"dp{self.dp}.tp{self.tp}.pp{self.pp}.ep{self.ep}.vs{self.virtual_stages}"

    def build_mesh(self, device_type: str) -> LayoutMesh:
        """This world's mesh; the default process group must already exist."""
        from optimus.runtime.mesh import LayoutMesh

        return LayoutMesh.build(self, device_type)


def spans(purpose: str) -> tuple[str, ...]:
    """The dimensions a purpose spans (PURPOSES)."""
    if purpose not in PURPOSES:
        raise ValueError(f"{purpose!r} is not a purpose; use one of {sorted(PURPOSES)}")
    return PURPOSES[purpose]
