"""Loss spikes and divergence, judged on every rank from the step's global figures.

Every rank holds the same global loss (the step's loss summed over pipeline stages and data
replicas) and the same global gradient norm (the clip computes it), so every rank applies the
same rules to the same numbers and reaches the same verdict at the same step: nothing has to be
agreed. The rules (job file `stability:`, docs/config.md; how to tune them:
docs/operations.md, "Loss spikes"):

- spike, by the loss: `loss > mean + max(loss_sigma x std, loss_min_rise x mean)` of the
  trailing `window` steps' losses. The relative floor keeps a flat loss's tiny spread from
  calling noise a spike.
- spike, by the gradient norm: `grad_norm > grad_ratio x` the trailing window's median.
- divergence: the means of the last `divergence_windows` + 1 whole windows each above the one
  before, by `divergence_min_rise` of the first of them in all: a sustained rise, not a spike.

Nothing is judged before `warmup_steps` steps of this run's history (the loss falls fastest at
the start) nor before the window is full. A spiked step's figures stay out of the history (the
spike would widen the band it is judged by); `max_skips` spikes in a row are no longer a spike
but a new level: the verdict says so and the history starts again from there.

Why written here: the rules are a few lines of arithmetic over a trailing window; no library
keeps this state in a form a checkpoint and a memory snapshot can carry.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.stateful import Stateful

from optimus.config.schema import StabilityConfig
from optimus.contract import env
from optimus.contract.exits import EXIT_REWIND, REWIND_LINE

COUNTED = ("spikes", "divergences", "skipped_steps")
MAX_HISTORY_CHARS = 1 << 20  # a history is a few windows of floats: ~10 KiB at window 100


@dataclass(frozen=True)
class Verdict:
    """What the rules found at one step, and what the ranks do about it."""

    kind: str  # "spike" or "divergence"
    rule: str  # "loss", "grad_norm" or "trend"
    step: int
    value: float
    threshold: float
    action: str  # warn, skip_step, rewind
    since: int | None = None  # a divergence: the first step of the rise (a rewind goes before)

    def message(self) -> str:
        what = {"loss": "the loss", "grad_norm": "the gradient norm",
                "trend": "the loss's window mean"}[self.rule]
        did = {"warn": "training goes on", "skip_step": "the step's update is not applied",
               "rewind": "every rank stops before its update for a rewind"}[self.action]
        return (f"{self.kind} at step {self.step}: {what} {self.value:.4g} > {self.threshold:.4g}"
                f"; {did}")

    def fields(self, samples: dict | None) -> dict:
        """The `stability` event's fields in metrics.jsonl, with the step's samples (their
        fingerprint: index range and ids hash; None where this rank logs nothing)."""
        return {"step": self.step, "verdict": self.kind, "rule": self.rule, "value": self.value,
                "threshold": self.threshold, "action": self.action, "samples": samples}


class RewindRequest(Exception):
    """A verdict whose action is `rewind`: every rank stops before the step's update, saves
    nothing, and says so (`line`) for the controller, which plans the rewind."""

    exit_code = EXIT_REWIND

    def __init__(self, verdict: Verdict):
        self.verdict = verdict
        super().__init__(verdict.message())

    def line(self) -> str:
        v = self.verdict
        return REWIND_LINE + json.dumps({"step": v.step, "since": v.since or v.step,
                                         "verdict": v.kind, "rule": v.rule,
                                         "value": v.value, "threshold": v.threshold})


def skip_windows(text: str | None = None) -> list[tuple[int, int]]:
    """The windows of steps (first, last) whose batches are skipped, from the agent's
    OPTIMUS_SKIP_STEPS ("A-B,C-D"); anything else in it is ignored. Two windows may start at
    the same step (a spike again at the step a rewind went on from): both are skipped."""
    text = os.environ.get(env.SKIP_STEPS, "") if text is None else text
    out = []
    for part in text.split(",")[:1000]:
        first, _, last = part.partition("-")
        if first.isdigit() and last.isdigit() and len(part) < 24 and 1 <= int(first) <= int(last):
            out.append((int(first), int(last)))
    return sorted(out)


class StabilityWatch(Stateful):
    """The trailing history one rank keeps, and the rules over it.

    A checkpoint and a memory snapshot carry it (`state_dict`: one JSON string, the same on
    every rank), so a new generation judges from the first step with the history its resume
    point had, instead of another warm-up; its counts go on along the run's line (a rewind
    takes them back with the state). A checkpoint written before the rules carried their
    history has none: the rules warm up again."""

    def __init__(self, cfg: StabilityConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.norms: deque[float] = deque(maxlen=cfg.window)
        self.means: deque[float] = deque(maxlen=max(cfg.divergence_windows + 1, 1))
        self.seen = 0  # steps of history this run
        self.in_a_row = 0  # spikes in a row
        self._block: list[float] = []  # the window being filled, for the trend
        self.counts = dict.fromkeys(COUNTED, 0)  # verdicts along the run's line

    def state_dict(self) -> dict[str, str]:
        return {"history": json.dumps({
            "losses": list(self.losses), "norms": list(self.norms), "means": list(self.means),
            "block": self._block, "seen": self.seen, "in_a_row": self.in_a_row,
            "counts": self.counts})}

    def load_state_dict(self, state_dict: dict) -> None:
        """The history a checkpoint or snapshot carried. It crossed a boundary (a file): only
        finite numbers of the expected kinds are taken, at most a window's worth; anything
        else leaves the rules to warm up again."""
        try:
            saved = json.loads(str(state_dict.get("history", ""))[:MAX_HISTORY_CHARS])
            floats = {k: [float(x) for x in saved[k] if isinstance(x, int | float)
                          and math.isfinite(x)] for k in ("losses", "norms", "means", "block")}
            ints = {k: int(saved[k]) for k in ("seen", "in_a_row")
                    if isinstance(saved[k], int) and saved[k] >= 0}
            counts = {k: int(v) for k, v in saved["counts"].items()
                      if k in COUNTED and isinstance(v, int) and v >= 0}
        except (ValueError, TypeError, KeyError, AttributeError):
            return
        self.losses.clear()
        self.losses.extend(floats["losses"][-self.cfg.window:])
        self.norms.clear()
        self.norms.extend(floats["norms"][-self.cfg.window:])
        self.means.clear()
        self.means.extend(floats["means"])
        self._block = floats["block"][-self.cfg.window:]
        self.seen, self.in_a_row = ints.get("seen", 0), ints.get("in_a_row", 0)
        self.counts.update(counts)

    def figures(self) -> dict:
        """The counts and the thresholds the next step is judged by (None: a rule is off or
        not armed yet), for rank 0's heartbeat (the exporter's gauges and counters)."""
        loss, grad = self._thresholds() if self._armed() else (None, None)
        return {**self.counts, "loss_threshold": loss, "grad_norm_threshold": grad}

    def _armed(self) -> bool:
        c = self.cfg
        return c.enabled and self.seen >= c.warmup_steps and len(self.norms) == c.window

    @property
    def needs_loss(self) -> bool:
        """Whether the rules read the global loss every step (else the gradient norm only)."""
        c = self.cfg
        return c.enabled and (c.loss_sigma > 0 or c.divergence_windows > 0)

    def holds_back(self) -> tuple[float | None, float | None]:
        """The (loss, gradient norm) thresholds above which the next step's update is held back
        on the device, before the host has read that step (None: that rule holds nothing back
        now). They are `_spike`'s thresholds over the history as it is, where a spike's verdict
        would be `skip_step` or `rewind`: the `max_skips`-th spike in a row and beyond is a
        divergence, whose action (`on_divergence`) is said here already. So the device holds
        back exactly the updates the verdict on the step's figures will name."""
        c = self.cfg
        if not self._armed():
            return None, None
        action = c.on_spike if self.in_a_row + 1 <= c.max_skips else c.on_divergence
        if action not in ("skip_step", "rewind"):
            return None, None
        return self._thresholds()

    def judge(self, step: int, loss: float | None, grad_norm: float) -> Verdict | None:
        """The verdict on `step` (None: healthy), then the history updated and the verdict
        counted. `loss` is None where the rules need none (needs_loss)."""
        verdict = self._judge(step, loss, grad_norm)
        if verdict is not None:
            self.counts["spikes" if verdict.kind == "spike" else "divergences"] += 1
            self.counts["skipped_steps"] += verdict.action == "skip_step"
        return verdict

    def _judge(self, step: int, loss: float | None, grad_norm: float) -> Verdict | None:
        c = self.cfg
        if not c.enabled:
            return None
        armed = self._armed()
        verdict = self._spike(step, loss, grad_norm) if armed else None
        if verdict is not None:
            self.in_a_row += 1
            if self.in_a_row <= c.max_skips:
                return verdict
            # Spikes every step: the level has moved; judge from here on its new figures.
            self.losses.clear()
            self.norms.clear()
            self.seen = self.in_a_row = 0
            return Verdict("divergence", verdict.rule, step, verdict.value,
                           verdict.threshold, c.on_divergence, since=step - c.max_skips)
        self.in_a_row = 0
        self.seen += 1
        self.norms.append(grad_norm)
        if loss is not None:
            self.losses.append(loss)
            return self._trend(step, loss) if armed else self._fill(loss)
        return None

    def _thresholds(self) -> tuple[float | None, float | None]:
        """The spike thresholds over the history as it is (None: that rule is off)."""
        c = self.cfg
        loss = grad = None
        if c.loss_sigma > 0 and len(self.losses) >= 2:
            mean = statistics.fmean(self.losses)
            loss = mean + max(c.loss_sigma * statistics.pstdev(self.losses),
                              c.loss_min_rise * mean)
        if c.grad_ratio > 0 and self.norms:
            grad = c.grad_ratio * statistics.median(self.norms)
        return loss, grad

    def _spike(self, step: int, loss: float | None, grad_norm: float) -> Verdict | None:
        loss_limit, grad_limit = self._thresholds()
        if loss is not None and loss_limit is not None and (
                not math.isfinite(loss) or loss > loss_limit):
            return Verdict("spike", "loss", step, loss, loss_limit, self.cfg.on_spike)
        if grad_limit is not None and grad_norm > grad_limit:
            return Verdict("spike", "grad_norm", step, grad_norm, grad_limit, self.cfg.on_spike)
        return None

    def _fill(self, loss: float) -> None:
        self._block.append(loss)
        if len(self._block) == self.cfg.window:
            self.means.append(statistics.fmean(self._block))
            self._block = []

    def _trend(self, step: int, loss: float) -> Verdict | None:
        c = self.cfg
        self._fill(loss)
        if c.divergence_windows == 0 or len(self.means) < c.divergence_windows + 1 or \
                self._block:
            return None  # judged once per whole window
        means = list(self.means)
        rising = all(b > a for a, b in zip(means, means[1:], strict=False))
        if rising and means[-1] - means[0] > c.divergence_min_rise * abs(means[0]):
            threshold = means[0] * (1 + c.divergence_min_rise)
            self.means.clear()  # said once per rise
            return Verdict("divergence", "trend", step, means[-1], threshold, c.on_divergence,
                           since=max(1, step - len(means) * c.window + 1))
        return None


