"""`optimus report` on a run with loss spikes, skipped steps, a divergence and a rewind: marked
on the loss figure and the timeline, counted in the facts, told from events or, without them,
from the journal's job record."""

from __future__ import annotations

import json
from pathlib import Path

from test_report import _assert_pngs, _step

from optimus.report import build_report, read_run
from optimus.report.facts import facts
from optimus.report.figures import draw_all, loss_figure
from optimus.report.timeline import marks, stability_marks


def _fingerprint(step: int, skipped: bool = False) -> dict:
    data = {"start": 8 * (step - 1), "end": 8 * step, "ids": f"{step:016x}", "reader": [0, 0]}
    return {**data, "skipped": True} if skipped else data


def _verdict(t: float, step: int, kind: str, rule: str, value: float, threshold: float,
             action: str) -> dict:
    """A `stability` event as the ranks write it (optimus/stability.py Verdict.fields)."""
    return {"time": t, "event": "stability", "message": f"{kind} at step {step}", "step": step,
            "verdict": kind, "rule": rule, "value": value, "threshold": threshold,
            "action": action, "samples": {"start": 8 * (step - 1), "end": 8 * step,
                                          "ids": "ab"}}


def _stability_run(run_dir: Path) -> None:
    """Generation 0 skips a spike at step 5, warns of a gradient-norm spike at 8 and stops for
    a rewind at 9; the controller rewinds to the checkpoint of step 6, skipping the batches of
    steps 9..10; generation 1 retrains 7 and 8 (no spike now), judges a divergence at 11 and
    skips step 12, a step between logged ones."""
    def step(n, t, loss, skipped=False, **kw):
        return {**_step(n, t, loss, **kw), "data": _fingerprint(n, skipped)}

    lines = [step(n, 100.0 + n, 5.0 - n / 10) for n in range(1, 5)]
    lines += [_verdict(104.9, 5, "spike", "loss", 9.0, 4.5, "skip_step"),
              step(5, 105.0, 9.0, skipped=True),
              {"time": 106.0, "step": 6, "data": _fingerprint(6)},
              step(7, 107.0, 4.3, committed=1, commit_step=6),
              _verdict(107.9, 8, "spike", "grad_norm", 50.0, 10.0, "warn"),
              step(8, 108.0, 4.2, committed=1, commit_step=6),
              _verdict(108.9, 9, "spike", "loss", 12.0, 4.6, "rewind"),
              {"time": 115.0, "event": "resume", "message": "resumed", "step": 6},
              step(7, 116.0, 4.25), step(8, 117.0, 4.15),
              {"time": 117.5, "event": "data_skip", "message": "skipped", "step": 9,
               "start": 64, "end": 80, "window": [9, 10]},
              {**step(9, 118.0, 4.1), "data": {**_fingerprint(9), "start": 80, "end": 88}},
              step(10, 119.0, 4.0),
              _verdict(119.9, 11, "divergence", "trend", 5.0, 4.0, "warn"),
              step(11, 120.0, 5.2),
              _verdict(120.9, 12, "spike", "loss", 8.0, 5.5, "skip_step"),
              {"time": 121.0, "step": 12, "data": _fingerprint(12, skipped=True)},
              step(13, 122.0, 5.0)]
    # as controller/control/rewind.py records it: the event's fields as text; the job
    # record's entry with the point it resumed from, filled in once planned
    reason = "spike at step 9 (loss 12 > 4.6)"
    rewind = {"id": "3-0", "time": 110.0, "actor": "controller", "kind": "rewind",
              "message": f"rewind ({reason}): the next generation resumes from the newest "
              "point at or before step 6 and skips the batches of steps 9..10", "step": "9",
              "first": "9", "last": "10", "to": "6", "by": "controller", "reason": reason}
    entry = {"step": 9, "first": 9, "last": 10, "resume_step": 6, "to": 6, "by": "controller",
             "reason": reason, "time": 109.98}
    events = [{"id": "1-0", "time": 99.0, "actor": "controller", "kind": "generation",
               "message": "generation 0 on node0 from scratch"}, rewind,
              {"id": "4-0", "time": 111.0, "actor": "controller", "kind": "generation",
               "message": "generation 1 on node0 from step 6"}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in events))
    (run_dir / "controller.json").write_text(json.dumps(
        {"job": {"state": "COMPLETED", "rewinds": json.dumps([entry])}}))


