"""Start and stop the default process group from a `LaunchEnv`.

The store is built here rather than through env:// so that nothing depends on RANK or
WORLD_SIZE being exported: one process gets an in-memory HashStore, more processes a
TCPStore served by rank 0 (or by the launcher itself when it already runs one).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from optimus.runtime.launch import LaunchEnv


def init_distributed(
    env: LaunchEnv, backend: str, device: torch.device, timeout_s: float = 600
) -> None:
    """Create the default process group for this rank; a no-op when one already exists."""
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise RuntimeError(
                f"a process group already exists as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {env.rank} of {env.world_size}"
            )
        return
    timeout = timedelta(seconds=timeout_s)
    if device.type != "cpu":
        module = getattr(torch, device.type)
        if device.index is None:  # torch 2.11's set_device and device_id refuse a bare "cuda"
            device = torch.device(device.type, module.current_device())
        module.set_device(device)
    if env.world_size == 1:
        store: dist.Store = dist.HashStore()
    else:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.rank == 0 and not env.agent_store,
            timeout=timeout,
            wait_for_workers=False,
            multi_tenant=True,
        )
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        # Binding the group to the device connects eagerly; FSDP2 on xpu needs it.
        device_id=device if device.type != "cpu" else None,
    )


def destroy_distributed(abort: bool = False) -> None:
    """Tear down every process group; a no-op when there is none. `abort`: a collective failed
    (a peer is gone) and the rank goes on in process (optimus/inprocess.py): abort the
    communicators rather than let them drain, which on NCCL or XCCL can wait forever on the
    dead peer. (gloo's teardown does not wait; aborting it is as good.)"""
    if not dist.is_initialized():
        return
    abort_all = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort and abort_all is not None:
        with contextlib.suppress(RuntimeError):
            abort_all()  # every group, the default one included
    if dist.is_initialized():
        dist.destroy_process_group()
