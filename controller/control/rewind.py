"""Rewinds: a loss spike or a divergence the ranks stopped for, or an operator's
`optimus job rewind`, turned into a generation that resumes from before it and skips a window
of batches. Pure rules, like decide.py, which applies them.

- The ranks' request: with `stability.on_spike` (or `on_divergence`) `rewind`, every rank
  reaches the same verdict at the same step (optimus/stability.py), prints one
  `rewind-request {json}` line and stops before the step's update, saving nothing (exit 90;
  in process it waits for the next generation). `asked` waits up to settle_s for every rank's
  exit; ranks of every node must have asked and their lines must name one step. The line
  crossed a boundary (a rank's log, through its agent): only a bounded, well-formed one is
  read, and no node alone can make the job rewind (docs/security.md).
- The window: the batches of steps [spike - rewind_skip_before, spike + rewind_skip_after] are
  skipped; the next generation resumes from the newest point (memory snapshot or committed
  checkpoint) at least rewind_back steps before the window and before a divergence's rise
  (`floor`). An operator names the point (`--to`) and the window (`--skip-steps A:B`, or
  `--skip-samples N`: the batches of the steps that hold them, rounded up to whole steps).
- The abandoned line: the mechanism a bad tile's window uses (recovery.py, checkpoints.py),
  with no node named: the job record's `suspect` holds {"nodes": [], "resumed_step": floor,
  "rewind": spike}, so once no rank runs the checkpoints committed after `floor` are set aside
  (quarantine, kind suspect) and no memory point newer than it is trusted; the next plan's
  lineage voids the rest.
- The windows: the job record's `skips` keeps every window of the job in order; each plan
  carries them to the agents, which pass them to the ranks (OPTIMUS_SKIP_STEPS). A rank skips
  those that start after the point it resumed from: a point past a window's start read past it
  already.
- The budget: more than `rewind_budget` of the controller's rewinds whose spikes lie within
  `rewind_budget_steps` steps, and the rewind is still planned but the job pauses before its
  first step (the control word's pause, as an operator's), with the reason, for an operator to
  resume or rewind by hand. An operator's rewinds do not count.
"""

from __future__ import annotations

import json
import math

from controller.control.actions import restarted, with_action
from controller.control.view import RESTARTING, Decision, Exit, JobView, Observed, Settings
from optimus.contract.exits import EXIT_REWIND, REWIND_LINE

MAX_LINE = 2048  # a request line is ~150 bytes
KEPT = 100  # rewinds the job record keeps (the newest); the budget looks at fewer


# --- the decision, applied (decide.py calls these) ----------------------------------------

def by_ranks(obs: Observed, s: Settings, d: Decision) -> bool:
    """Ranks that stopped for a rewind (exit 90): once every rank has (or settle_s passed),
    the rewind they asked for. True: the ranks' exits are taken (waited for, or acted on)."""
    waiting, request, exits = asked(obs, s)
    if not exits or waiting:
        return bool(exits)
    if request is None:  # resuming on would meet the spike again: an operator chooses
        why = (f"{len(exits)} rank(s) stopped for a rewind, but their logs' tails name no one "
               "step (no readable rewind-request line, or lines that disagree)")
        d.job.update({"desired": "pause", "desired_by": "controller", "desired_reason": why})
        d.control = {**obs.control, "pause": True}
        apply(obs, s, d, step=None, window=None, floor=None, by="controller", reason=why)
        return True
    first, last, floor = window_for(request, s)
    what = (f"{request['verdict']} at step {request['step']}"
            + (f" ({request['rule']} {request['value']:.4g} > {request['threshold']:.4g})"
               if request["value"] is not None and request["threshold"] is not None else ""))
    apply(obs, s, d, step=request["step"], window=(first, last), floor=floor,
            by="controller", reason=what)
    return True


def by_operator(obs: Observed, s: Settings, d: Decision) -> None:
    """An operator's rewind (operator.take_requests took and checked it)."""
    asked = obs.rewind_asked
    window = operator_window(asked["to"], asked["skip"], asked["samples"], s.batch_size)
    reason = f"asked by {asked['by']}" + (f": {asked['reason']}" if asked["reason"] else "")
    apply(obs, s, d, step=asked["to"] + 1, window=window, floor=asked["to"],
            by=asked["by"], reason=reason, said=asked["said"])


def apply(obs: Observed, s: Settings, d: Decision, *, step: int | None,
            window: tuple[int, int] | None, floor: int | None, by: str, reason: str,
            said: dict | None = None) -> None:
    """The running generation (if any) stops without saving; the next resumes from the newest
    point at or before `floor` (None: the latest, as after a failure) and skips `window`."""
    job, plan = obs.job, obs.plan
    message = f"rewind ({reason})"
    if floor is not None:
        d.job.update(record(job, step=step, window=window, floor=floor, by=by,
                                   reason=reason, now=obs.now))
        message += (f": the next generation resumes from the newest point at or before step "
                    f"{floor}" + (f" and skips the batches of steps {window[0]}..{window[1]}"
                                  if window else ""))
    earlier = over_budget(job, s, step) if by == "controller" and step else None
    if earlier is not None:
        at = f" (at step {', '.join(map(str, earlier))})" if earlier else ""
        why = (f"rewind budget used: {len(earlier)} rewind(s) of at most {s.rewind_budget} "
               f"within {s.rewind_budget_steps} steps{at}, now one at step {step}")
        d.job.update({"desired": "pause", "desired_by": "controller", "desired_reason": why})
        d.control = {**obs.control, "pause": True}
        d.note("rewind_budget", f"{why}: the rewind is planned and the job pauses before its "
               "first step; `optimus job resume` goes on from there, `optimus job rewind` "
               "chooses another point", step=step, earlier=earlier)
    if plan is not None and plan["action"] == "run":
        d.plan = with_action(plan, "stop", s.failure_grace_s, message, obs.now, save=False)
    d.job.update({"state": RESTARTING, "reason": message, "failure_since": None,
                  "next_plan_at": obs.now, "hang_since": None,
                  **restarted(job, "rewind", obs.now)})
    first, last = window or ("", "")
    d.note("rewind", message, **{**(said or {}), "step": "" if step is None else step,
                                  "first": first, "last": last,
                                  "to": "" if floor is None else floor, "by": by,
                                  "reason": reason})