def test_spikes_skipped_steps_and_a_rewind_are_counted_and_marked(tmp_path):
    _stability_run(tmp_path)
    run = read_run(tmp_path)
    # the verdicts that count: the warning at 8 went with generation 0's line; the one that
    # asked for the rewind stays, as its reason
    assert [(v.step, v.kind, v.rule, v.action) for v in run.verdicts] == [
        (5, "spike", "loss", "skip_step"), (9, "spike", "loss", "rewind"),
        (11, "divergence", "trend", "warn"), (12, "spike", "loss", "skip_step")]
    assert run.skipped == [(5, 105.0), (12, 121.0)]
    assert [(d.step, d.start, d.end, d.first, d.last) for d in run.data_skips] == [
        (9, 64, 80, 9, 10)]
    assert [(r.step, r.first, r.last, r.resume_step, r.by) for r in run.rewinds] == [
        (9, 9, 10, 6, "controller")]

    table = dict(facts(run))
    assert "stability" not in table
    assert table["loss spikes"] == "3: 2 skipped their step, 1 asked for a rewind; 3 by the loss"
    assert table["divergences"] == "1: 1 warned; 1 by the trend"
    assert table["skipped steps"] == "2: steps 5, 12"
    assert table["rewinds"] == "1: rewind at step 9 to step 6, batches of steps 9..10 skipped"
    assert table["skipped data windows"] == "1: steps 9..10, samples [64, 80) not read"

    figures = {f.file: f for f in draw_all(run, tmp_path / "figures")}
    loss = figures["loss.png"]
    # tokens are 100 a step; step 12 was not logged: between 11 and 13, at 1200 tokens
    assert loss.series["spikes"] == ([500.0, 900.0, 1200.0], [9.0, 12.0, 8.0])
    assert loss.series["divergences"] == ([1100.0], [5.0])
    assert loss.series["skipped steps"] == ([500.0, 1200.0], [9.0, 8.0])
    assert loss.series["rewinds"] == ([900.0], [4.1])  # where the line ended, on the new line
    assert [(m.kind, m.step) for m in loss.marks] == [
        ("spike", 5), ("skipped", 5), ("spike", 9), ("divergence", 11), ("spike", 12),
        ("skipped", 12), ("rewind", 9)]
    assert "squares" in loss.caption and "dashed lines" in loss.caption
    timeline = figures["timeline.png"]
    at_steps = [(m.kind, m.step) for m in timeline.marks if m.kind in
                ("spike", "divergence", "skipped")]
    assert at_steps == [(m.kind, m.step) for m in stability_marks(run)]
    assert ("rewind", "rewind at step 9") in [(m.kind, m.label) for m in timeline.marks]

    page = build_report(tmp_path, tmp_path / "report")
    html = page.read_text()
    assert "<h2>Stability</h2>" in html
    assert "spike at step 5 (loss 9 &gt; 4.5): step skipped" in html
    assert "divergence at step 11 (window mean 5 &gt; 4): " not in html  # a warning: no action
    assert "divergence at step 11 (window mean 5 &gt; 4)</td>" in html
    assert ("rewind at step 9 to step 6, batches of steps 9..10 skipped: spike at step 9 (loss "
            "12 &gt; 4.6)") in html
    assert "before step 9: the batches of steps 9..10, samples [64, 80), not read" in html
    assert "<th>rewinds</th><td>1: rewind at step 9" in html
    _assert_pngs(page, {"timeline.png", "loss.png", "optimizer.png", "checkpoints.png"})


def test_without_events_the_rewinds_come_from_the_journal_s_job_record(tmp_path):
    _stability_run(tmp_path)
    (tmp_path / "events.jsonl").unlink()
    rewinds = [{"step": 9, "first": 9, "last": 10, "resume_step": 6, "to": 6,
                "by": "operator ana", "reason": "asked by operator ana", "time": 110.0},
               {"step": 14, "first": 14, "last": 20, "resume_step": None, "to": 12,
                "by": "controller", "reason": "spike at step 14", "time": 130.0},
               {"step": 3, "first": 3, "last": 4, "resume_step": 0, "to": 2,
                "by": "controller", "reason": "spike at step 3", "time": 140.0}, "not a rewind"]
    (tmp_path / "controller.json").write_text(json.dumps({"job": {"rewinds": json.dumps(
        rewinds)}}))
    run = read_run(tmp_path)
    assert [(r.step, r.resume_step, r.to, r.by, r.time) for r in run.rewinds] == [
        (9, 6, 6, "operator ana", 110.0), (14, None, 12, "controller", 130.0),
        (3, 0, 2, "controller", 140.0)]
    assert dict(facts(run))["rewinds"] == (
        "3: rewind at step 9 to step 6, batches of steps 9..10 skipped (by operator ana); "
        "rewind at step 14 to step 12 or before, batches of steps 14..20 skipped; "
        "rewind at step 3 to the start, batches of steps 3..4 skipped")


def test_rewinds_told_only_by_events_and_one_whose_ranks_named_no_step(tmp_path):
    _stability_run(tmp_path)
    (tmp_path / "controller.json").unlink()  # the events alone: no resume point known
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write(json.dumps({"id": "5-0", "time": 125.0, "actor": "controller",
                            "kind": "rewind", "message": "rewind (2 rank(s) stopped ...)",
                            "step": "", "first": "", "last": "", "to": "",
                            "by": "controller", "reason": "no one step"}) + "\n")
        f.write(json.dumps({"id": "6-0", "time": 126.0, "actor": "controller",
                            "kind": "rewind_budget", "message": "rewind budget used",
                            "step": "12", "earlier": "[9]"}) + "\n")
    run = read_run(tmp_path)
    assert [(r.step, r.to, r.resume_step) for r in run.rewinds] == [(9, 6, None),
                                                                   (None, None, None)]
    assert dict(facts(run))["rewinds"] == (
        "2: rewind at step 9 to step 6 or before, batches of steps 9..10 skipped; "
        "rewind (no one step named)")
    assert [(m.kind, m.label) for m in marks(run) if m.kind == "rewind"] == [
        ("rewind", "rewind at step 9"), ("rewind", "rewind"), ("rewind", "rewinds used up")]
    loss = loss_figure(run, tmp_path / "figures")
    assert loss.series["rewinds"] == ([900.0], [4.1])  # the one with a step
