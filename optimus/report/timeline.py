"""The run's timeline: what the control plane and the ranks did, as marks on the wall clock.

Each mark is a moment (a generation planned, a fault with its culprit, an exclusion, a failed
save, a failover, a rewind) or a span (a pause), with a short label for the figure. The control
plane's events (`events.jsonl`) are the source where the run has them; a plain `optimus train`
run has only rank 0's events, from which restarts and pauses are still told.

Checkpoint commits, validations, the stability rules' verdicts (loss spikes, divergences) and
the steps whose update was skipped can come every few steps all run long: they are marks at a
step (`progress_marks`), drawn on the progress line rather than across the figure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from optimus.report.runlog import Event, Rewind, Run, Verdict

# kind -> what it looks like on a figure: colour, line style
STYLE = {
    "generation": ("#6b7280", "--"),
    "fault": ("#dc2626", "-"),
    "exclusion": ("#7f1d1d", ":"),
    "pause": ("#2563eb", "-"),
    "save_failed": ("#ea580c", "-."),
    "straggler": ("#9333ea", ":"),
    "failover": ("#0d9488", "-."),
    "end": ("#111827", "-"),
    "rewind": ("#7c3aed", "--"),
    "checkpoint": ("#059669", "v"),  # marks at a step: colour, marker
    "validation": ("#d62728", "D"),
    "spike": ("#f59e0b", "X"),
    "divergence": ("#b91c1c", "^"),
    "skipped": ("#a16207", "s"),  # drawn hollow, around its spike's cross
}
AT_A_STEP = ("checkpoint", "validation", "spike", "divergence", "skipped")
TERMINAL = {"completed": "completed", "failed": "FAILED", "stopped": "stopped"}


@dataclass
class Mark:
    time: float
    kind: str  # a key of STYLE
    label: str
    end: float | None = None  # a span's end (a pause); None: a moment
    detail: str = ""  # the event's whole message, for the page's table
    step: int | None = None  # a mark at a step: the step it belongs to


def marks(run: Run) -> list[Mark]:
    """Every mark of the run, in time order."""
    found = _control_marks(run.control) if run.control else _rank_restarts(run)
    if not any(m.kind == "pause" for m in found):  # spans from the control plane come first
        found += _pauses(run.rank_events, "paused", "resumed", run.end)
    found += [Mark(e.time, "save_failed", "save failed" + _step_of(e.message), detail=e.message)
              for e in run.rank_events if failed_save(e)]
    return sorted(found, key=lambda m: m.time)


def progress_marks(run: Run) -> list[Mark]:
    """The checkpoints committed, each when its step ended (the save began), and the
    validations that count, in time order."""
    found = {s.step: Mark(s.began or s.time, "checkpoint", f"checkpoint of step {s.step}",
                          step=s.step) for s in run.saves}
    for e in run.rank_events:  # a save at a stop: committed before the stop event
        if e.kind == "stopped" and isinstance(e.fields.get("checkpoint_step"), int):
            step = e.fields["checkpoint_step"]
            found[step] = Mark(e.time, "checkpoint", f"checkpoint of step {step}", step=step)
    last = run.steps[-1] if run.steps else None
    if last is not None and last.step in run.committed and last.step not in found:
        found[last.step] = Mark(last.time, "checkpoint", f"checkpoint of step {last.step}",
                                step=last.step)  # the last step's save, on disk
    checks = [Mark(e.time, "validation", f"validation at step {e.step}: {e.loss:.4f}",
                   step=e.step) for e in run.evals]
    return sorted([*found.values(), *checks, *stability_marks(run)], key=lambda m: m.time)


def stability_marks(run: Run) -> list[Mark]:
    """The stability rules' verdicts (a loss spike, a divergence) and the steps whose update
    was skipped, each at its step, in time order."""
    found = [Mark(v.time, v.kind, verdict_text(v), step=v.step) for v in run.verdicts]
    found += [Mark(t, "skipped", f"step {step} skipped", step=step) for step, t in run.skipped]
    return sorted(found, key=lambda m: m.time)


def verdict_text(v: Verdict) -> str:
    """"spike at step 120 (loss 7.1 > 4.3): step skipped" from a Verdict."""
    what = {"loss": "loss", "grad_norm": "gradient norm", "trend": "window mean"}.get(v.rule,
                                                                                   v.rule)
    than = (f" ({what} {v.value:.4g} > {v.threshold:.4g})"
            if v.value is not None and v.threshold is not None else "")
    did = {"warn": "", "skip_step": ": step skipped",
           "rewind": ": rewind asked"}.get(v.action, f": {v.action}")
    return f"{v.kind} at step {v.step}{than}{did}"


def rewind_text(r: Rewind) -> str:
    """"rewind at step 120 to step 100, batches of steps 120..130 skipped" from a Rewind."""
    text = f"rewind at step {r.step}" if r.step is not None else "rewind (no one step named)"
    if r.resume_step is not None:
        text += f" to step {r.resume_step}" if r.resume_step else " to the start"
    elif r.to is not None:
        text += f" to step {r.to} or before"
    if r.first is not None and r.last is not None:
        text += f", batches of steps {r.first}..{r.last} skipped"
    return text + (f" (by {r.by})" if r.by and r.by != "controller" else "")


def failed_save(e: Event) -> bool:
    """A rank-0 `checkpoint` event that reports a save that failed (it carries the counters)."""
    return (e.kind == "checkpoint" and "saves_failed" in e.fields
            and "skipped" not in e.message)


def _control_marks(events: list[Event]) -> list[Mark]:
    found: list[Mark] = []
    leaders = 0
    for e in events:
        f = e.fields
        if e.kind == "generation":
            number = re.match(r"generation (\d+)", e.message)
            found.append(Mark(e.time, "generation", f"gen {number.group(1) if number else '?'}",
                              detail=e.message))
        elif e.kind == "failure":
            found.append(Mark(e.time, "fault", "fault: " + culprit(f), detail=e.message))
            if _flag(f.get("excluded")) and f.get("node"):
                found.append(Mark(e.time, "exclusion", f"{f['node']} excluded",
                                  detail=e.message))
        elif e.kind in ("exclude", "drain") and f.get("node"):
            found.append(Mark(e.time, "exclusion", f"{f['node']} {e.kind}d by {e.actor}",
                              detail=e.message))
        elif e.kind == "straggler":
            found.append(Mark(e.time, "straggler", f"straggler {f.get('node', '')}".strip(),
                              detail=e.message))
        elif e.kind == "leader":
            leaders += 1
            if leaders > 1:  # the first is the start
                found.append(Mark(e.time, "failover", "controller failover", detail=e.message))
        elif e.kind == "rebuilt":
            found.append(Mark(e.time, "failover", "Redis rebuilt", detail=e.message))
        elif e.kind == "rewind":
            at = f.get("step")
            found.append(Mark(e.time, "rewind", f"rewind at step {at}" if str(at).isdigit()
                              else "rewind", detail=e.message))
        elif e.kind == "rewind_budget":
            found.append(Mark(e.time, "rewind", "rewinds used up", detail=e.message))
        elif e.kind in TERMINAL:
            found.append(Mark(e.time, "end", TERMINAL[e.kind], detail=e.message))
    end = events[-1].time if events else None
    return found + _pauses(events, "paused", "resumed", end)


def culprit(fields: dict) -> str:
    """"rank 1 on node2 (rank_exit)" from a failure event's fields; "no culprit" without."""
    node, rank, cause = fields.get("node"), fields.get("rank"), fields.get("cause")
    if not node:
        return f"no culprit ({cause})" if cause else "no culprit"
    who = f"rank {rank} on {node}" if rank not in (None, "") else node
    return f"{who} ({cause})" if cause else who


