"""What happens between steps: a step's figures read and judged, its record, the saves,
snapshots, validation and the ranks' agreement: every hook at the step's boundary.

A step's figures reach the host without a sync (optimus/step.py); they are read here once the
device is done with them. An unlogged step with nothing to commit after it is read while the
next step's work is already queued (`before_update`, inside the next step, before its update):
the host never waits for the device and the device never waits for the host. A step is read
at its own boundary (one wait, all its figures at once) where it is logged, or where a save, a
snapshot, a validation or an agreed command is about to act on its state: nothing is kept or
acted on before its step has been judged. Reading a step:

- a non-finite gradient norm: the update was held back on the device; every rank names whether
  its own values were the bad ones (its tile) and exits (`NonFinite`), as before any update;
- the stability rules judge its loss and norm (optimus/stability.py); a spike whose verdict
  holds the update back was held back on the device already (the same thresholds, the same
  comparison); a rewind stops every rank before the next update, with nothing saved after it;
- its tokens join the progress, its samples' fingerprint goes to the log, marked where its
  update was held back.
"""

from __future__ import annotations

import math
import time

from optimus.evaluate import evaluate
from optimus.metrics import StepMetrics, logs_step
from optimus.parallel.experts import expert_figures
from optimus.runtime import max_over_ranks, peak_memory
from optimus.stability import RewindRequest, marked
from optimus.step import FIGURES, Limits, StepOutput
from optimus.supervision.commands import PAUSE_POLL_S, Agreed
from optimus.supervision.exits import NonFinite


