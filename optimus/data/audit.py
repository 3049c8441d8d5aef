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

A rewind's window (a `data_skip` event: the batches of steps it names were not read; the next
step reads on after them) is a gap the audit accepts, and lists in a note.
A step whose update the stability rules skipped (`"skipped": true` in its fingerprint) still
read its samples: they are accounted as read and not trained on, and listed in a note.
A step trained by replicas that carry on (`supervision.on_replica_loss: continue`) while some
were out of the quorum names its members and the replica count (`"replicas"`, `"of"`): the
slices of the absent replicas were read by no rank. They are accounted as skipped, by index
range (`untrained`), and listed in a note; the step still counts.

For a mixture run (`data.sources`) it also counts how many of those samples each source gave,
beside the share its weight asks for. The file does not hold the ids themselves (only their
hash), but it holds what decides them: each step's index range, and the mixture (its sources and
quotas) in the `mixture` event each start of training logs. With the run's seed (from the
checkpoint manifest or the job file, as `optimus report` reads them) the source of every index
is known without the data (`mixture.py`).

It reads the file and nothing else (no data, and no torch unless the run is a mixture), so it
runs anywhere.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from optimus.data.errors import DataError
from optimus.data.order import block_permutation

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
    skipped: list[int] = field(default_factory=list)  # steps that count whose update was skipped
    # Sample ranges a rewind skipped unread ([start, end), before the step that read on)
    unread: list[tuple[int, int]] = field(default_factory=list)
    # Steps trained while replicas were out of the quorum: [step, [absent replicas]], and the
    # sample ranges ([start, end)) their slices held, which no rank read
    absent: list[list] = field(default_factory=list)
    untrained: list[tuple[int, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # A mixture run's sources: {"source", "weight", "share" (what the weights ask for),
    # "samples" and "realised" (what the steps that count read; None without the seed)}
    mixture: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}

    def lines(self) -> list[str]:
        """The audit as `optimus data audit` prints it: notes, problems, the verdict, and a
        mixture's shares as a table."""
        out = [f"note: {n}" for n in self.notes] + [f"problem: {p}" for p in self.problems]
        if self.steps:
            out.append(f"{'ok' if self.ok else 'NOT ok'}: steps {self.first_step}.."
                       f"{self.last_step} read samples [{self.start}, {self.end}) "
                       f"{'exactly once' if self.ok else 'with the problems above'}; "
                       f"{self.generations} generation(s), {self.repeated} step(s) trained "
                       "again after a restart")
        if self.mixture:
            rows = [("source", "weight", "share", "samples read", "realised share")]
            rows += [(m["source"], _form(m["weight"], "{:g}"), _form(m["share"], "{:.4f}"),
                      _form(m["samples"], "{:,}"), _form(m["realised"], "{:.4f}"))
                     for m in self.mixture]
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            out += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                              for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                    for r in rows]
        return out


def _form(value, form: str) -> str:
    return "-" if value is None else form.format(value)


