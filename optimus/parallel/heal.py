"""What a heal carries between replicas (optimus/parallel/replicas.py), and how it is checked:
the state's tensors in pieces (`give`, `take`: a large tensor as it lies, the small ones packed),
a checksum of each, and the host-side state (progress, the stability rules' history) as one
bounded JSON message."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
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


# A tensor at least this large goes as a message of its own, sent from where it lies (no copy);
# smaller ones go packed together, in messages of about this size per dtype and device: a
# message each would cost more in its round trip than their copy, and one message of all of
# them would be packed whole before its first byte could go.
PIECE_MIN = 1 << 20


def pieces(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The messages a heal of `tensors` takes, as lists of their indices, in the order they
    go: each large tensor alone; the small ones of a dtype and device packed in order until
    the message reaches PIECE_MIN bytes (the rest of each at the end). The same on both sides:
    the same shapes at one position of every replica."""
    out, open_ = [], {}
    for i, t in enumerate(tensors):
        size = t.numel() * t.element_size()
        if size >= PIECE_MIN:
            out.append([i])
            continue
        key = (t.dtype, t.device)
        index, filled = open_.get(key, ([], 0))
        index.append(i)
        if filled + size >= PIECE_MIN:
            out.append(index)
            open_.pop(key, None)
        else:
            open_[key] = (index, filled + size)
    return out + [index for index, _ in open_.values()]


def give(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor], peers: Sequence[int],
         device: torch.device, timeout: timedelta) -> int:
    """Send `tensors` to each of `peers` (`pieces`: every message posted at once, each one's
    checksum computed while the bytes go), then the table of checksums. Through `device`'s
    memory: the group's backend may take no other. Returns the next free tag."""
    plan = pieces(tensors)
    works, sums = [], []
    for tag, index in enumerate(plan):
        parts = [tensors[i].detach().reshape(-1) for i in index]
        flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(device)
        works += [group.send([flat], peer, tag) for peer in peers]
        sums.append(checksum(flat).to(device))  # (zlib lets go of the GIL)
    for work in works:
        work.wait(timeout)
    table = torch.stack(sums) if sums else torch.zeros(0, 2, dtype=torch.int64, device=device)
    for peer in peers:
        group.send([table], peer, len(plan)).wait(timeout)
    return len(plan) + 1


def take(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor], source: int,
         device: torch.device, timeout: timedelta) -> tuple[int, Callable[[], None]]:
    """Receive what `give` sent from `source` into buffers of their own (every message posted
    at once, each checked as the next arrive). HealError when a checksum does not match.
    Returns the next free tag and what copies them into `tensors`, called once every
    checksum matches and the replica's other ranks took theirs: a heal that fails leaves
    this rank's state as it was (it may have to heal another from it)."""
    plan = pieces(tensors)
    buffers = [torch.empty(sum(tensors[i].numel() for i in index),
                           dtype=tensors[index[0]].dtype, device=device) for index in plan]
    works = [group.recv([flat], source, tag) for tag, flat in enumerate(buffers)]
    sums = []
    for work, flat in zip(works, buffers, strict=True):
        work.wait(timeout)
        sums.append(checksum(flat))  # where the piece lies: on a device, queued, not read
    table = torch.zeros(len(plan), 2, dtype=torch.int64, device=device)
    group.recv([table], source, len(plan)).wait(timeout)
    if sums and not torch.equal(torch.stack(sums).to(device), table):  # one host read
        raise HealError("the state healed fails its checksum")

    def copy_in() -> None:
        with torch.no_grad():
            for index, flat in zip(plan, buffers, strict=True):
                start = 0
                for i in index:
                    t = tensors[i]
                    t.copy_(flat[start:start + t.numel()].view_as(t))
                    start += t.numel()
    return len(plan) + 1, copy_in


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
