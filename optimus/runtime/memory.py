"""How much memory a rank needed: its peaks per step, and the largest over all ranks.

On CUDA and XPU the caching allocator keeps two peaks: bytes held by tensors (allocated) and
bytes taken from the device (reserved: the tensors plus the allocator's cache, what an
out-of-memory error is about). The trainer resets both at the start of each step, so a reading
is that step's peak. A CPU has no such allocator; there both figures are the process's peak
resident set size, which nothing can reset: it is the peak so far, not the step's.
"""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist

ACCELERATORS = ("cuda", "xpu")
# max_over_ranks packs a rank into the low bits of each figure, so one MAX finds both the
# largest figure and its rank: 2**20 ranks, and up to 2**43 bytes (8 TiB) a rank.
RANK_BITS = 20
RANK_MASK = (1 << RANK_BITS) - 1


def peak_memory(device: torch.device) -> dict[str, int]:
    """This rank's peak allocated and reserved bytes since the last `reset_peak_memory` (on an
    accelerator), or on a CPU its peak resident set size so far, as both figures."""
    if device.type in ACCELERATORS:
        module = getattr(torch, device.type)
        return {"allocated_bytes": int(module.max_memory_allocated(device)),
                "reserved_bytes": int(module.max_memory_reserved(device))}
    rss = _peak_rss_bytes()
    return {"allocated_bytes": rss, "reserved_bytes": rss}


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak (an accelerator's); a no-op on a CPU, whose peak RSS cannot be reset."""
    if device.type in ACCELERATORS:
        getattr(torch, device.type).reset_peak_memory_stats(device)


def max_over_ranks(memory: dict[str, int], rank: int,
                   group: dist.ProcessGroup | None = None) -> dict[str, int]:
    """The largest of every rank's `peak_memory`, and a rank that had it (the lowest, on a tie):
    {"allocated_bytes", "allocated_rank", "reserved_bytes", "reserved_rank"}.

    One all-reduce of two integers in host memory over `group`, a host (gloo) group of every
    rank (optimus/runtime/dist.py `host_group`; None: the default group, under gloo), so every
    rank must call it at the same point and none waits on its device; with one rank, no
    collective."""
    figures = ("allocated_bytes", "reserved_bytes")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {**memory, "allocated_rank": rank, "reserved_rank": rank}
    low = RANK_MASK - rank  # inverted: of equal figures, the MAX keeps the lowest rank's
    packed = torch.tensor([(memory[f] << RANK_BITS) | low for f in figures], dtype=torch.int64)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    out = {}
    for name, value in zip(figures, packed.tolist(), strict=True):
        out[name] = value >> RANK_BITS
        out[name.replace("_bytes", "_rank")] = RANK_MASK - (value & RANK_MASK)
    return out


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux counts kibibytes
