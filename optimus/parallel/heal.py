"""What a heal carries between replicas (optimus/parallel/replicas.py), and how it is checked:
the state's tensors packed one buffer per dtype, a checksum of each, and the host-side state
(progress, the stability rules' history) as one bounded JSON message."""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

HOST = torch.device("cpu")
NO_TIMEOUT = timedelta(0)  # Work.wait's "the group's own timeout"
NOTES_LIMIT = 16 << 20  # bytes of a heal's JSON notes: counters and a few windows of figures


class HealError(RuntimeError):
    """What arrived in a heal is not what was sent, or not what may be taken."""


def by_dtype(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, torch.Tensor]]:
    """The tensors flattened into one buffer per dtype, in order of first appearance."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    return [(dtype, torch.cat(parts)) for dtype, parts in groups.items()]


def receiving(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, torch.Tensor]]:
    """Empty buffers shaped as `by_dtype(tensors)` would pack them, for a heal to receive into:
    what they held is overwritten (no copy of this rank's own state first)."""
    sizes: dict[torch.dtype, int] = {}
    device: dict[torch.dtype, torch.device] = {}
    for t in tensors:
        sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
        device.setdefault(t.dtype, t.device)
    return [(dtype, torch.empty(n, dtype=dtype, device=device[dtype]))
            for dtype, n in sizes.items()]


def scatter(tensors: Sequence[torch.Tensor], buffers) -> None:
    """Copy the received buffers back into `tensors`, in the order `by_dtype` took them."""
    taken = dict.fromkeys((dtype for dtype, _ in buffers), 0)
    flat = dict(buffers)
    with torch.no_grad():
        for t in tensors:
            start = taken[t.dtype]
            t.copy_(flat[t.dtype][start:start + t.numel()].view_as(t))
            taken[t.dtype] = start + t.numel()


def checksum(flat: torch.Tensor) -> torch.Tensor:
    """Two int64 figures over the bytes of `flat`, which a flipped bit, a swap or a lost piece
    in transit changes. In host memory: zlib's CRC-32 and the byte count (CRC-32 sees every
    burst of up to 32 flipped bits and misses other damage 1 time in 2^32, at ~7 ms for 12 MB
    where the same arithmetic in torch took ~85; Adler-32 beside it cost as much again for
    nothing a transit check needs). On a device, computed there: its 32-bit words summed, and
    summed again weighted by their position (mod a prime). Not a defence against a forger (the
    link's own authentication is): a check that what arrived is what was sent."""
    raw = flat.detach().reshape(-1).view(torch.uint8)
    if raw.device.type == "cpu":
        data = memoryview(raw.contiguous().numpy())
        return torch.tensor([zlib.crc32(data), raw.numel()], dtype=torch.int64)
    return device_checksum(raw)


def device_checksum(raw: torch.Tensor) -> torch.Tensor:
    """`checksum` of bytes `raw` as a device computes it (tested on the host too)."""
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    words = raw.view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
    return torch.stack([words.sum(), (words * weights).sum()])


def send_notes(group: dist.ProcessGroup, notes: dict, peer: int, tag: int,
               device: torch.device = HOST, timeout: timedelta | None = None) -> None:
    """Send `notes` (JSON) to `peer`: its length, then its bytes and their checksum; through
    `device`'s memory (the group's backend may take no other)."""
    data = json.dumps(notes, sort_keys=True).encode()
    if len(data) > NOTES_LIMIT:
        raise HealError(f"a heal's notes are {len(data)} bytes, over {NOTES_LIMIT}")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(
        0, dtype=torch.uint8)
    head = torch.cat([torch.tensor([len(data)], dtype=torch.int64), checksum(raw)])
    group.send([head.to(device)], peer, tag).wait(timeout or NO_TIMEOUT)
    if data:
        group.send([raw.to(device)], peer, tag + 1).wait(timeout or NO_TIMEOUT)


def receive_notes(group: dist.ProcessGroup, source: int, tag: int,
                  device: torch.device = HOST, timeout: timedelta | None = None) -> dict:
    """The notes `send_notes` sent from `source`, their length bounded and checksum checked."""
    head = torch.zeros(3, dtype=torch.int64, device=device)
    group.recv([head], source, tag).wait(timeout or NO_TIMEOUT)
    head = head.cpu()
    size = int(head[0])
    if not 0 <= size <= NOTES_LIMIT:
        raise HealError(f"a heal's notes claim {size} bytes, over {NOTES_LIMIT}")
    raw = torch.zeros(size, dtype=torch.uint8, device=device)
    if size:
        group.recv([raw], source, tag + 1).wait(timeout or NO_TIMEOUT)
    raw = raw.cpu()
    if not torch.equal(checksum(raw), head[1:]):
        raise HealError("a heal's notes fail their checksum")
    try:
        notes = json.loads(bytes(raw.numpy()))
    except ValueError:
        raise HealError("a heal's notes are not JSON") from None
    if not isinstance(notes, dict):
        raise HealError("a heal's notes are not a JSON object")
    return notes


def state_tensors(*state_dicts: dict) -> list[torch.Tensor]:
    """The tensors a heal carries, from state dicts (torch.distributed.checkpoint's
    get_model_state_dict / get_optimizer_state_dict: their values are the live tensors, the
    optimizer's made if it had none yet): by key, a DTensor as its local shard."""
    from torch.distributed.tensor import DTensor

    out = []
    for state in state_dicts:
        for key in sorted(state):
            value = state[key]
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out
