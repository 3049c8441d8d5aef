"""When the trainer saves, and what it says about it: the checkpoint policy at step boundaries.

`RunCheckpoints` holds what every save needs (the checkpointer, the metrics log, the job, its
layout, the training state and its progress counters), so the loop in optimus/train.py calls
one method per moment: `after_step` (a due save starts, a finished one is reported),
`check_failed_saves`, `save_now` (an operator's request), `stop` (SIGTERM, or the controller's
stop) and `finish` (after the loop: the last step saved and waited for). Every method runs on
every rank, at the same step. Without a checkpointer (checkpointing off, nothing to resume) they
say what was not saved and save nothing.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from optimus.checkpoint.manifest import committed_steps
from optimus.checkpoint.saver import Checkpointer
from optimus.checkpoint.state import Progress
from optimus.config import JobConfig, job_hash
from optimus.contract.env import FAILED_SAVES
from optimus.metrics import MetricsLog
from optimus.runtime.dims import ParallelDims
from optimus.supervision.exits import CheckpointFailed


@dataclass
class RunCheckpoints:
    ckpt: Checkpointer | None
    log: MetricsLog
    job: JobConfig
    layout: ParallelDims
    state: dict  # what a save writes: training_state(...)
    progress: Progress  # its step, tokens and data index

    def __post_init__(self) -> None:
        """Saves that failed in a row in earlier generations of this job count too (the agent
        passes the count on: a restart does not reset the streak)."""
        carried = carried_failed_saves()
        if self.ckpt is not None and carried:
            self.ckpt.stats.failed_in_a_row = carried
            self.log.event("checkpoint", f"{carried} checkpoint save(s) failed in a row in "
                           "earlier generations; they count toward checkpoint.max_failed_saves="
                           f"{self.job.checkpoint.max_failed_saves}", failed_in_a_row=carried)

    @property
    def failed_in_a_row(self) -> int:
        return self.ckpt.stats.failed_in_a_row if self.ckpt is not None else 0

    def due(self, step: int) -> bool:
        """Whether `step` is a periodic save's (`checkpoint.interval`)."""
        interval = self.job.checkpoint.interval
        return bool(interval) and step % interval == 0

    def after_step(self, step: int) -> None:
        """At every step boundary: finish a save in flight, start a due one (the last step's
        comes after the loop: `finish`)."""
        ckpt = self.ckpt
        if ckpt is None:
            return
        ckpt.poll()
        self._failed()
        if step == self.job.optim.steps:
            return
        if self.due(step):
            outcome = self._save(step)
            self._failed()  # the one before it may have ended inside, or this one (sync)
            if outcome == "skipped":
                self.log.event("checkpoint", f"save of step {step} skipped: the previous one "
                               "is still being written", **ckpt.stats.as_dict())

    def check_failed_saves(self, step: int) -> None:
        """Stop training (CheckpointFailed) after `max_failed_saves` failed saves in a row: hours
        more of it would leave nothing newer to fall back to. The counts are agreed: all ranks
        stop."""
        ckpt, limit = self.ckpt, self.job.checkpoint.max_failed_saves
        if ckpt is None or step >= self.job.optim.steps:
            return
        if not limit or ckpt.stats.failed_in_a_row < limit:
            return
        ckpt.wait()  # one started since then decides too: a commit ends it
        self._failed()
        if ckpt.stats.failed_in_a_row < limit:
            return
        self._give_up(step, f"{ckpt.stats.failed_in_a_row} checkpoint saves failed in a row "
                      f"(checkpoint.max_failed_saves={limit}): stopped after step {step}, "
                      f"{self._newest_committed()}; the last: {ckpt.last_error}")

    def finish(self, step: int, final: bool) -> None:
        """After the loop: the save in flight lands; then, when checkpointing is on and this run
        trained the last step, that step is saved and waited for. A run whose last step is not
        committed raises CheckpointFailed: it must never end as if its state were safe."""
        ckpt = self.ckpt
        if ckpt is None:
            return
        ckpt.wait()
        self._failed()
        if final and self.job.checkpoint.interval:
            outcome = self._save(step)  # "exists": a stop saved it
            outcome = ckpt.wait() or outcome
            self._failed()
            if outcome not in ("committed", "exists"):
                why = (ckpt.last_error or "not saved").removeprefix(
                    f"checkpoint of step {step}: ")
                self._give_up(step, f"the final checkpoint (step {step}) failed, "
                              f"{self._newest_committed()}: {why}")
        ckpt.close()

    def stop(self, step: int, save: bool = True) -> None:
        """After the step all agreed to stop at: make it the latest checkpoint; without `save`
        (the controller saw wrong arithmetic, or rewinds to before this state), save nothing
        and commit nothing."""
        ckpt, log = self.ckpt, self.log
        if not save:
            if ckpt is not None:
                ckpt.abandon()
            log.event("stopped", f"stopped after step {step} without a checkpoint: the "
                      "controller does not keep this state (evidence of wrong arithmetic, or a "
                      "rewind to before it; its events say which)", step=step,
                      checkpoint_step=None, saved=False)
            return
        if ckpt is None:
            log.event("stopped", f"stopped after step {step} (SIGTERM); checkpointing is off, "
                      "so nothing was saved", step=step, checkpoint_step=None)
            return
        ckpt.wait()  # the save in flight lands first
        self._failed()
        outcome = self._save(step)  # "exists": just saved
        outcome = ckpt.wait() or outcome
        self._failed()
        saved = step if outcome in ("committed", "exists") else None
        where = (f"checkpoint of step {step} committed" if saved is not None
                 else "its checkpoint failed, a restart resumes from an older one")
        log.event("stopped", f"stopped after step {step} (SIGTERM); {where}", step=step,
                  checkpoint_step=saved)

    def save_now(self, step: int, wait: bool) -> None:
        """An operator's checkpoint of `step`; with `wait`, until it is committed."""
        ckpt, log = self.ckpt, self.log
        if ckpt is None:
            log.event("checkpoint", f"checkpoint of step {step} asked, but checkpointing is "
                      "off (checkpoint.interval 0 and nothing to resume): nothing saved",
                      step=step)
            return
        ckpt.wait()  # the save in flight lands first
        self._failed()
        outcome = self._save(step)  # "exists": just saved
        if wait:
            outcome = ckpt.wait() or outcome
        self._failed()
        if outcome == "failed":
            return
        log.event("checkpoint", f"checkpoint of step {step} asked by an operator: "
                  + ("committed" if wait or outcome == "exists" else "writing in the background"),
                  step=step)

    # --- the pieces ----------------------------------------------------------------------------

    def _save(self, step: int) -> str:
        return self.ckpt.save(step, self.state, self.meta())

    def meta(self) -> dict:
        """What a checkpoint's manifest says beside its tensors."""
        job, layout = self.job, self.layout
        return {**self.progress.meta(), "layout": asdict(layout),
                "config": job.model_dump(mode="json"), "config_hash": job_hash(job),
                "world_size": layout.world_size,
                "workdir": os.getcwd()}  # where the job's relative paths start (the export's)

    def _failed(self) -> None:
        """One event for each save that failed since the last call, with its own counts
        (failed_in_a_row: its place in the streak), wherever it ended."""
        for failure in self.ckpt.take_failures():
            self.log.event("checkpoint", **failure)

    def _give_up(self, step: int, message: str) -> None:
        self.ckpt.close()
        self.log.event("checkpoint", message, step=step, **self.ckpt.stats.as_dict())
        self.log.close()
        raise CheckpointFailed(message)

    def _newest_committed(self) -> str:
        steps = committed_steps(self.ckpt.root)
        return f"the newest committed is step {steps[-1]}" if steps else "none is committed"


