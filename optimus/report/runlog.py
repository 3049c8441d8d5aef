"""What a run directory says about its run, read for the report.

- `metrics.jsonl`, rank 0's: a line per logged step, a short line ({"time", "step", "data"}) per
  step between logged ones, and event lines ({"time", "event", "message", ...}: resume,
  checkpoint, paused, stopped, eval, stability, data_skip, ...). Every generation appends to it,
  so a restart shows up as the steps going back: the new generation retrains the steps after
  the checkpoint it resumed from, and for each step the record of the generation that trained
  it last is the one that counts (as in `optimus data audit`). So do its stability verdicts,
  skipped steps (`"skipped": true` in a step's `data`) and skipped data windows, except a
  verdict that asked for a rewind: it ended its line, and is kept as the rewind's reason.
- `events.jsonl`, the control plane's events mirrored by the leading controller (none for a
  plain `optimus train`), among them each `rewind` (its fields as Redis holds them: text).
- `controller.json`, the controller's journal: the job record (with its `rewinds`, read when
  events.jsonl has none), the last plan, the exclusions.
- the checkpoint manifests (`optimus.json`): the resolved job configuration and layout
  (optimus/rundir.py, which `optimus data audit` reads too).

Robust to what a crash leaves: a line cut short, or not JSON, is skipped and counted.
Pure Python: no torch, no plotting.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from optimus.data.errors import DataError
from optimus.rundir import JOURNAL, read_json, run_config

RECENT = 4096  # steps whose times are kept while reading: a commit follows its step closely
TRACE = 20_000  # points of the progress line (a figure shows no more)


@dataclass
class Step:
    step: int
    time: float
    segment: int  # which start of training in metrics.jsonl logged it (0, 1, ...)
    loss: float
    tokens: int
    grad_norm: float | None = None
    lr: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    checkpoint: dict | None = None


@dataclass
class Eval:
    step: int
    time: float
    tokens: int | None
    loss: float
    perplexity: float | None = None


@dataclass
class Save:
    """A committed checkpoint, as the step line after its commit tells it."""

    step: int
    time: float  # of the step line that first counted the commit
    write_s: float | None  # from save() to rank 0's files written
    blocked_s: float | None  # how long the save held up training
    began: float | None = None  # when its step ended, so the save began (the step's line)


@dataclass
class Verdict:
    """A `stability` event: what the rules found at a step, and what the ranks did."""

    step: int
    time: float
    kind: str  # spike or divergence
    rule: str  # loss, grad_norm or trend
    value: float | None
    threshold: float | None
    action: str  # warn, skip_step or rewind


@dataclass
class DataSkip:
    """A rewind's window of batches not read (a `data_skip` event): steps first..last's."""

    step: int  # the step that read on after them
    time: float
    start: int  # samples [start, end) not read
    end: int
    first: int
    last: int


@dataclass
class Rewind:
    """A rewind, the controller's or an operator's: the line ended at `step` (None: the ranks
    named no one step, and the job paused for an operator) and went on from the newest point
    at or before `to`, which was `resume_step` (0: from scratch; None: not known, or not
    planned yet), the batches of steps first..last skipped."""

    time: float
    step: int | None
    first: int | None
    last: int | None
    to: int | None
    resume_step: int | None
    by: str
    reason: str


@dataclass
class Event:
    time: float
    kind: str
    message: str
    actor: str = ""
    fields: dict = field(default_factory=dict)


@dataclass
class Run:
    run_dir: Path
    logged: list[Step] = field(default_factory=list)  # every logged step line, file order
    # (time, step, segment) of every step line, logged or not, in file order; evenly thinned
    # to under TRACE points on a long run, each segment's last line kept
    trace: list[tuple[float, int, int]] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)  # the steps that count, by step
    evals: list[Eval] = field(default_factory=list)  # the validations that count, by step
    saves: list[Save] = field(default_factory=list)
    rank_events: list[Event] = field(default_factory=list)  # metrics.jsonl's event lines
    control: list[Event] = field(default_factory=list)  # events.jsonl
    # stability: the verdicts that count (and those that asked for a rewind), by time; the
    # steps that count whose update was skipped, (step, time) by step; the rewinds' windows
    # of batches not read that count; the controller's rewinds, by time
    verdicts: list[Verdict] = field(default_factory=list)
    skipped: list[tuple[int, float]] = field(default_factory=list)
    data_skips: list[DataSkip] = field(default_factory=list)
    rewinds: list[Rewind] = field(default_factory=list)
    segments: list[float] = field(default_factory=list)  # when each start of training began
    journal: dict = field(default_factory=dict)
    config: dict | None = None  # the resolved job configuration, when the run dir holds it
    layout: dict | None = None
    committed: list[int] = field(default_factory=list)  # steps with a committed checkpoint
    unreadable: int = 0  # lines skipped: cut short or not JSON objects

    @property
    def start(self) -> float | None:
        times = [t for t in (self.segments[:1] + [e.time for e in self.control[:1]]) if t]
        return min(times) if times else None

    @property
    def end(self) -> float | None:
        times = [x.time for x in (self.logged[-1:] + self.rank_events[-1:] + self.control[-1:])]
        return max(times) if times else None


def read_run(run_dir: Path | str) -> Run:
    """Everything the report needs from `run_dir`; DataError when there is no run there."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise DataError(f"{run_dir} is not a directory: give a run directory (the job's "
                        "run_dir, e.g. runs/tiny-gpt)")
    if not metrics.is_file():
        raise DataError(f"{run_dir} has no metrics.jsonl: give the run directory of a job that "
                        "has trained (rank 0 writes <run_dir>/metrics.jsonl)")
    run = Run(run_dir=run_dir)
    _read_metrics(run, _json_lines(run, metrics))
    if not run.logged and not run.evals:
        raise DataError(f"{metrics} holds no logged step yet: nothing to report")
    run.control = [Event(float(e.get("time") or 0.0), str(e.get("kind", "")),
                         str(e.get("message", "")), str(e.get("actor", "")),
                         {k: v for k, v in e.items()
                          if k not in ("id", "time", "kind", "message", "actor")})
                   for e in _json_lines(run, run_dir / "events.jsonl")]
    run.journal = read_json(run_dir / JOURNAL) or {}
    run.rewinds = _rewinds(run)
    _read_config(run)
    return run


