"""The files through which a node agent speaks to its ranks (they stat them at every step
boundary; optimus/supervision/commands.py, faults.py, inprocess.py):

- the control word: operators' pause and checkpoint-now, relayed from the job's `control` key,
  with `"save": false` added while this generation stops without a checkpoint;
- the chaos file: operators' rank faults for this generation's ranks;
- the next-generation words of ranks that wait in process (one per local rank).

Each is replaced atomically. A control or chaos write the disk refuses is said once
(controller/disk.py); the ranks act on the last word they read meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from controller.disk import Rewritten
from controller.node.voice import Voice


class RankFiles:
    """The control word, the faults and the waiting ranks' words of one agent, each with the
    state it was last written from."""

    def __init__(self, folder: Path, tag: str, voice: Voice):
        self.voice = voice
        self.control_path = folder / f"agent-{tag}.control"
        self.chaos_path = folder / f"agent-{tag}.chaos"
        self.quorum_path = folder / f"agent-{tag}.quorum"  # replicas that carry on
        self.quorum: dict | None = None  # the quorum record written there last
        self._control_writes = Rewritten(self.control_path, "its ranks' control file")
        self._chaos_writes = Rewritten(self.chaos_path, "its ranks' chaos file")
        self.control: dict = {}  # the job's control word, as last relayed
        self.no_save = False  # this generation's ranks are to stop without a checkpoint
        self.chaos: list[dict] = []  # operators' rank faults for this generation's ranks
        self.next_files: set[Path] = set()  # waiting ranks' words, and their temporary files
        self.tell({})
        self.set_faults([])

    # --- the control word ----------------------------------------------------------------------

    def tell(self, control: dict) -> None:
        """The control word for this node's ranks, with "save": false while this generation
        stops without a checkpoint. A write the disk refuses is tried again every tick
        (`failing`)."""
        self.control = dict(control)
        word = {**control, "save": False} if self.no_save else control
        turn = self._control_writes.write(json.dumps(word).encode())
        if turn is not None:
            self.voice.event("disk", f"agent of {self.voice.node} {turn.text}" + (
                "" if turn.ok else "; the ranks keep the last word they read, and the agent "
                "tries again every tick"), ok=turn.ok, path=str(self.control_path))

    @property
    def failing(self) -> OSError | None:
        """Why the disk refused the last control word (None: it took it)."""
        return self._control_writes.failing

    def stop_saving(self) -> None:
        """This generation's ranks stop without a checkpoint: said before their SIGTERM."""
        if not self.no_save:
            self.no_save = True
            self.tell(self.control)

    def save_again(self) -> None:
        """A new generation: the last one's "save": false is not its."""
        if self.no_save:
            self.no_save = False
            self.tell(self.control)

    # --- operators' rank faults ----------------------------------------------------------------

    def set_faults(self, faults: list[dict]) -> None:
        """Operators' rank faults for this node's ranks. A write the disk refuses leaves the
        last file: a fault not delivered is a rehearsal missed, not a reason for the agent to
        stop."""
        self.chaos = list(faults)
        turn = self._chaos_writes.write(json.dumps({"faults": self.chaos}).encode())
        if turn is not None:
            self.voice.event("disk", f"agent of {self.voice.node} {turn.text}", ok=turn.ok,
                             path=str(self.chaos_path))

    def add_fault(self, **fault) -> None:
        """One more fault, numbered after the others (a rank fires each id once)."""
        self.set_faults([*self.chaos, {"id": len(self.chaos) + 1, **fault}])

    # --- replicas that carry on ----------------------------------------------------------------

    def set_quorum(self, record: dict) -> bool:
        """The plan's quorum for this node's ranks (optimus/parallel/quorum_file.py reads it),
        replaced whole and atomically; False when the disk refused it (said; tried again)."""
        if record == self.quorum:
            return True
        tmp = self.quorum_path.with_suffix(".quorum.tmp")
        self.next_files |= {tmp}
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.quorum_path)
        except OSError as e:
            self.voice.event("disk", f"agent of {self.voice.node} could not write its ranks' "
                             f"quorum file ({e}); it tries again every tick", ok=False,
                             path=str(self.quorum_path))
            return False
        self.quorum = record
        return True

    # --- ranks waiting in process --------------------------------------------------------------

    def next_path(self, local_rank: int) -> Path:
        return self.control_path.with_suffix(f".next{local_rank}")

    def write_next(self, local_rank: int, word: dict) -> None:
        """Replace a waiting rank's word (atomically: it polls the file); OSError if the disk
        refused it."""
        path = self.next_path(local_rank)
        tmp = path.with_suffix(path.suffix + ".tmp")
        self.next_files |= {path, tmp}
        tmp.write_text(json.dumps(word))
        os.replace(tmp, path)

    def remove(self) -> None:
        for path in (self.control_path, self.chaos_path, self.quorum_path, *self.next_files):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
