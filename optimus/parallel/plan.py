"""Apply the job's layout to a freshly built model."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from optimus.config import Layout
from optimus.parallel.data_parallel import apply_data_parallel


def parallelize(model: nn.Module, layout: Layout, mesh: DeviceMesh) -> nn.Module:
    """Return the model ready to train on `mesh` under `layout` (dp only, so far)."""
    if layout.dp > 1:
        apply_data_parallel(model, mesh["dp"])
    return model
