"""What a heal carries between replicas (optimus/parallel/replicas.py), and how it is checked:
the state's tensors, a checksum per dtype, and the host-side state (progress, the stability
rules' history) as one bounded JSON message.

In host memory (gloo) the tensors go in pieces of about PIECE_BYTES, so that the source packs
the next piece while one is in flight and the receiver checks each as the next arrives
(CRC-32 chains across pieces: the checksum is that of the whole dtype's bytes); only once all
are checked are they copied into the receiver's state, which a heal that fails leaves as it
was. On a device the state goes one buffer per dtype, checked there (`device_checksum`)."""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

HOST = torch.device("cpu")
PIECE_BYTES = 4 << 20  # a heal's piece in host memory
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


def pieces(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, list[torch.Tensor]]]:
    """The tensors in `by_dtype`'s order, cut between tensors into runs of one dtype of about
    PIECE_BYTES (a larger tensor is a piece of its own)."""
    out: list[tuple[torch.dtype, list[torch.Tensor]]] = []
    for dtype in dict.fromkeys(t.dtype for t in tensors):  # by first appearance
        run, size = [], 0
        for t in (t for t in tensors if t.dtype == dtype):
            run.append(t)
            size += t.numel() * t.element_size()
            if size >= PIECE_BYTES:
                out.append((dtype, run))
                run, size = [], 0
        if run:
            out.append((dtype, run))
    return out


def _chain(sums: dict, dtype: torch.dtype, flat: torch.Tensor) -> None:
    """`checksum` of a dtype's bytes so far, carried on over the next piece `flat`."""
    crc, size = sums.get(dtype, (0, 0))
    sums[dtype] = (zlib.crc32(memoryview(flat.view(torch.uint8).numpy()), crc),
                   size + flat.numel() * flat.element_size())


def give(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor], peers: Sequence[int],
         timeout: timedelta) -> int:
    """Send `tensors` to each of `peers` (ranks of `group`), then their checksums; the number
    of tags used from 0 (what follows takes the next)."""
    if tensors and tensors[0].device.type != "cpu":
        buffers = by_dtype(tensors)
        for tag, (_, flat) in enumerate(buffers):
            sends = [group.send([flat], peer, 2 * tag) for peer in peers]
            sums = checksum(flat)
            for work in sends:
                work.wait(timeout)
            for peer in peers:
                group.send([sums], peer, 2 * tag + 1).wait(timeout)
        return 2 * len(buffers)
    parts, sums, sends = pieces(tensors), {}, []
    if not parts:
        return 0
    for tag, (dtype, run) in enumerate(parts):
        flat = torch.cat([t.detach().reshape(-1) for t in run])
        sends += [(flat, group.send([flat], peer, tag)) for peer in peers]
        _chain(sums, dtype, flat)  # while the bytes go (zlib lets go of the GIL)
    for _, work in sends:
        work.wait(timeout)
    told = torch.tensor(list(sums.values()), dtype=torch.int64).reshape(-1, 2)
    for peer in peers:
        group.send([told], peer, len(parts)).wait(timeout)
    return len(parts) + 1


def take(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor], source: int,
         timeout: timedelta) -> int:
    """Receive into `tensors` what `give` sent from `source`, each dtype's bytes checked before
    any is copied in (HealError otherwise: `tensors` are untouched); the tags used."""
    if tensors and tensors[0].device.type != "cpu":
        buffers = receiving(tensors)
        for tag, (_, flat) in enumerate(buffers):
            sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
            group.recv([flat], source, 2 * tag).wait(timeout)
            group.recv([sums], source, 2 * tag + 1).wait(timeout)
            if not torch.equal(checksum(flat).cpu(), sums.cpu()):
                raise HealError("the state healed fails its checksum")
        scatter(tensors, buffers)
        return 2 * len(buffers)
    parts, sums = pieces(tensors), {}
    if not parts:
        return 0
    flats = [torch.empty(sum(t.numel() for t in run), dtype=dtype) for dtype, run in parts]
    works = [group.recv([flat], source, tag) for tag, flat in enumerate(flats)]
    for (dtype, _), flat, work in zip(parts, flats, works, strict=True):
        work.wait(timeout)
        _chain(sums, dtype, flat)  # this piece's check while the next arrives
    told = torch.zeros(len(sums), 2, dtype=torch.int64)
    group.recv([told], source, len(parts)).wait(timeout)
    if not torch.equal(told, torch.tensor(list(sums.values()), dtype=torch.int64).reshape(-1, 2)):
        raise HealError("the state healed fails its checksum")
    with torch.no_grad():
        for (_, run), flat in zip(parts, flats, strict=True):
            at = 0
            for t in run:
                t.copy_(flat[at:at + t.numel()].view_as(t))
                at += t.numel()
    return len(parts) + 1


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
