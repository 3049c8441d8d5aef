"""`optimus data audit RUN_DIR`: whether a run read every sample exactly once, across restarts.

Every step leaves its samples' fingerprint in `<run_dir>/metrics.jsonl` (`metrics.py`,
`sample_fingerprint`): the global sample-index range [start, end) the step read, a hash of the
sample ids rank 0 read, and the slice rank 0 reads. Every generation of the run appends to the
same file, so a restart shows up as steps going back: the new generation resumed from a
checkpoint of step c (its `resume` event says which, and the checkpoint's data index) and trains
steps c+1, c+2, ... again. Those later records supersede the earlier generation's records of the
same steps, which no checkpoint kept: the steps that count are, for each step, the one of the
generation that last trained it.

The audit then checks that
- the steps that count run 1, 2, ..., N without a hole (a step without a record cannot be
  audited);
- their index ranges tile: each step starts where the one before it ended (a gap: samples
  skipped; an overlap: samples read twice), from index 0 at step 1;
- a checkpoint resumed from holds the index where its step ended;
- a step trained again after a restart, over the same indices and the same slice, read the same
  samples (else the data order changed under the run: seed, data, sequence length).

Pure Python: it reads the file and nothing else, so it runs anywhere (no torch, no data).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from optimus.data.errors import DataError

__all__ = ["Audit", "audit", "audit_run"]


@dataclass
class Audit:
    steps: int = 0  # steps that count
    first_step: int | None = None
    last_step: int | None = None
    start: int | None = None  # the sample-index range they read: [start, end)
    end: int | None = None
    generations: int = 0  # times training started or resumed in this file
    repeated: int = 0  # steps trained again after a restart (the earlier ones superseded)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def audit_run(run_dir: Path | str) -> Audit:
    """Audit `<run_dir>/metrics.jsonl` (or a metrics file given directly)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{path} does not exist: give a run directory (the job's run_dir) "
                        "or its metrics.jsonl")
    with open(path) as f:
        return audit(_lines(f, path))


def _lines(f, path: Path) -> Iterator[dict]:
    for n, text in enumerate(f, 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError:  # a line cut short by a crash: the rest of the file still counts
            yield {"event": "unreadable", "line": n}
            continue
        if isinstance(line, dict):
            yield line


def audit(lines: Iterable[dict]) -> Audit:
    """Audit metrics.jsonl lines, in file order."""
    result = Audit()
    kept: dict[int, dict] = {}  # step -> fingerprint, of the generation that last trained it
    seen: dict[int, list[dict]] = {}  # every fingerprint of each step, superseded ones too
    no_data: list[int] = []  # steps that count but carry no fingerprint
    last = 0  # the newest step that counts
    records = 0
    resumed = False  # a resume event opened a generation that has no step record yet

    def roll_back(to: int) -> None:
        nonlocal last
        for step in [s for s in kept if s > to]:
            del kept[step]
        no_data[:] = [s for s in no_data if s <= to]
        last = min(last, to)

    for line in lines:
        event = line.get("event")
        if event == "unreadable":
            result.notes.append(f"line {line['line']} of metrics.jsonl is not JSON (a crash "
                                "mid-write?); skipped")
            continue
        if event == "resume" and isinstance(line.get("step"), int):
            c = line["step"]
            result.generations += 1
            resumed = True
            if records and c > last:
                result.problems.append(
                    f"a generation resumed from the checkpoint of step {c}, but the history "
                    f"holds steps only up to {last}: steps {last + 1}..{c} have no record")
            index = line.get("data_index")
            if c in kept and isinstance(index, int) and kept[c]["end"] != index:
                result.problems.append(
                    f"the checkpoint of step {c} holds data index {index}, but step {c} "
                    f"ended at index {kept[c]['end']}: the resume "
                    + ("skips" if index > kept[c]["end"] else "repeats") + " samples")
            roll_back(c)
            continue
        if event is not None or not isinstance(line.get("step"), int):
            continue
        step = line["step"]
        if not resumed and (records == 0 or step <= last):
            result.generations += 1  # started from scratch (or resumed without saying so)
        if step <= last:
            roll_back(step - 1)
        resumed, last, records = False, step, records + 1
        data = line.get("data")
        if not isinstance(data, dict):
            no_data.append(step)
            continue
        kept[step] = data
        seen.setdefault(step, []).append(data)

    _check(result, kept, seen, no_data)
    return result


def _check(result: Audit, kept: dict[int, dict], seen: dict[int, list[dict]],
           no_data: list[int]) -> None:
    if no_data:
        shown = ", ".join(map(str, no_data[:5])) + (" ..." if len(no_data) > 5 else "")
        result.problems.append(f"{len(no_data)} step(s) that count have no sample fingerprint "
                               f"(written before fingerprints existed?): {shown}")
    steps = sorted(kept)
    if not steps:
        if not no_data:
            result.problems.append("no step recorded: nothing to audit")
        return
    result.steps, result.first_step, result.last_step = len(steps), steps[0], steps[-1]
    result.start, result.end = kept[steps[0]]["start"], kept[steps[-1]]["end"]
    if steps[0] == 1 and kept[1]["start"] != 0:
        result.problems.append(f"step 1 starts at sample index {kept[1]['start']}, not 0: "
                               f"samples [0, {kept[1]['start']}) were never read")
    elif steps[0] != 1:
        result.notes.append(f"the history starts at step {steps[0]} (sample index "
                            f"{kept[steps[0]]['start']}): the steps before are not in this file")
    unknown = set(no_data)
    for a, b in zip(steps, steps[1:], strict=False):
        if b != a + 1:  # what the steps between read is unknown: no tiling to check here
            if not set(range(a + 1, b)) <= unknown:
                result.problems.append(f"steps {a + 1}..{b - 1} have no record: cannot tell "
                                       "what they read")
            continue
        end, start = kept[a]["end"], kept[b]["start"]
        if start > end:
            result.problems.append(f"gap: samples [{end}, {start}) were skipped between step "
                                   f"{a} and step {b}")
        elif start < end:
            result.problems.append(f"overlap: samples [{start}, {end}) were read twice, by step "
                                   f"{a} and by step {b}")
    for step, reads in sorted(seen.items()):
        if len(reads) < 2:
            continue
        result.repeated += 1
        final = kept.get(step)
        if final is None:
            continue
        for earlier in reads:
            if earlier is final:
                continue
            same = all(earlier.get(k) == final.get(k) for k in ("start", "end", "reader"))
            if same and earlier.get("ids") != final.get("ids"):
                result.problems.append(
                    f"step {step} read other samples after a restart than before, over the same "
                    f"indices [{final['start']}, {final['end']}): the data order changed under "
                    "the run (seed, data or sequence length)")
                break