def skips_ahead(after: int) -> dict[int, int]:
    """{first step: how many steps' batches are skipped there}, for the windows that start
    after step `after` (a resume point past a window's start read past it already)."""
    out: dict[int, int] = {}
    for first, last in skip_windows():
        if first > after:
            out[first] = out.get(first, 0) + last - first + 1
    return out


def rewind_lr(cfg: StabilityConfig):
    """step -> the factor on its learning rate: `rewind_lr_factor` for the `rewind_lr_steps`
    steps from the start of each rewind's window (they train on the data after it), else 1."""
    starts = sorted({first for first, _ in skip_windows()})
    if cfg.rewind_lr_steps == 0 or cfg.rewind_lr_factor == 1.0 or not starts:
        return lambda step: 1.0
    return lambda step: cfg.rewind_lr_factor if any(
        first <= step < first + cfg.rewind_lr_steps for first in starts) else 1.0


def skip_batches(step: int, count: int, progress, job, open_loader, log):
    """A rewind's window: the batches of `count` steps from `step` on are not read; this
    step reads the one after them (steps keep their numbers, so the schedule is unchanged).
    The new loader's iterator is made without touching the training RNG."""
    first = progress.data_index
    progress.data_index += count * job.data.batch_size
    with torch.random.fork_rng(devices=[]):
        batches = iter(open_loader(progress.data_index))
    last = step + count - 1
    log.event("data_skip", f"the batches of steps {step}..{last} are skipped (a rewind): "
              f"samples [{first}, {progress.data_index}) not read; step {step} reads on from "
              "there", step=step, start=first, end=progress.data_index, window=[step, last])
    return batches


def marked(data: dict | None, updated: bool) -> dict | None:
    """A step's sample fingerprint, marked when its update was skipped (optimus data audit)."""
    return data if updated or data is None else {**data, "skipped": True}