def audit_run(run_dir: Path | str, seed: int | None = None) -> Audit:
    """Audit `<run_dir>/metrics.jsonl` (or a metrics file given directly). `seed`: the run's,
    for a mixture's realised shares; by default the run dir's configuration says."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{path} does not exist: give a run directory (the job's run_dir) "
                        "or its metrics.jsonl")
    if seed is None:
        from optimus.rundir import job_config  # reads JSON and YAML only

        seed = (job_config(path.parent) or {}).get("seed")
    with open(path) as f:
        return audit(_lines(f, path), seed)


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


def audit(lines: Iterable[dict], seed: int | None = None) -> Audit:
    """Audit metrics.jsonl lines, in file order; `seed`: the run's (a mixture's shares)."""
    result = Audit()
    mixtures: list[dict] = []  # each start of training's `mixture` event
    mixture_of: dict[int, int] = {}  # step -> the mixture it was trained under
    kept: dict[int, dict] = {}  # step -> fingerprint, of the generation that last trained it
    seen: dict[int, list[dict]] = {}  # every fingerprint of each step, superseded ones too
    no_data: list[int] = []  # steps that count but carry no fingerprint
    last = 0  # the newest step that counts
    records = 0
    resumed = False  # a resume event opened a generation that has no step record yet
    jumps: dict[int, tuple[int, int]] = {}  # step -> the samples a rewind skipped before it

    def roll_back(to: int) -> None:
        nonlocal last
        for step in [s for s in kept if s > to]:
            del kept[step]
        for step in [s for s in jumps if s > to]:
            del jumps[step]
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
        if event == "data_skip" and all(isinstance(line.get(k), int)
                                        for k in ("step", "start", "end")):
            jumps[line["step"]] = (line["start"], line["end"])
            continue
        if event == "mixture":
            if _is_mixture(line):
                mixtures.append(line)
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
        if mixtures:
            mixture_of[step] = len(mixtures) - 1

    _check(result, kept, seen, no_data, jumps)
    result.skipped = sorted(s for s, data in kept.items() if data.get("skipped") is True)
    if result.skipped:
        shown = ", ".join(f"step {s} [{kept[s]['start']}, {kept[s]['end']})"
                          for s in result.skipped[:10])
        more = f" and {len(result.skipped) - 10} more" if len(result.skipped) > 10 else ""
        result.notes.append(f"{len(result.skipped)} step(s) skipped their update (a loss spike: "
                            f"stability.on_spike): their samples were read, not trained on: "
                            f"{shown}{more}")
    _absent(result, kept)
    if mixtures:
        _shares(result, mixtures, {s: mixture_of.get(s) for s in kept}, kept, seed)
    return result


def _absent(result: Audit, kept: dict[int, dict]) -> None:
    """The samples of replicas out of the quorum at the steps that count: replica r's slices
    of a step are microbatch m's [m x B/M + r x k x u, m x B/M + (r + 1) x k x u) past its
    start, for a batch B of M microbatches over dp ranks, k = dp / replicas ranks a replica,
    u = B / (M x dp) samples a rank's microbatch (optimus/data/loader.py's order)."""
    for step in sorted(kept):
        data = kept[step]
        members, of, reader = data.get("replicas"), data.get("of"), data.get("reader")
        if not (isinstance(members, list) and type(of) is int and of >= 1
                and type(data.get("start")) is int and type(data.get("end")) is int
                and isinstance(reader, list) and len(reader) >= 2
                and all(type(x) is int and x >= 1 for x in reader[:2])):
            continue
        missing = sorted(set(range(of)) - {m for m in members if type(m) is int})
        if not missing:
            continue
        dp, micro_steps = reader[0], reader[1]
        size = data["end"] - data["start"]
        per_rank = size // (micro_steps * dp)
        k = dp // of
        if per_rank < 1 or k < 1:  # not a layout a loader reads
            continue
        result.absent.append([step, missing])
        result.untrained += [(data["start"] + m * size // micro_steps + r * k * per_rank,
                              data["start"] + m * size // micro_steps + (r + 1) * k * per_rank)
                             for r in missing for m in range(micro_steps)]
    if result.absent:
        stretches: list[list[int]] = []
        for step, _ in result.absent:
            if stretches and stretches[-1][1] == step - 1:
                stretches[-1][1] = step
            else:
                stretches.append([step, step])
        shown = ", ".join(f"{a}..{b}" if a != b else str(a) for a, b in stretches[:10])
        out = sorted({r for _, missing in result.absent for r in missing})
        samples = sum(b - a for a, b in result.untrained)
        result.notes.append(f"{len(result.absent)} step(s) trained while replica(s) {out} were "
                            f"out of the quorum (steps {shown}): their slices, {samples:,} "
                            "samples, were read by no rank and are skipped")


def _check(result: Audit, kept: dict[int, dict], seen: dict[int, list[dict]],
           no_data: list[int], jumps: dict[int, tuple[int, int]]) -> None:
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
        if start > end and jumps.get(b) == (end, start):
            result.unread.append((end, start))
            result.notes.append(f"samples [{end}, {start}) were skipped unread before step {b} "
                                "by a rewind (its data_skip event)")
        elif start > end:
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
            same = all(earlier.get(k) == final.get(k)
                       for k in ("start", "end", "reader", "slice"))
            if same and earlier.get("ids") != final.get("ids"):
                result.problems.append(
                    f"step {step} read other samples after a restart than before, over the same "
                    f"indices [{final['start']}, {final['end']}): the data order changed under "
                    "the run (seed, data or sequence length)")
                break


def _shares(result: Audit, mixtures: list[dict], under: dict[int, int | None],
            kept: dict[int, dict], seed: int | None) -> None:
    """Each source's share of the samples: asked for by the newest mixture's weights, and
    realised by the steps that count, each under the mixture it was trained with."""
    rows: dict[str, dict] = {}
    for m in mixtures:  # every source any start of training named; the newest weights win
        for src in m["sources"]:
            rows[src["path"]] = {"source": src["path"], "weight": src.get("weight"),
                                 "share": src.get("share"), "samples": None, "realised": None}
    result.mixture = list(rows.values())
    if len({json.dumps([[s["path"], s["quota"]] for s in m["sources"]])
            for m in mixtures}) > 1:
        result.notes.append("the mixture changed during the run (a resume with other sources "
                            "or weights): the shares asked for are the newest mixture's; the "
                            "realised ones count each step under the mixture it was trained with")
    if None in under.values():
        result.notes.append("steps trained before the first mixture event in metrics.jsonl "
                            "are not in the realised shares")
    if seed is None:
        result.notes.append("the realised share of each source needs the run's seed, which "
                            "no checkpoint manifest or job file of the run dir says: pass the "
                            "run dir where its checkpoints are")
        return
    counts = dict.fromkeys(rows, 0)
    for i, m in enumerate(mixtures):
        spans = [(kept[s]["start"], kept[s]["end"]) for s, j in under.items() if j == i]
        if not spans:
            continue
        quotas = [src["quota"] for src in m["sources"]]
        per_source = _source_counts(spans, quotas, int(m.get("block") or sum(quotas)), seed)
        for src, n in zip(m["sources"], per_source, strict=True):
            counts[src["path"]] += n
    total = sum(counts.values())
    for row in result.mixture:
        row["samples"] = counts[row["source"]]
        row["realised"] = counts[row["source"]] / total if total else None


def _is_mixture(event: dict) -> bool:
    """A `mixture` event that says each source's path and quota per block."""
    sources = event.get("sources")
    return (isinstance(sources, list) and bool(sources) and all(
        isinstance(s, dict) and isinstance(s.get("path"), str)
        and isinstance(s.get("quota"), int) and s["quota"] > 0 for s in sources)
        and isinstance(event.get("block", 0), int))