def _json_lines(run: Run, path: Path) -> Iterator[dict]:
    """The file's JSON objects, one by one (a long run's file need not fit in memory)."""
    if not path.is_file():
        return
    with open(path, errors="replace") as f:
        for text in f:
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except ValueError:  # a line cut short by a crash: the rest still counts
                run.unreadable += 1
                continue
            if isinstance(row, dict):
                yield row
            else:
                run.unreadable += 1


def _read_metrics(run: Run, rows: Iterable[dict]) -> None:
    counted: dict[int, Step] = {}
    evals: dict[int, Eval] = {}
    verdicts: dict[int, Verdict] = {}
    skipped: dict[int, float] = {}
    skips: dict[int, DataSkip] = {}
    asked: list[Verdict] = []  # verdicts that asked for a rewind, whose line was rolled back
    last_step = None
    committed_before = 0  # this segment's saves_committed so far
    ended: dict[int, float] = {}  # the recent steps' times, to place a save at its step
    # The progress line: (line number, point) of every stride-th step line, and of each
    # segment's last line, kept apart so that thinning never drops one
    lines, stride, point = 0, 1, None
    trace: list[tuple[int, tuple]] = []
    ends: list[tuple[int, tuple]] = []

    def roll_back(after: int) -> None:  # a restart: steps after `after` were not kept
        asked.extend(v for s, v in verdicts.items() if s > after and v.action == "rewind")
        for table in (counted, evals, verdicts, skipped, skips):
            for s in [s for s in table if s > after]:
                del table[s]

    for row in rows:
        when = _number(row.get("time"))
        if when is None:
            run.unreadable += 1
            continue
        kind = row.get("event")
        if kind is not None:
            fields = {k: v for k, v in row.items() if k not in ("time", "event", "message")}
            run.rank_events.append(Event(when, str(kind), str(row.get("message", "")),
                                         "rank 0", fields))
            if kind == "resume" and _number(row.get("step")) is not None:
                roll_back(int(row["step"]))
                run.segments.append(when)
                last_step, committed_before = int(row["step"]), 0
            elif kind == "eval" and _number(row.get("val_loss")) is not None:
                step = int(row.get("step", last_step or 0))
                evals[step] = Eval(step, when, _int(row.get("tokens")), float(row["val_loss"]),
                                   _number(row.get("perplexity")))
            elif kind == "stability" and (verdict := _verdict(row, when)) is not None:
                verdicts[verdict.step] = verdict
            elif kind == "data_skip" and (skip := _data_skip(row, when)) is not None:
                skips[skip.step] = skip
            continue
        step = _int(row.get("step"))
        if step is None:
            run.unreadable += 1
            continue
        if last_step is None or step <= last_step:  # the first line, or a start from scratch
            roll_back(step - 1)
            run.segments.append(when)
            committed_before = 0
        last_step = step
        segment = len(run.segments) - 1
        if point is not None and point[2] != segment:
            ends.append((lines - 1, point))  # where the restarted segment stopped
        point, lines = (when, step, segment), lines + 1
        if (lines - 1) % stride == 0:
            trace.append((lines - 1, point))
            if len(trace) >= TRACE:
                trace, stride = trace[::2], 2 * stride
        ended.pop(step, None)
        ended[step] = when
        if len(ended) > RECENT:
            del ended[next(iter(ended))]
        if isinstance(row.get("data"), dict) and row["data"].get("skipped") is True:
            skipped[step] = when
        if _number(row.get("loss")) is None:
            continue  # a step between logged ones: only its samples' fingerprint
        line = Step(step, when, segment, float(row["loss"]),
                    _int(row.get("tokens")) or 0, _number(row.get("grad_norm")),
                    _number(row.get("lr")), _number(row.get("tokens_per_s")),
                    _number(row.get("mfu")), row.get("checkpoint") or None)
        run.logged.append(line)
        counted[step] = line
        ckpt = line.checkpoint or {}
        if int(ckpt.get("saves_committed") or 0) > committed_before:
            committed_before = int(ckpt["saves_committed"])
            if ckpt.get("last_commit_step") is not None:
                saved = int(ckpt["last_commit_step"])
                run.saves.append(Save(saved, when, _number(ckpt.get("last_write_s")),
                                      _number(ckpt.get("last_blocked_s")), ended.get(saved)))
    if point is not None:
        ends.append((lines - 1, point))
    run.trace = [p for _, p in sorted(dict(trace + ends).items())]
    run.steps = [counted[s] for s in sorted(counted)]
    run.evals = [evals[s] for s in sorted(evals)]
    run.verdicts = sorted([*asked, *verdicts.values()], key=lambda v: (v.time, v.step))
    run.skipped = sorted(skipped.items())
    run.data_skips = [skips[s] for s in sorted(skips)]