def _pauses(events: list[Event], start: str, stop: str, end: float | None) -> list[Mark]:
    """Spans from each `start` event to the next `stop` (or to the end of the run)."""
    spans, began = [], None
    for e in events:
        if e.kind == start and began is None:
            began = e
        elif e.kind == stop and began is not None:
            spans.append(Mark(began.time, "pause", "paused", end=e.time, detail=began.message))
            began = None
    if began is not None:
        spans.append(Mark(began.time, "pause", "paused", end=max(end or began.time, began.time),
                          detail=began.message))
    return spans


def _rank_restarts(run: Run) -> list[Mark]:
    """Without the control plane's events: each start of training after the first."""
    return [Mark(t, "generation", f"restart {i}", detail="rank 0 started training again")
            for i, t in enumerate(run.segments[1:], 1)]


def lost_to_restarts(run: Run) -> float:
    """Seconds of wall time that made no progress because of restarts: for each restart, from
    the last step the stopped generation logged to when the next one logged that step again
    (or, if it never did, its last step)."""
    lost = 0.0
    by_segment: dict[int, list] = {}
    for s in run.logged:
        by_segment.setdefault(s.segment, []).append(s)
    segments = [by_segment[k] for k in sorted(by_segment)]
    for before, after in zip(segments, segments[1:], strict=False):
        furthest = max(s.step for s in before)
        regained = next((s.time for s in after if s.step >= furthest), after[-1].time)
        lost += max(regained - before[-1].time, 0.0)
    return lost


def _step_of(message: str) -> str:
    found = re.search(r"step (\d+)", message)
    return f" (step {found.group(1)})" if found else ""


def _flag(value) -> bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return False
    return bool(value)
