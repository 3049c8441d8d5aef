"""Start and stop the default process group from a `LaunchEnv`.

The store is built here rather than through env:// so that nothing depends on RANK or
WORLD_SIZE being exported: one process gets an in-memory HashStore, more processes a
TCPStore served by rank 0 (or by the launcher itself when it already runs one).

A client that comes before its store listens waits for the listener here, looking often,
before it connects: torch's own client retries a refused connection after a growing, jittered
pause (~0.5-0.7 s measured on torch 2.13 for a store that came 0.05-0.5 s late), which a
restart pays whenever a new rank is quicker than rank 0 (a rank forked from a warm process
enters in ~30 ms; rank 0 going on in process picks up its word at the same moment).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from optimus.runtime.launch import LaunchEnv


def init_distributed(
    env: LaunchEnv, backend: str, device: torch.device, timeout_s: float = 600,
    serve_store: bool = False,
) -> None:
    """Create the default process group for this rank; a no-op when one already exists.
    `serve_store`: rank 0 serves a TCPStore at master_addr:master_port even in a world of one
    (a replica's world: its store is where the quorum's groups meet when it is the lowest
    member, optimus/parallel/replicas.py)."""
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
    if env.world_size == 1 and not serve_store:
        store: dist.Store = dist.HashStore()
    else:
        is_master = env.rank == 0 and not env.agent_store
        if not is_master:
            await_listener(env.master_addr, env.master_port, env.world_size, timeout_s)
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=is_master,
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


def await_listener(host: str, port: int, world_size: int, timeout_s: float) -> None:
    """Wait until `host:port` takes a TCP connection (the store is listening). A refused
    connection is looked at again after 2 ms, doubling up to 10 ms for a few ranks and 1 s from
    10,000 ranks on, jittered: a job of 100 to 10,000 ranks knocks ~10,000 times a second at
    most, a larger one once a second a rank, as torch's own retries do. An address that cannot
    be reached returns at once: the store's own connect says why. Raises DistNetworkError (a peer's
    failure to optimus/supervision/inprocess.py, as the store's own timeout is) after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pause, cap = 0.002, min(1.0, max(0.01, world_size / 10_000))
    while (left := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host, port), timeout=min(1.0, left)):
                return
        except (ConnectionRefusedError, ConnectionResetError):
            time.sleep(min(left, pause * random.uniform(0.5, 1.0)))
            pause = min(cap, pause * 2)
        except OSError:  # unresolvable, unreachable, filtered
            return
    raise dist.DistNetworkError(f"the store at {host}:{port} (rank 0's) did not take a "
                                f"connection within {timeout_s:g} s: timed out")


def destroy_distributed(abort: bool = False) -> None:
    """Tear down every process group; a no-op when there is none. `abort`: a collective failed
    (a peer is gone) and the rank goes on in process (optimus/supervision/inprocess.py): abort the
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


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions (a rank going on in process, before its
    next generation builds new meshes). A DeviceMesh equals another of the same shape and
    names whatever rank holds it, so a cached decision made with the last generation's mesh
    would come back for the next one's, carrying the old mesh and its coordinate: a rank that
    changed rank would compute the old rank's shard (its saves then fail DCP's plan check,
    its steps read the wrong rows). The caches refill in the first step. So do compiled
    graphs, which guard on meshes the same way."""
    from torch.distributed.tensor import DTensor

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # the C++ fast path's own cache (torch >= 2.8)
        clear_native()
    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    from torch.distributed.tensor import _collective_utils, _redistribute

    for cached in (getattr(propagator, "propagate_op_sharding", None),
                   getattr(propagator, "_propagate_tensor_meta_cached", None),
                   getattr(_redistribute, "_gen_transform_infos", None),
                   getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh",
                           None)):
        # torch 2.11 keeps the propagator's cache per thread (its `cache`: this thread's, the
        # one training ran in); 2.13 a plain lru_cache. Missed, 2.11 kept every generation's
        # meshes, and with them their process groups (their threads and sockets), and handed
        # a new generation the last one's decisions.
        for clear in (getattr(cached, "cache_clear", None),
                      getattr(getattr(cached, "cache", None), "cache_clear", None)):
            if clear is not None:
                clear()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:  # torch 2.11: a redistribution planner per mesh, kept
        clear_planners()
    if "torch._dynamo" in sys.modules:  # compiled graphs guard on (and bake in) meshes too;
        torch._dynamo.reset()  # recompiling is cheap from Inductor's on-disk cache


def drop_stale_groups() -> int:
    """Between generations, after `forget_meshes` and a collection: every DeviceMesh still
    alive is the last generation's, held by some cache of torch's; each lets go of its process
    groups (torch 2.11's meshes keep them in `_pg_registry`), so that the groups' threads and
    sockets go with them. Returns how many meshes held some. Without it, in-process restarts
    on 2.11 kept ~12 threads and ~20 descriptors a generation (tests/test_inprocess.py's
    twenty generations). The walk over every object (~0.1-0.3 s, on an in-process restart's
    path when the next plan comes quickly) is skipped when no mesh outlived the collection."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    from optimus.runtime.mesh import meshes_alive

    if not meshes_alive():
        return 0
    held = 0
    for obj in gc.get_objects():
        registry = getattr(obj, "_pg_registry", None) if isinstance(obj, DeviceMesh) else None
        if isinstance(registry, dict) and registry:
            registry.clear()
            held += 1
    return held



def host_group(backend: str) -> dist.ProcessGroup | None:
    """A group of every rank whose collectives run on the host: what the step boundary agrees
    on (commands, the peak memory a logged step reports) never waits on the device. Under gloo
    that is the default group (None); under nccl or xccl a gloo group beside it. Collective:
    every rank makes it, at the same point.

    Its connections are made as its collectives first need them (TORCH_GLOO_LAZY_INIT, torch
    2.7 and later), not all at once: a gloo group made eagerly connects every pair of ranks,
    which at thousands of ranks is millions of sockets, where an all-reduce needs a few peers
    each."""
    if backend == "gloo" or dist.get_world_size() == 1:
        return None
    before = os.environ.get(LAZY_GLOO)
    os.environ[LAZY_GLOO] = "1"  # read as the group is made
    try:
        return dist.new_group(backend="gloo")
    finally:
        if before is None:
            os.environ.pop(LAZY_GLOO)
        else:
            os.environ[LAZY_GLOO] = before


LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"