FAILED_SAVES_ENV = FAILED_SAVES


def carried_failed_saves() -> int:
    """The streak of failed saves the agent passes on from earlier generations (0: none, or a
    value that is not a small count)."""
    text = os.environ.get(FAILED_SAVES_ENV, "")
    return int(text) if text.isdigit() and len(text) < 7 else 0


def log_resume(log: MetricsLog, ckpt: Checkpointer | None, resumed: dict | None,
                not_used: str | None) -> None:
    if not_used:  # the agent named a memory snapshot that not every rank could load
        log.event("checkpoint", f"{not_used}; resuming from disk instead")
    if resumed and resumed.get("source") == "memory":
        log.event("resume", f"continuing from the memory snapshot of step {resumed['step']} "
                  f"(generation {resumed['generation']}, {resumed['path']}): nothing read from "
                  "disk", step=resumed["step"], data_index=resumed["data_index"],
                  source="memory", notes=[])
    if ckpt is None:
        return
    if not (resumed and resumed.get("source") == "memory"):
        for message in resumed["skipped"] if resumed else ckpt.skipped:
            log.event("checkpoint", f"{message}; falling back to an older checkpoint")
        for q in ckpt.quarantined:
            log.event("quarantine", f"checkpoint of step {q['step']} set aside as {q['path']}: "
                      f"{q['reason']}; a later save of step {q['step']} writes it afresh", **q)
        if resumed and resumed.get("untrusted"):
            log.event("checkpoint", f"{resumed['path']} was not written by this run: "
                      f"{resumed['untrusted']}; loaded because the operator trusts it "
                      "(--trust-checkpoint or checkpoint.trust_step)", trusted=True)
        if resumed:
            log.event("resume", f"continuing from {resumed['path']} (step {resumed['step']})",
                      step=resumed["step"], data_index=resumed.get("data_index"),
                      source="disk", notes=resumed.get("notes", []))
    if ckpt.mode_note:
        log.event("checkpoint", ckpt.mode_note)
