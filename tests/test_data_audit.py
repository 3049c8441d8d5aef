"""`optimus data audit`: synthetic metrics histories (a clean run, legitimate repeats after
restarts, gaps, overlaps, a changed data order), the CLI on a file, and a mixture's realised
shares against the mixture's own order. (A real mixture run's shares: tests/test_report.py.)"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from click.testing import CliRunner

from optimus.cli import main
from optimus.data import Mixture, TokenShards
from optimus.data.audit import _source_counts, audit
from optimus.data.mixture import BLOCK, quotas
from optimus.data.prepare import prepare
from optimus.metrics import sample_fingerprint

B = 8  # samples per step


def step(s: int, start: int | None = None, ids: str | None = None, reader=(1, 1),
         logged: bool = True) -> dict:
    """A step's line: its fingerprint over [start, start + B) (by default where an unbroken
    run puts step s), with the loss when logged."""
    start = (s - 1) * B if start is None else start
    data = {"start": start, "end": start + B, "ids": ids or f"ids-{start}", "reader": list(reader)}
    return {"step": s, "data": data, **({"loss": 1.0} if logged else {})}


def resume(s: int, data_index: int | None = None) -> dict:
    return {"event": "resume", "step": s, "data_index": s * B if data_index is None
            else data_index, "message": f"continuing from step {s}"}


def test_an_unbroken_run_reads_every_sample_once():
    lines = [step(s, logged=s % 3 == 0) for s in range(1, 11)]  # log_every 3: data-only lines
    result = audit([{"event": "checkpoint", "message": "x"}, *lines])
    assert result.ok, result.problems
    assert (result.steps, result.first_step, result.last_step) == (10, 1, 10)
    assert (result.start, result.end, result.generations, result.repeated) == (0, 80, 1, 0)


def test_steps_repeated_after_a_restart_are_superseded_not_counted_twice():
    # Generation 0 trains 1..7 (checkpoint at 5), dies; generation 1 resumes from 5 and trains
    # 6..10: steps 6 and 7 were trained twice, over the same samples; 6..10 count once.
    lines = [step(s) for s in range(1, 8)] + [resume(5)] + [step(s) for s in range(6, 11)]
    # Generation 2 starts from scratch (every checkpoint lost) and goes to 12.
    lines += [step(s) for s in range(1, 13)]
    result = audit(lines)
    assert result.ok, result.problems
    assert (result.steps, result.end, result.generations) == (12, 96, 3)
    assert result.repeated == 10  # steps 1..10 were trained more than once


def test_a_gap_and_an_overlap_are_named_with_their_samples():
    lines = [step(1), step(2), step(3, start=20), step(4, start=28), step(5, start=30)]
    result = audit(lines)
    assert not result.ok
    assert result.problems == [
        "gap: samples [16, 20) were skipped between step 2 and step 3",
        "overlap: samples [30, 36) were read twice, by step 4 and by step 5"]


def test_a_resume_whose_checkpoint_holds_another_index_is_named():
    lines = [step(s) for s in range(1, 6)] + [resume(4, data_index=40)]
    lines += [step(5, start=40), step(6, start=48)]
    result = audit(lines)
    assert result.problems[0] == ("the checkpoint of step 4 holds data index 40, but step 4 "
                                  "ended at index 32: the resume skips samples")
    assert "gap: samples [32, 40) were skipped between step 4 and step 5" in result.problems


def test_a_repeated_step_that_read_other_samples_means_the_data_order_changed():
    lines = [step(s) for s in range(1, 5)] + [resume(2), step(3, ids="other"), step(4)]
    result = audit(lines)
    assert result.problems == [
        "step 3 read other samples after a restart than before, over the same indices "
        "[16, 24): the data order changed under the run (seed, data or sequence length)"]
    # Another slice (a new dp degree) hashes other ids for the same samples: no complaint.
    lines = [step(s) for s in range(1, 5)] + [resume(2), step(3, ids="x", reader=(2, 1)),
                                              step(4)]
    assert audit(lines).ok


def test_missing_records_and_a_resume_past_the_history_are_problems():
    lines = [step(1), step(2), step(5, start=32)]
    assert audit(lines).problems == ["steps 3..4 have no record: cannot tell what they read"]
    lines = [step(1), step(2), resume(4), step(5)]
    assert audit(lines).problems[0] == (
        "a generation resumed from the checkpoint of step 4, but the history holds steps only "
        "up to 2: steps 3..4 have no record")
    old = [{"step": 1, "loss": 1.0}, step(2)]  # written before fingerprints existed
    assert "1 step(s) that count have no sample fingerprint" in audit(old).problems[0]


def test_a_history_that_starts_from_a_copied_checkpoint_is_audited_from_there():
    lines = [resume(4), *[step(s) for s in range(5, 9)]]
    result = audit(lines)
    assert result.ok and result.first_step == 5 and result.start == 32
    assert result.notes == ["the history starts at step 5 (sample index 32): the steps before "
                            "are not in this file"]


def test_the_fingerprint_covers_the_global_range_and_hashes_the_ids_read():
    a = sample_fingerprint(16, 8, [[3, 1], [4, 1]], (2, 2))
    assert (a["start"], a["end"], a["reader"]) == (16, 24, [2, 2]) and len(a["ids"]) == 16
    assert sample_fingerprint(16, 8, [[3, 1, 4, 1]], (2, 2))["ids"] == a["ids"]
    assert sample_fingerprint(16, 8, [[3, 1], [4, 2]], (2, 2))["ids"] != a["ids"]


def test_the_cli_exits_2_on_a_problem_and_prints_json(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    good = [step(s) for s in range(1, 4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in good)
                                       + '{"step": 4, "da')  # a line cut short by a crash
    out = CliRunner().invoke(main, ["data", "audit", str(run)])
    assert out.exit_code == 0, out.output
    assert "ok: steps 1..3 read samples [0, 24) exactly once; 1 generation(s)" in out.output
    assert "note: line 4 of metrics.jsonl is not JSON" in out.output
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in [
        *good, step(4, start=40)]))
    out = CliRunner().invoke(main, ["data", "audit", str(run), "-o", "json"])
    assert out.exit_code == 2
    report = json.loads(out.output)
    assert report["ok"] is False and report["problems"] == [
        "gap: samples [24, 40) were skipped between step 3 and step 4"]
    missing = CliRunner().invoke(main, ["data", "audit", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "does not exist" in missing.output


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[TokenShards]:
    tmp = tmp_path_factory.mktemp("sources")
    for name, n_tokens in (("web", 2001), ("code", 801)):
        (tmp / f"{name}.txt").write_text("".join(chr(97 + i % 26) for i in range(n_tokens)))
        prepare([tmp / f"{name}.txt"], tmp / name)
    return [TokenShards(tmp / "web"), TokenShards(tmp / "code")]


def test_source_counts_follow_the_mixture_s_order_across_blocks(sources):
    data = Mixture(sources, [0.7, 0.3]).windows(8, seed=3)
    # a piece of block 0, most of block 1 (counted by its complement), a sliver of block 3
    spans = [(BLOCK - 50, 2 * BLOCK - 9000), (3 * BLOCK + 5, 3 * BLOCK + 9)]
    found = Counter(data.locate(g)[0] for a, b in spans for g in range(a, b))
    assert _source_counts(spans, quotas([0.7, 0.3]), BLOCK, 3) == [found[0], found[1]]
    whole = _source_counts([(2 * BLOCK, 3 * BLOCK), (3 * BLOCK, 4 * BLOCK)], [7, 9], 16, 3)
    assert whole == [7 * 2 * BLOCK // 16, 9 * 2 * BLOCK // 16]  # whole blocks: their quotas


def _mixture_event(sources, weights) -> dict:
    q = quotas(weights)
    return {"event": "mixture", "message": "m", "block": BLOCK, "sources": [
        {"path": str(s.path), "weight": w, "share": n / BLOCK, "quota": n}
        for s, w, n in zip(sources, weights, q, strict=True)]}


def test_a_mixture_s_shares_count_each_step_under_its_own_mixture(sources):
    # 0.7/0.3 for steps 1..6; a resume from step 4 under 0.5/0.5 trains 5..8 again
    lines = [_mixture_event(sources, [0.7, 0.3]), *[step(s) for s in range(1, 7)],
             resume(4), _mixture_event(sources, [0.5, 0.5]), *[step(s) for s in range(5, 9)]]
    first = Mixture(sources, [0.7, 0.3]).windows(8, seed=3)
    then = Mixture(sources, [0.5, 0.5]).windows(8, seed=3)
    read = Counter([first.locate(g)[0] for g in range(4 * B)]
                   + [then.locate(g)[0] for g in range(4 * B, 8 * B)])
    result = audit(lines, seed=3)
    assert result.ok, result.problems
    assert [(m["weight"], m["share"], m["samples"], m["realised"]) for m in result.mixture] == [
        (0.5, 0.5, read[0], read[0] / 64), (0.5, 0.5, read[1], read[1] / 64)]
    assert result.notes[0].startswith("the mixture changed during the run")

    unseeded = audit(lines)  # the run dir said no seed
    assert [m["samples"] for m in unseeded.mixture] == [None, None]
    assert "needs the run's seed" in unseeded.notes[-1]


def test_the_audit_prints_a_mixture_s_shares_as_a_table(sources):
    lines = [_mixture_event(sources, [0.7, 0.3]), *[step(s) for s in range(1, 4)]]
    result = audit(lines, seed=3)
    n = [m["samples"] for m in result.mixture]
    web, code = (str(s.path) for s in sources)
    width = max(len(web), len(code))
    assert result.lines() == [
        "ok: steps 1..3 read samples [0, 24) exactly once; 1 generation(s), 0 step(s) trained "
        "again after a restart",
        f"{'source':<{width}}  weight   share  samples read  realised share",
        f"{web:<{width}}     0.7  0.7000  {n[0]:>12}  {n[0] / 24:>14.4f}",
        f"{code:<{width}}     0.3  0.3000  {n[1]:>12}  {n[1] / 24:>14.4f}"]
    assert sum(n) == 24
    assert audit([step(1)]).mixture == []  # one source: no table


def replicated(s: int, members: list[int], of: int = 4, reader=(4, 2), slice_=0) -> dict:
    """A step of replicas that carry on (by default 4 replicas of 1 rank, 2 microbatches)."""
    line = step(s, reader=reader)
    line["data"].update({"replicas": members, "of": of, "slice": slice_})
    return line


def test_the_slices_of_replicas_out_of_the_quorum_are_accounted_as_skipped():
    # B = 8 over dp 4 and 2 microbatches: a sample a rank a microbatch; microbatch m of step s
    # is [8(s-1) + 4m, 8(s-1) + 4m + 4), and replica r reads its sample r.
    lines = [replicated(1, [0, 1, 2, 3]), replicated(2, [0, 1, 3]), replicated(3, [0, 3]),
             replicated(4, [0, 1, 2, 3])]
    result = audit(lines)
    assert result.ok, result.problems
    assert result.absent == [[2, [2]], [3, [1, 2]]]
    assert result.untrained == [(10, 11), (14, 15), (17, 18), (21, 22), (18, 19), (22, 23)]
    assert ("2 step(s) trained while replica(s) [1, 2] were out of the quorum (steps 2..3): "
            "their slices, 6 samples") in " ".join(result.notes)
    # A fingerprint whose replica fields are not what a rank writes is not read as absences.
    odd = replicated(1, [0], of="4")
    assert audit([odd]).absent == [] and audit([odd]).ok


def test_a_replica_out_of_the_quorum_skips_exactly_its_slices():
    # B = 8, dp 4 (2 replicas x 2 ranks), 1 microbatch: replica 1 holds [4, 8) of each step.
    lines = [replicated(s, [0] if s in (3, 4) else [0, 1], of=2, reader=(4, 1))
             for s in range(1, 7)]
    result = audit(lines)
    assert result.ok, result.problems
    assert result.absent == [[3, [1]], [4, [1]]]
    assert result.untrained == [(20, 24), (28, 32)]
    assert "8 samples, were read by no rank and are skipped" in " ".join(result.notes)
    # Two microbatches: replica 1's slice of each, [2, 4) and [6, 8) past the step's start.
    two = audit([replicated(1, [0], of=2, reader=(4, 2))])
    assert two.untrained == [(2, 4), (6, 8)]


def test_a_repeated_step_read_by_another_writer_is_not_a_changed_data_order():
    first = replicated(2, [0, 1], of=2, reader=(4, 1), slice_=0)
    again = replicated(2, [1], of=2, reader=(4, 1), slice_=2)
    again["data"]["ids"] = "other"  # replica 1's writer read its own slice
    result = audit([replicated(1, [0, 1], of=2, reader=(4, 1)), first, resume(1), again])
    assert result.ok, result.problems
    assert result.absent == [[2, [0]]]