def _verdict(row: dict, when: float) -> Verdict | None:
    step = _int(row.get("step"))
    if step is None or row.get("verdict") not in ("spike", "divergence"):
        return None
    return Verdict(step, when, str(row["verdict"]), str(row.get("rule", "")),
                   _number(row.get("value")), _number(row.get("threshold")),
                   str(row.get("action", "")))


def _data_skip(row: dict, when: float) -> DataSkip | None:
    numbers = [_int(row.get(k)) for k in ("step", "start", "end")]
    window = row.get("window")
    if None in numbers or not isinstance(window, list) or len(window) != 2:
        return None
    first, last = (_int(x) for x in window)
    if first is None or last is None:
        return None
    return DataSkip(numbers[0], when, numbers[1], numbers[2], first, last)


def _rewinds(run: Run) -> list[Rewind]:
    """The rewinds: the control plane's `rewind` events (their fields are text there: Redis
    holds text), each with the point it resumed from where the job record's list in the
    journal says (it keeps the newest 100); that list alone where events.jsonl has none."""
    listed = (run.journal.get("job") or {}).get("rewinds")
    try:
        listed = json.loads(listed) if isinstance(listed, str) else listed
    except ValueError:
        listed = None
    kept = [_rewind(r) for r in listed if isinstance(r, dict)] if isinstance(listed, list) else []
    said = [_rewind({**e.fields, "time": e.time}) for e in run.control if e.kind == "rewind"]
    if not said:
        return sorted(kept, key=lambda r: r.time)
    for r in said:  # the record's entry: same step and actor, written in the same tick
        entry = next((k for k in kept if (k.step, k.by) == (r.step, r.by)
                      and abs(k.time - r.time) < 60), None)
        if entry is not None:
            r.resume_step = entry.resume_step
    return sorted(said, key=lambda r: r.time)


def _rewind(r: dict) -> Rewind:
    return Rewind(_number(r.get("time")) or 0.0, _count(r.get("step")), _count(r.get("first")),
                  _count(r.get("last")), _count(r.get("to")), _count(r.get("resume_step")),
                  str(r.get("by") or ""), str(r.get("reason") or ""))


def _count(value) -> int | None:
    """A whole number, given as one or as the text Redis keeps it as ("12"); else None."""
    if isinstance(value, str) and value.isdigit() and len(value) < 19:
        return int(value)
    return value if type(value) is int else None


def _read_config(run: Run) -> None:
    found = run_config(run.run_dir, run.journal)
    run.config, run.layout, run.committed = found.config, found.layout, found.committed


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int(value) -> int | None:
    number = _number(value)
    return None if number is None else int(number)
