"""The layout: parallel degrees, checked once, and the one named DeviceMesh built from them.

Rank order, outermost first: pp, edp, ep, tp. Data parallelism is dp = edp x ep: experts shard
over `ep` and borrow those ranks from data parallelism, their gradients and optimizer state
shard over the expert-data-parallel `edp`. "dp" is exposed as a flattened mesh dimension over
("edp", "ep"), so `mesh["pp"]`, `mesh["dp"]`, `mesh["edp"]`, `mesh["ep"]` and `mesh["tp"]`
all exist, size 1 included.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "edp", "ep", "tp")
AXES = ("pp", "dp", "edp", "ep", "tp")

# torch 2.13 still resolves a flattened name sliced from the root mesh (mesh["dp"]), but warns
# that this "will be deprecated"; it is how this layout names dp, so the warning is noise.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of one job: data, tensor, pipeline and expert parallelism."""

    dp: int
    tp: int
    pp: int
    ep: int
    world_size: int

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "ep", "world_size"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{axis} must be a positive integer, got {value!r}")
        model = self.tp * self.pp
        if self.dp * model != self.world_size:
            fix = (
                f"set dp={self.world_size // model}"
                if self.world_size % model == 0
                else f"choose tp and pp whose product divides {self.world_size}"
            )
            raise ValueError(
                f"dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.dp * model} ranks, but "
                f"the world has {self.world_size}: {fix}"
            )
        if self.dp % self.ep:
            choices = [n for n in range(1, self.dp + 1) if self.dp % n == 0]
            raise ValueError(
                f"ep={self.ep} does not divide dp={self.dp}: experts borrow their ranks from "
                f"data parallelism, so choose ep among {choices} or change dp"
            )

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the replicas of each expert shard."""
        return self.dp // self.ep

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def edp_enabled(self) -> bool:
        return self.edp > 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.edp, self.ep, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """Each axis' coordinate of a global rank, by arithmetic alone."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        rest, tp = divmod(rank, self.tp)
        rest, ep = divmod(rest, self.ep)
        pp, edp = divmod(rest, self.edp)
        return {"pp": pp, "dp": edp * self.ep + ep, "edp": edp, "ep": ep, "tp": tp}

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the world's DeviceMesh; the default process group must already exist."""
        if not dist.is_initialized():
            raise RuntimeError("no process group: call init_distributed before build_mesh")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"the layout needs {self.world_size} ranks but the process group has "
                f"{dist.get_world_size()}"
            )
        with _unbound_if_unsplittable():
            mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_DIMS)
            mesh["edp", "ep"]._flatten("dp")
        _BUILT.append(weakref.ref(mesh))
        return mesh


# The root meshes this process built, by identity (DeviceMesh's own equality calls two
# generations' meshes of one shape the same): whether one outlived its generation. Every
# submesh and flattened mesh holds its root, so none is alive once these are gone.
_BUILT: list[weakref.ref] = []


def meshes_alive() -> bool:
    """Whether a mesh this process built (or one derived from it) is still alive."""
    _BUILT[:] = [ref for ref in _BUILT if ref() is not None]
    return bool(_BUILT)


def own_group(mesh: DeviceMesh, axes: tuple[str, ...]) -> dist.ProcessGroup | None:
    """This rank's group over the mesh axes `axes` (of MESH_DIMS), as a process group of its
    own that no other collective uses; None when it would hold this rank alone. Every rank
    must call it (it creates every such group), with the same axes.

    DeviceMesh may hand out one process group for two axes over the same ranks, and FSDP
    issues its collectives on dp asynchronously, from autograd hooks: a collective of our own
    on a shared group can then interleave differently on different ranks (a mismatch, or a
    hang). So what the layers exchange in their forward gets a group of its own."""
    names = mesh.mesh_dim_names
    if unknown := [a for a in axes if a not in MESH_DIMS]:
        raise ValueError(f"{unknown} are not mesh dims; use some of {MESH_DIMS}")
    size = 1
    for axis in axes:
        size *= mesh[axis].size()
    if size == 1:
        return None
    inner = [names.index(a) for a in axes]
    outer = [i for i in range(len(names)) if i not in inner]
    grid = mesh.mesh.permute(*outer, *inner).reshape(-1, size)
    mine, _ = dist.new_subgroups_by_enumeration([row.tolist() for row in grid])
    return mine


@contextmanager
def _unbound_if_unsplittable() -> Iterator[None]:
    """Let DeviceMesh create sub-groups with new_group when the backend cannot split.

    With a device-bound default group, DeviceMesh creates sub-groups with split_group, which
    xccl refuses in torch 2.13 ("does not support splitting", pytorch#186548). Unbinding
    the default group meanwhile makes it fall back to new_group, as ezpz does on Aurora.
    """
    group = dist.distributed_c10d._get_default_group()
    bound = group.bound_device_id
    if bound is None or group._get_backend(bound).supports_splitting:
        yield
        return
    group.bound_device_id = None
    try:
        yield
    finally:
        group.bound_device_id = bound
