"""Loading a checkpoint on every rank: the half of `Checkpointer` (saver.py) that reads.

Rank 0 picks what to load (the newest committed checkpoint that verifies, setting aside each
newer one that does not: quarantine.py) and checks that this run's key, or the operator's
trust, vouches for it; it tells the others in one broadcast, and every rank then loads its
share through DCP's collective load, reading no pickle that could run code (storage.py).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from optimus.checkpoint.manifest import CheckpointError, verify
from optimus.checkpoint.quarantine import pick_loadable
from optimus.checkpoint.safe_pickle import refusal
from optimus.checkpoint.state import OPTIONAL, PER_RANK
from optimus.checkpoint.storage import TensorFileReader


class Loading:
    """`Checkpointer`'s loads (it supplies root, rank, trust, collective, _io_group,
    _collective and _inflight)."""

    def load_latest(self, state: dict, deep_verify: bool = True) -> dict | None:
        """Load the newest committed checkpoint that verifies into `state`, on every rank.

        Rank 0 picks it, sets aside (quarantine.py) each newer one that fails verification, and
        tells the others. Returns its manifest (without the file table) plus "path", "skipped"
        (newer checkpoints passed over as corrupt: log "fell back to ..."), "quarantined" (those
        of them set aside: step, path, reason), "notes" (what did not carry over, e.g. RNG
        states under another layout) and "untrusted" (None, or why this run's key does not
        authenticate the checkpoint the operator trusted); None when there is no loadable
        checkpoint (`self.skipped` and `self.quarantined` still say why, if some were corrupt).
        A newest good checkpoint this run did not write, and the operator does not trust, is
        refused (CheckpointError, on every rank): it is not skipped for an older one.
        """
        choice: list[Any] = [None, [], [], None, None]
        if self.rank == 0:
            path, skipped, aside = pick_loadable(self.root, deep=deep_verify,
                                                 by=f"rank 0 (pid {os.getpid()}) at resume")
            choice = [str(path) if path else None, skipped, aside, None, None]
            if path:
                choice[3:] = self._authenticated(path)
        path, self.skipped, self.quarantined, manifest, refused = self._broadcast(choice)
        if refused:
            raise CheckpointError(refused)
        if path is None:
            return None
        return self._load(Path(path), state, manifest)

    def load(self, step_path: str | Path, state: dict, deep_verify: bool = True) -> dict:
        """Load one committed checkpoint; CheckpointError (on every rank) if it does not verify."""
        reply: list[Any] = [None, None]
        if self.rank == 0:
            problems = verify(step_path, deep=deep_verify)
            reply = ([None, f"cannot load {step_path}: {'; '.join(problems)}"] if problems
                     else self._authenticated(step_path))
        manifest, problem = self._broadcast(reply)
        if problem:
            raise CheckpointError(problem)
        self.skipped, self.quarantined = [], []
        return self._load(Path(step_path), state, manifest)

    def _load(self, path: Path, state: dict, manifest: dict) -> dict:
        if self._inflight is not None:
            raise RuntimeError("a checkpoint is being saved; wait() for it before loading")
        reader = TensorFileReader(path)
        # A refused .metadata says so here, in one line, on every rank alike; an I/O error is
        # left to DCP, which reads it again and tells every rank what failed on any.
        with contextlib.suppress(OSError):
            reader.read_metadata()
        with self.collective():
            try:
                dcp.load(state, storage_reader=reader, planner=_Planner(),
                         process_group=self._io_group)
            except CheckpointException as e:  # a refused entry, on any rank: its one line
                if (refused := refusal(e)) is None:
                    raise
                raise refused from None
        notes = [note for obj in state.values() if (note := getattr(obj, "load_note", None))]
        return {**manifest, "path": str(path), "skipped": list(self.skipped),
                "quarantined": list(self.quarantined), "notes": notes}

    def _authenticated(self, path: Path | str) -> list[Any]:
        """Rank 0: [the manifest's summary, with "untrusted", None], or [None, why it is
        refused] for a checkpoint neither this run's key nor the operator vouches for."""
        try:
            manifest, untrusted = self.trust.manifest(path)
        except CheckpointError as e:
            return [None, str(e)]
        return [{**_summary(manifest), "untrusted": untrusted}, None]

    def _broadcast(self, values: list[Any]) -> list[Any]:
        if self._collective:
            with self.collective():
                dist.broadcast_object_list(values, src=0, group=self._io_group)
        return values


class _Planner(DefaultLoadPlanner):
    """DCP's planner, but per-rank entries the checkpoint lacks are skipped, not an error, and
    so is optional state a checkpoint written before it existed lacks (OPTIONAL)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        saved = metadata.state_dict_metadata if metadata is not None else {}
        for key in [k for k in self.state_dict if k not in saved and (
                f".{PER_RANK}." in k or k.startswith(OPTIONAL))]:
            del self.state_dict[key]


def _summary(manifest: dict) -> dict:
    """The manifest without its file table (one entry per file: large at scale)."""
    return {k: v for k, v in manifest.items() if k != "files"}