class Boundary:
    """The hooks between steps, and the step whose figures are still on their way."""

    def __init__(self, *, job, rank: int, log, watch, progress, heartbeat, saves, snapshots,
                 commands, result, parts, state, held_out, compiles, host_group, on_eval):
        self.job, self.rank, self.log, self.watch = job, rank, log, watch
        self.progress, self.heartbeat, self.saves = progress, heartbeat, saves
        self.snapshots, self.commands, self.result, self.parts = snapshots, commands, result, parts
        self.state, self.held_out, self.compiles = state, held_out, compiles
        self.host_group, self.on_eval = host_group, on_eval
        self.pending: StepOutput | None = None
        # Replicas: the commands across them, from the ranks' own agreement (replica_mode.py)
        self.across = self.across_now = None

    # Inside a step, once its work is queued: the step before it, and this update's limits.
    def before_update(self) -> Limits:
        self.settle()
        # The last save's and snapshot's copies of the state, made behind this step: done
        # before the update changes it (on an accelerator the device's update waits for them).
        if self.saves.ckpt is not None:
            self.saves.ckpt.fence()
        if self.snapshots is not None:
            self.snapshots.fence()
        return Limits(*self.watch.holds_back())

    def reduce_loss(self, step: int) -> bool:
        """Whether `step` sums its loss over the ranks: the rules or the log read it."""
        return self.watch.needs_loss or self._logged(step)

    def after_step(self, out: StepOutput) -> bool:
        """The step boundary; True: every rank stops here (agreed)."""
        step, job = out.step, self.job
        if self.compiles is not None:
            self.compiles.after_step(step)
        self.progress.advance(0)  # its tokens join when its figures are read
        self.pending = out
        if self._acts_on(step):
            self.settle()
        # The step's record first, then any save or snapshot of it: a rank lost after a
        # point of step N is committed but before step N's record is written would leave a
        # point that a restart resumes from with no record of what step N read (the data
        # audit's hole, found under a CPU hog with a node killed at that moment).
        with self.heartbeat.phase("checkpoint"):
            self.saves.after_step(step)
        if self.snapshots is not None and step < job.optim.steps:
            with self.heartbeat.phase("checkpoint_sync"):  # an all-reduce once, when auto
                note = self.snapshots.after_step(step, time.perf_counter() - out.started,
                                                 self.state)
            if note:
                self.log.event("snapshot", note, every=self.snapshots.every)
        if self._validates(step):
            with self.heartbeat.phase("eval"):
                validation = evaluate(self.parts.model, self.held_out, self.parts.device,
                                      self.parts.mesh)
            self.result.evals.append((step, validation))
            self.on_eval(step, validation)
        # What any rank was told (stop, pause, checkpoint now), all do after this step; too
        # many failed saves in a row stop them all here.
        with self.heartbeat.phase("checkpoint"):
            self.saves.check_failed_saves(step)
        self.heartbeat.saves_failed(self.saves.failed_in_a_row)  # carried into a next generation
        with self.heartbeat.phase("sync"):
            agreed = self.commands.agree()
        if self.across is not None:  # replicas: what every member agreed (replica_mode.py)
            agreed = self.across(agreed, step)
        self.heartbeat.end_step()
        return self.act(agreed, step)

    def act(self, agreed: Agreed, step: int) -> bool:
        """Act on what all ranks agreed after `step`: save now if asked, wait while paused (the
        ranks keep agreeing every PAUSE_POLL_S, so all resume together). True: stop training,
        with the checkpoint a stop takes."""
        if agreed.stop or agreed.pause or agreed.checkpoint > self.commands.checkpoint_done:
            self.settle()  # judged before anything is kept or held
        if self._wait(agreed, step):
            with self.heartbeat.phase("checkpoint"):
                self.saves.stop(step, save=not self.commands.no_save)
            return True
        return False

    def settle(self) -> None:
        """Read and judge the step whose figures are on their way, if any."""
        out, self.pending = self.pending, None
        if out is None:
            return
        values = out.pending.read()
        f = dict(zip(FIGURES, values, strict=False))
        step = out.step
        if not math.isfinite(f["grad_norm"]):  # held back on the device: name the tile, exit
            self._nonfinite(step, f)
        loss = f["loss"] if out.loss_reduced else None
        verdict = self.watch.judge(step, loss, f["grad_norm"])
        updated = not f["held"]
        if verdict is not None:  # every rank has the same figures: the same verdict
            self.log.event("stability", verdict.message(), **verdict.fields(out.data))
            if verdict.action == "rewind":  # held back (a spike) or one step on (a trend)
                raise RewindRequest(verdict)
        self.progress.tokens += int(f["tokens"])
        if not self._logged(step):
            self.log.samples(step, marked(out.data, updated))
            return
        experts = (expert_figures(values[len(FIGURES):], self.job.model) if out.moe
                   else None)
        self._record(out, f, experts, marked(out.data, updated))

    def _record(self, out: StepOutput, f: dict, experts: dict | None, data: dict | None):
        """A logged step's line, heartbeat summary and the run's result."""
        own_memory = peak_memory(self.parts.device)
        with self.heartbeat.phase("grad_sync"):  # all ranks, on the host's group
            memory = max_over_ranks(own_memory, self.rank, self.host_group)
        step_time = time.perf_counter() - out.started
        tokens = int(f["tokens"])
        tokens_per_s, mfu = self.log.throughput(tokens, step_time)
        loss, norm, ckpt = f["loss"], f["grad_norm"], self.saves.ckpt
        self.result.losses.append(loss)
        self.heartbeat.logged(loss, norm, None if self.rank else {
            "loss": loss, "tokens": self.progress.tokens, "tokens_per_s": tokens_per_s,
            "mfu": mfu, "step_time_s": step_time, "stability": self.watch.figures(),
            "checkpoint_s": ckpt.stats.last_write_s if ckpt and ckpt.stats.saves_committed
            else None, "moe_alltoall_bytes": experts["alltoall_bytes"] if experts else 0},
            memory=own_memory)
        self.log.record(StepMetrics(step=out.step, loss=loss, grad_norm=norm, lr=out.lr,
                                    tokens=self.progress.tokens, step_time_s=step_time,
                                    tokens_per_s=tokens_per_s, mfu=mfu,
                                    checkpoint=ckpt.stats.as_dict() if ckpt else None,
                                    moe=experts, data=data, memory=memory))

    def _nonfinite(self, step: int, f: dict) -> None:
        """The global gradient norm is NaN/Inf. Every rank read it; each says whether its own
        loss and gradient shards were the bad ones (before any reduction: a bad tile)."""
        loss_ok = math.isfinite(f["local_loss"])
        grads_ok = math.isfinite(f["local_grads_squared"])
        local = not (loss_ok and grads_ok)
        if local:
            self.heartbeat.nonfinite()
        detail = (f"local loss {'finite' if loss_ok else f['local_loss']}, local gradients "
                  f"{'finite' if grads_ok else 'NaN/Inf'}")
        raise NonFinite(step, local, detail)

    def _logged(self, step: int) -> bool:
        return logs_step(step, self.job.supervision.log_every, self.job.optim.steps)

    def _validates(self, step: int) -> bool:
        every = self.job.eval.every
        return self.held_out is not None and (step % every == 0 or step == self.job.optim.steps)

    def _acts_on(self, step: int) -> bool:
        """Whether anything at this boundary keeps or reads the step's state."""
        return (self._logged(step) or self.saves.due(step)
                or (self.snapshots is not None and self.snapshots.due(step))
                or self._validates(step) or step == self.job.optim.steps)

    def _wait(self, agreed: Agreed, step: int) -> bool:
        paused_at = None
        while True:
            if agreed.stop:
                return True
            if self.commands.checkpoint_due(agreed):
                with self.heartbeat.phase("checkpoint"):
                    self.saves.save_now(step, wait=agreed.pause)  # a pause holds a checkpoint
            if not agreed.pause:
                if paused_at is not None:
                    self.log.event("resumed", f"resumed after step {step}, paused for "
                                   f"{time.time() - paused_at:.1f} s", step=step)
                return False
            if paused_at is None:
                paused_at = time.time()
                self.log.event("paused", f"paused after step {step}", step=step)
            with self.heartbeat.phase("paused"):
                time.sleep(PAUSE_POLL_S)
                agreed = self.commands.agree()
                if self.across is not None:  # replicas: every member resumes together
                    agreed = self.across_now(agreed)