# --- the rules ------------------------------------------------------------------------------

def request_of(e: Exit) -> dict | None:
    """A rank's rewind request from its log's tail (the last one), or None."""
    for line in reversed(e.tail.splitlines()):
        if not line.startswith(REWIND_LINE):
            continue
        if len(line) > MAX_LINE:
            return None
        try:
            said = json.loads(line[len(REWIND_LINE):])
        except ValueError:
            return None
        if not isinstance(said, dict) or not _step(said.get("step")):
            return None
        step = said["step"]
        since = said.get("since") if _step(said.get("since")) and said["since"] <= step else step
        return {"step": step, "since": since,
                "verdict": str(said.get("verdict", "spike"))[:16],
                "rule": str(said.get("rule", ""))[:16],
                "value": _number(said.get("value")), "threshold": _number(said.get("threshold"))}
    return None


def asked(obs: Observed, s: Settings) -> tuple[bool, dict | None, list[Exit]]:
    """(waiting, the request, the ranks that asked): waiting while some ranks of the generation
    have asked and the others' exits may still come (settle_s); then the request, when ranks
    of every node of the generation asked and their readable requests name one step (None:
    they name none, or several). Ranks of some nodes only are no rewind (no exits: the usual
    rules judge them): one node's word, which it controls, must not rewind the job."""
    exits = sorted((e for e in obs.exits if e.code == EXIT_REWIND), key=lambda e: e.rank)
    if not exits:
        return False, None, []
    if (len({e.rank for e in exits}) < obs.plan["world_size"]
            and obs.now - min(e.time for e in exits) < s.settle_s):
        return True, None, exits
    if not set(obs.plan["nodes"]) <= {e.node for e in exits}:
        return False, None, []
    said = [r for e in exits if (r := request_of(e)) is not None]
    if len({(r["step"], r["since"]) for r in said}) != 1:
        return False, None, exits
    return False, said[0], exits


def window_for(request: dict, s: Settings) -> tuple[int, int, int]:
    """The ranks' request: (first, last) steps whose batches are skipped, and the newest step
    the next generation may resume from."""
    spike = request["step"]
    first, last = max(1, spike - s.rewind_skip_before), spike + s.rewind_skip_after
    floor = max(0, min(first, request["since"]) - 1 - s.rewind_back)
    return first, last, floor


def operator_window(to: int, skip: tuple[int, int] | None, samples: int | None,
                    batch_size: int) -> tuple[int, int] | None:
    """An operator's window: --skip-steps A:B as it is; --skip-samples N as the steps after
    `to` that hold them, rounded up to whole steps; None: nothing skipped."""
    if skip is not None:
        return skip
    if samples:
        return to + 1, to + math.ceil(samples / batch_size)
    return None


def over_budget(job: JobView, s: Settings, spike: int) -> list[int] | None:
    """The steps of the controller's earlier rewinds inside this one's budget span when one
    more is over the budget; None when it is not."""
    recent = [r["step"] for r in job.rewinds if r.get("by") == "controller"
              and isinstance(r.get("step"), int) and spike - s.rewind_budget_steps < r["step"]]
    return recent if len(recent) >= s.rewind_budget else None


def record(job: JobView, *, step: int, window: tuple[int, int] | None, floor: int, by: str,
           reason: str, now: float) -> dict:
    """The job record's fields for a rewind: the rewinds list, the windows, the suspect window
    that sets the abandoned line aside (`rewind`: what the messages say of its cause)."""
    first, last = window if window else (None, None)
    entry = {"step": step, "first": first, "last": last, "resume_step": None, "to": floor,
             "by": by, "reason": reason, "time": now}
    cause = f"the spike at step {step}" if by == "controller" else f"asked by {by}"
    fields = {"rewinds": [*job.rewinds, entry][-KEPT:],
              "suspect": {"nodes": [], "generation": job.generation, "evidence": reason,
                          "resumed_step": floor, "rewind": cause}}
    if window:
        fields["skips"] = [*job.skips, [first, last]]
    return fields


def resumed(job: JobView, step: int | None) -> list | None:
    """The rewinds list with the pending one's resume point filled in (0: from scratch), when
    a plan carries it out; None when none is pending."""
    if not job.rewinds or job.rewinds[-1].get("resume_step") is not None:
        return None
    return [*job.rewinds[:-1], {**job.rewinds[-1], "resume_step": step or 0}]


def _step(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 1 << 40


def _number(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) else None