def _source_counts(spans: list[tuple[int, int]], quotas: list[int], block: int,
                   seed: int) -> list[int]:
    """How many samples each source gave to the global indices in `spans` ([start, end)).
    A whole block holds every source's quota exactly (its slots are a permutation of them);
    in a block's piece the slots are counted one by one, or those outside it when fewer."""
    count = _block_counter(quotas, block, seed)
    total = [0] * len(quotas)
    for start, end in _merged(spans):
        g = start
        while g < end:
            b, first = divmod(g, block)
            last = min(end - b * block, block)
            if 2 * (last - first) <= block:
                found = count(b, range(first, last))
            else:
                outside = count(b, [*range(first), *range(last, block)])
                found = [q - n for q, n in zip(quotas, outside, strict=True)]
            total = [t + n for t, n in zip(total, found, strict=True)]
            g = b * block + last
    return total


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans that follow each other joined (an overlap stays apart: read twice, counted
    twice)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _block_counter(quotas: list[int], block: int,
                   seed: int) -> Callable[[int, Iterable[int]], list[int]]:
    """Per source, how many of the positions in block b it owns: `MixtureDataset.locate`'s rule
    (the block's keyed permutation onto the quota ranges, `block_permutation`), without the
    data folders a MixtureDataset needs; tests/test_data_audit.py checks the two agree."""
    starts = [sum(quotas[:s]) for s in range(len(quotas) + 1)]

    def count(b: int, positions: Iterable[int]) -> list[int]:
        perm = block_permutation(seed, b, block)
        found = [0] * len(quotas)
        for p in positions:
            found[bisect.bisect_right(starts, perm(p)) - 1] += 1
        return found

    return count
