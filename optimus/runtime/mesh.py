"""The layout's DeviceMesh, asked for by purpose.

`ParallelDims.build_mesh` builds one named DeviceMesh over the world (optimus/runtime/dims.py
orders its dimensions) and wraps it in a `LayoutMesh`: the trainer, validation and the plans
ask it for the mesh, the process group, the rank or a sum of a purpose ("loss", "batch",
"shard", "experts", ...), and only this module and dims.py name the dimensions behind one.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from math import prod

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from optimus.runtime.dims import FLATTENED, MESH_DIMS, ParallelDims, spans

# torch 2.13 still resolves a flattened name sliced from the root mesh (mesh["dp"]), but warns
# that this "will be deprecated"; it is how this layout names dp, so the warning is noise.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


class LayoutMesh:
    """One world's DeviceMesh and the layout it was built from, answering by purpose."""

    def __init__(self, dims: ParallelDims, device_mesh: DeviceMesh):
        self.dims = dims
        self.device_mesh = device_mesh
        self._sliced: dict[str, DeviceMesh] = {}
        names = device_mesh.mesh_dim_names
        # The mesh's flattened dimensions, by the dimensions of the mesh they are made of (the
        # first of FLATTENED made of them: `build` flattens it alone).
        self._flattened: dict[tuple[str, ...], str] = {}
        for name in FLATTENED:
            if len(inner := _present(dims, name, names)) > 1:
                self._flattened.setdefault(inner, name)

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str) -> LayoutMesh:
        """Build the world's mesh; the default process group must already exist."""
        if not dist.is_initialized():
            raise RuntimeError("no process group: call init_distributed before build_mesh")
        if dist.get_world_size() != dims.world_size:
            raise ValueError(
                f"the layout needs {dims.world_size} ranks ({dims.key()}) but the process "
                f"group has {dist.get_world_size()}"
            )
        # Each dimension is a process group to make, at every generation: those of one rank
        # are left out (but pp, edp and tp, which a one-process mesh keeps), and a flattened
        # one is made only of two or more and only once (`_present`).
        names = tuple(d for d in MESH_DIMS if d in ALWAYS or dims.degree(d) > 1)
        shape = tuple(dims.degree(dim) for dim in names)
        with _unbound_if_unsplittable():
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
            made = set()
            for name in FLATTENED:
                inner = _present(dims, name, names)
                if len(inner) > 1 and inner not in made:
                    mesh[inner]._flatten(name)
                    made.add(inner)
        _BUILT.append(weakref.ref(mesh))
        return cls(dims, mesh)

    def size(self, purpose: str) -> int:
        return self.dims.size(purpose)

    def mesh(self, purpose: str) -> DeviceMesh:
        """The one-dimensional mesh of a purpose that spans one dimension (DTensor and FSDP2
        shard over it)."""
        dims = spans(purpose)
        if len(dims) != 1:
            raise ValueError(f"{purpose!r} spans {dims}: sum over it with `all_reduce`, or "
                             "take its `own_group`")
        return self._dim(dims[0])

    def mesh_of(self, *purposes: str) -> DeviceMesh:
        """The mesh of several one-dimension purposes, one mesh dimension each, in the order
        given (HSDP's (replicas, shard))."""
        return self.device_mesh[tuple(self._name(spans(p)[0]) for p in purposes)]

    def group(self, purpose: str) -> dist.ProcessGroup:
        return self.mesh(purpose).get_group()

    def rank(self, purpose: str) -> int:
        """This rank's place among the ranks of a purpose."""
        if self.size(purpose) == 1:
            return 0
        return self.mesh(purpose).get_local_rank()

    def all_reduce(self, purpose: str, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over the ranks of a purpose, one dimension after another
        (those of one rank skipped); returns it."""
        for dim in spans(purpose):
            if self.dims.degree(dim) > 1:
                dist.all_reduce(tensor, group=self._dim(dim).get_group())
        return tensor

    def own_group(self, purpose: str) -> dist.ProcessGroup | None:
        """This rank's group over the ranks of a purpose, as a process group of its own that
        no other collective uses; None when it would hold this rank alone. Every rank must
        call it (it creates every such group), with the same purpose.

        DeviceMesh may hand out one process group for two dimensions over the same ranks, and
        FSDP issues its collectives on dp asynchronously, from autograd hooks: a collective of
        our own on a shared group can then interleave differently on different ranks (a
        mismatch, or a hang). So what the layers exchange in their forward gets a group of
        its own."""
        names = self.device_mesh.mesh_dim_names
        dims = [d for dim in spans(purpose) for d in _present(self.dims, dim, names)]
        size = prod(self.dims.degree(d) for d in dims)
        if size == 1:
            return None
        inner = [names.index(d) for d in dims]
        outer = [i for i in range(len(names)) if i not in inner]
        grid = self.device_mesh.mesh.permute(*outer, *inner).reshape(-1, size)
        mine, _ = dist.new_subgroups_by_enumeration([row.tolist() for row in grid])
        return mine

    def _dim(self, dim: str) -> DeviceMesh:
        if dim not in self._sliced:
            self._sliced[dim] = self.device_mesh[self._name(dim)]
        return self._sliced[dim]

    def _name(self, dim: str) -> str:
        """The mesh's name for a dimension: its own, the flattened one made of the same ranks,
        or the one of its dimensions that is in the mesh."""
        inner = _present(self.dims, dim, self.device_mesh.mesh_dim_names)
        if not inner:
            raise ValueError(f"{dim!r} spans one rank here ({self.dims.key()}): it has no "
                             "mesh; ask for its rank or size")
        return inner[0] if len(inner) == 1 else self._flattened[inner]


ALWAYS = ("pp", "edp", "tp")  # the mesh's dimensions even where they span one rank


def _present(dims: ParallelDims, dim: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The dimensions of the mesh (`names`) a dimension is made of."""
    return tuple(d for d in dims.inner(dim) if d in names)


# The root meshes this process built, by identity (DeviceMesh's own equality calls two
# generations' meshes of one shape the same): whether one outlived its generation. Every
# submesh and flattened mesh holds its root, so none is alive once these are gone.
_BUILT: list[weakref.ref] = []


def meshes_alive() -> bool:
    """Whether a mesh this process built (or one derived from it) is still alive."""
    _BUILT[:] = [ref for ref in _BUILT if ref() is not None]
    return bool(_BUILT)


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
