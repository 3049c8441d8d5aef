"""In-memory snapshots of the training state, taken by each rank into host memory its node's
agent owns, and the loads that resume from them.

Under an agent every rank gets OPTIMUS_SNAPSHOT_DIR: a folder on the node's shared-memory file
system (/dev/shm), which belongs to the agent and so outlives the rank: a crashed rank or a
generation restart loses nothing there. Every `checkpoint.memory_every` steps each rank copies
its shard of what a disk checkpoint holds (its model and optimizer shards, the progress counters
with the data position, its RNG states) into that folder (snapshot_files.py says how it lies);
the agent replicates each complete point to a buddy node, and the controller resumes a next
generation from the newest point every shard and replica of which is complete (controller/
snapshots.py, controller/control/recovery.py).

Why not DCP (as disk checkpoints use): a DCP save is one global checkpoint, its metadata written
by one coordinator and its load a collective that reshards. A snapshot is only ever loaded by the
same layout (the same rank takes back its own shard), it must be usable per node (a replacement
node loads one dead node's shards from the buddy) and cheap to take, so each rank writes its
local shards with torch.save and loads them back in place: no planning, no collective but one
agreement.

Off the step's path: at a snapshot step the rank takes only references (the state dicts, the
progress counters, its RNG states: a few milliseconds of Python) and marks the device's stream;
the copy of the tensors (staging.py: into host buffers kept from one snapshot to the next,
pinned where there is a CUDA device, on a side stream), the write and the checksum run in the
snapshot thread, behind the next step's forward and backward, which read the weights and
optimizer state but do not change them. The optimizer's step does: the trainer calls `fence()`
before it, which waits only until the copies are queued (on a CPU: done), and on an accelerator
has the device's update wait for them (`SnapshotCost.blocked_s`: the host's wait). So the loop
pays for neither the copy nor the write, only for what the thread takes of the machine
(bench/snapshot_overhead.py).

`memory_every: auto` takes one snapshot at the generation's first step boundary, times it whole
(copy and write: on a CPU machine the background write competes with training), times the next
step, and picks the smallest interval at which snapshots cost <= 2% of the step time; every rank
proposes one and all take the largest (one all-reduce), so all snapshot at the same steps.

Loading (`load_agreed`): each rank checks its shard (marker, size, sha256, layout, step); all
ranks exchange their findings (one all-gather) and load only if every one can, otherwise every
rank resumes from disk as before, with the first failing rank's reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optimus.checkpoint.snapshot_files import (
    check_shard,
    point_name,
    sha256_file,
    shard_files,
    write_marker,
)
from optimus.checkpoint.staging import Begun, Stager
from optimus.checkpoint.state import OPTIONAL_STATE
from optimus.contract.env import SNAPSHOT_DIR, SNAPSHOT_RESUME

DIR_ENV = SNAPSHOT_DIR  # this node's own/ folder: where ranks write
RESUME_ENV = SNAPSHOT_RESUME  # JSON {"step", "generation", "dir"}: what to load
COST_SHARE = 0.02  # auto: snapshots may take this share of the step time

log = logging.getLogger(__name__)


@dataclass
class SnapshotCost:
    step: int
    seconds: float  # copy + write, whole
    blocked_s: float  # of which the training loop waited: references, the copy's fence
    bytes: int


class Snapshots:
    """This rank's snapshots: `after_step` at every step boundary, on every rank."""

    def __init__(self, root: Path, *, rank: int, generation: int, every: int | None,
                 layout: str, agree_device: torch.device):
        self.root, self.rank, self.generation = Path(root), rank, generation
        self.every = every  # None: auto, not yet measured
        self.layout, self.agree_device = layout, agree_device
        self.last: SnapshotCost | None = None
        self.taken = 0
        self.skipped = 0
        self.failed = 0
        self._last_step = 0
        self._measured: SnapshotCost | None = None  # auto: the first one
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="snapshot-write")
        self._inflight: Future | None = None
        self._stager = Stager()  # its host buffers hold the snapshot being written

    @classmethod
    def for_job(cls, memory_every: int | str, *, rank: int, generation: int, layout: str,
                agree_device: torch.device) -> Snapshots | None:
        """Snapshots when an agent gave this rank a folder and the job takes them; else None."""
        root = os.environ.get(DIR_ENV)
        if not root or memory_every == 0:
            return None
        every = None if memory_every == "auto" else int(memory_every)
        return cls(Path(root), rank=rank, generation=generation, every=every, layout=layout,
                   agree_device=agree_device)

    def due(self, step: int) -> bool:
        """Whether the boundary after `step` takes (or, while `auto` measures, times) one."""
        return self.every is None or step % self.every == 0

    def after_step(self, step: int, step_s: float, state: dict) -> str | None:
        """Take a due snapshot of `state` (the training_state dict) after `step`; `step_s` is
        this step's time. Returns a message for the metrics log: the interval chosen, or that a
        snapshot's write failed."""
        if self.every is None:
            if self._measured is None:
                self._measured = self._take(step, state, wait=True)
                return None
            self.every = self._agree_interval(self._measured, step_s)
            cost = self._measured
            return (f"memory snapshots every {self.every} step(s): one costs {cost.seconds:.3f} s "
                    f"({cost.bytes / 2**20:.1f} MiB on this rank, the loop blocked "
                    f"{cost.blocked_s:.3f} s) against {step_s:.3f} s a step "
                    f"(<= {COST_SHARE:.0%} of it, the largest of all ranks' choices)")
        if self.due(step):
            if self._inflight is not None and not self._inflight.done():
                self.skipped += 1  # the last is still being written: the next one will do
                return None
            failed = self._failure()
            self._take(step, state, wait=False)
            return failed
        return None

    def _failure(self) -> str | None:
        """Why the last snapshot's write failed (e.g. shared memory full), once; None if it
        did not. The next one is tried all the same: a restart uses only complete points."""
        done, self._inflight = self._inflight, None
        if done is None or done.exception() is None:
            return None
        self.failed += 1
        message = (f"memory snapshot of step {self._last_step} failed on rank {self.rank}: "
                f"{type(done.exception()).__name__}: {done.exception()} (folder {self.root}); "
                "a restart falls back to an older snapshot or to disk")
        log.warning(message)  # every rank's own log; rank 0's metrics log has it as an event
        return message

    def fence(self) -> None:
        """Before the state changes (the optimizer's step): the snapshot being taken has copied
        it. Waits only for what the copy did not do behind the forward and backward (on an
        accelerator: until the copies are queued; the device's update waits for the rest); that
        wait is the snapshot's cost to the loop (`last.blocked_s`)."""
        waited = self._stager.fence()
        if self.last is not None:
            self.last.blocked_s += waited

    def close(self) -> None:
        """Let the snapshot being written finish, then stop the writer thread and free the host
        buffers (the trainer's exit order: optimus/train.py)."""
        self._pool.shutdown(wait=True)
        self._stager.fence()
        self._stager.release()

    def _agree_interval(self, cost: SnapshotCost, step_s: float) -> int:
        mine = max(1, math.ceil(cost.seconds / (COST_SHARE * max(step_s, 1e-6))))
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        value = torch.tensor([mine], dtype=torch.int64, device=self.agree_device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def _take(self, step: int, state: dict, wait: bool) -> SnapshotCost:
        """Snapshot `state` after `step`: references now, the copy and the write in the thread
        (`fence` waits for the copy); with `wait`, all of it before returning (timed whole)."""
        began = time.perf_counter()
        refs = references(state)
        folder = self.root / point_name(step, self.generation)
        self._last_step = step
        meta = {"step": step, "generation": self.generation, "rank": self.rank,
                "layout": self.layout, **refs["progress"]}
        begun = self._stager.begin()

        def copy_and_write() -> int:  # a failure is said by the next after_step (_failure)
            return _write(folder, self.rank, copy_out(refs, self._stager, begun), meta)
        self._inflight = self._pool.submit(copy_and_write)
        self.taken += 1
        size = 0
        if wait:
            with contextlib.suppress(OSError):
                size = self._inflight.result()
            self._stager.fence()
        blocked = time.perf_counter() - began
        self.last = SnapshotCost(step, blocked, blocked, size)
        return self.last


def references(state: dict) -> dict[str, Any]:
    """This rank's part of `state` as it is now, by reference (its tensors are the live ones:
    copy them before the state changes) but for the progress counters and RNG states, copied."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator().type
        rng["accelerator"] = torch.get_device_module(accelerator).get_rng_state()
    return {"model": state["model"].state_dict(), "optim": state["optim"].state_dict(),
            "progress": state["progress"].meta(), "rng": rng,
            **{name: state[name].state_dict() for name in OPTIONAL_STATE if name in state}}


def copy_out(refs: dict[str, Any], stager: Stager, begun: Begun) -> dict[str, Any]:
    """The tensors of `references`, this rank's local shards, copied into `stager`'s host
    buffers once the training stream reached `begun` (in the snapshot thread)."""
    local = {**refs, "model": _local(refs["model"]), "optim": _local(refs["optim"])}
    return stager.copy(local, begun)


def _local(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value.to_local().detach() if isinstance(value, DTensor)
            else value.detach() if isinstance(value, torch.Tensor) else value
            for key, value in values.items()}


def _write(folder: Path, rank: int, staged: dict, meta: dict) -> int:
    """The shard, then its marker (the agent takes a shard as complete once the marker is
    there). Returns its size in bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    data, _ = shard_files(folder, rank)
    tmp = data.with_name(f".{data.name}.tmp")
    torch.save(staged, tmp)
    os.replace(tmp, data)
    size = data.stat().st_size
    write_marker(folder, rank, {**meta, "bytes": size, "sha256": sha256_file(data),
                                "time": time.time()})
    return size


# --- loading ---------------------------------------------------------------------------------

def resume_request() -> dict | None:
    """What this generation's agent asks the ranks to load: {"step", "generation", "dir"}."""
    text = os.environ.get(RESUME_ENV)
    return json.loads(text) if text else None


def load_agreed(state: dict, request: dict | None, *, rank: int,
                layout: str) -> tuple[dict | None, str | None]:
    """Load this rank's shard of the requested point into `state` if every rank can: the
    resume record (step, tokens, data_index, path, source) and None, or None and why not
    (on every rank the same outcome; a rank's own reason, or that another rank had one)."""
    if request is None:
        return None, None
    folder = Path(request["dir"])
    meta, problem = check_shard(folder, rank)
    if meta is not None and meta.get("layout") != layout:
        problem = (f"the snapshot was taken under layout {meta.get('layout')}, this run is "
                   f"{layout}")
    if meta is not None and not problem and meta.get("step") != request["step"]:
        problem = f"{folder} holds step {meta.get('step')}, not {request['step']}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Every rank's reason, once per start (a few bytes each): rank 0's log names the rank.
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        bad = [(r, p) for r, p in enumerate(problems) if p]
        if bad:
            r, first = bad[0]
            others = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
            problem = f"rank {r}: {first}{others}"
    if problem:
        return None, f"memory snapshot of step {request['step']} not used: {problem}"
    data, _ = shard_files(folder, rank)
    saved = torch.load(data, map_location="cpu", weights_only=True)
    _restore(state["model"], saved["model"])
    _restore(state["optim"], saved["optim"])
    progress = state["progress"]
    progress.step = int(saved["progress"]["step"])
    progress.tokens = int(saved["progress"]["tokens"])
    progress.data_index = int(saved["progress"]["data_index"])
    state["rng"].restore(saved["rng"])
    for name in OPTIONAL_STATE:  # (a snapshot of a version without it: left as it is)
        if name in state and isinstance(saved.get(name), dict):
            state[name].load_state_dict(saved[name])
    return {**progress.meta(), "path": str(folder), "source": "memory",
            "generation": request.get("generation"), "skipped": [], "quarantined": [],
            "notes": []}, None


def _restore(stateful, saved: dict[str, Any]) -> None:
    """Put saved local shards back: into the live state dict's own tensors (same layout, so the
    same shapes), then through the object's load_state_dict, as a disk load would."""
    target = stateful.state_dict()
    missing = sorted(set(target) - set(saved))
    if missing:
        raise ValueError(f"the snapshot lacks {len(missing)} entries, e.g. {missing[0]}")
    for key, value in target.items():
        if isinstance(value, DTensor):
            value.to_local().copy_(saved[key])
        elif isinstance(value, torch.Tensor):
            value.copy_(saved[key])
        else:
            target[key] = saved[key]
    stateful.load_state_dict(target)
