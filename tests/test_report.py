"""`optimus report`: the run report of the demo job under the real control plane (a fault with
its culprit excluded, a restart on the spare, an operator's pause), the events mirrored into
the run dir, the report of a plain run's metrics file with what a crash and restarts leave,
a real run on a mixture of two sources (the first steps logged, checkpoints and validations
on the timeline, each source's realised share), and a run with loss spikes, skipped steps, a
divergence and a rewind (marked on the loss figure and the timeline, counted in the facts).
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from cluster import ROOT, RedisServer, metrics, wait_for, write_job
from PIL import Image

from controller.control.event_log import EventLog
from controller.store.store import Store
from optimus.cli import main
from optimus.config import validate_job
from optimus.data import Mixture, TokenShards
from optimus.data.prepare import prepare
from optimus.metrics import logs_step
from optimus.report import build_report, read_run
from optimus.report.facts import facts
from optimus.report.figures import draw_all, first_save_note, loss_figure
from optimus.report.runlog import Run, Save
from optimus.report.timeline import lost_to_restarts, marks, progress_marks

STEPS, FAULT_STEP = 14, 7  # checkpoints every 5 steps: generation 1 resumes from step 5


def _images(page: Path) -> list[Path]:
    return [page.parent / src for src in re.findall(r"<img src='([^']+)'", page.read_text())]


def _assert_pngs(page: Path, expected: set[str]) -> None:
    images = _images(page)
    assert {p.name for p in images} == expected
    for path in images:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
        with Image.open(path) as image:
            width, height = image.size
        assert width >= 1000 and height >= 350, (path, image.size)
        assert path.stat().st_size > 10_000, path  # drawn, not blank


def test_the_demo_job_s_report_shows_its_fault_exclusion_restart_and_pause(tmp_path):
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, steps=STEPS, async_mode="sync",  # committed
                    faults=[{"kind": "kill_rank", "rank": 1, "step": FAULT_STEP}])  # before it
    raw = yaml.safe_load(job.read_text())
    raw["checkpoint"]["interval"] = 5
    job.write_text(yaml.safe_dump(raw))
    p = subprocess.Popen([sys.executable, "-m", "controller", "run", str(job), "--nodes", "2",
                          "--ranks-per-node", "1", "--spares", "1"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = p.stdout.readline()
        env = (run / "control" / "redis.env").read_text()  # the URL, shown masked in `first`
        store = Store(re.search(r"^export REDIS_URL=(\S+)$", env, re.M).group(1), "e2e")
        wait_for(lambda: store.job_record().get("generation") == "1"
                 and store.job_record().get("state") == "RUNNING", 120, "generation 1")
        host = socket.gethostname()
        # As `optimus job pause`; generation 1's ranks pause after their first step.
        store.request("pause", "tester", host, "look at the report")
        wait_for(lambda: store.job_record().get("state") == "PAUSED", 60, "PAUSED")
        store.request("resume", "tester", host)
        out = first + p.communicate(timeout=180)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out[-4000:]
    page = run / "report" / "index.html"
    assert f"report: {page}" in out  # the demo says where its report is

    first_gen = re.search(r"generation 0 on (node\d), (node\d) from scratch", out)
    culprit = first_gen.group(2)  # rank 1's node
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    ids = [e["id"] for e in events]
    assert len(set(ids)) == len(ids) and ids == sorted(ids, key=lambda i: tuple(
        map(int, i.split("-"))))  # each event once, in stream order
    kinds = [e["kind"] for e in events]
    for kind, count in (("generation", 2), ("failure", 1), ("paused", 1), ("resumed", 1),
                        ("completed", 1), ("pause", 1), ("resume", 1)):
        assert kinds.count(kind) == count, (kind, kinds)
    failure = events[kinds.index("failure")]
    assert failure["node"] == culprit and failure["rank"] == "1" and failure["excluded"] == "1"
    assert events[kinds.index("pause")]["actor"] == "tester"

    _assert_pngs(page, {"timeline.png", "loss.png", "optimizer.png", "checkpoints.png"})
    html = page.read_text()
    assert f"{culprit} excluded" in html and "rank 1 on " + culprit in html

    loaded = read_run(run)
    shown = marks(loaded)
    fault = [m for m in shown if m.kind == "fault"]
    assert [m.label for m in fault] == [f"fault: rank 1 on {culprit} (rank_exit)"]
    assert loaded.start < fault[0].time < loaded.end
    assert [m.label for m in shown if m.kind == "exclusion"] == [f"{culprit} excluded"]
    assert [m.label for m in shown if m.kind == "generation"] == ["gen 0", "gen 1"]
    (pause,) = [m for m in shown if m.kind == "pause"]
    assert fault[0].time < pause.time < pause.end < loaded.end
    # generation 0 committed step 5 and died at 7; generation 1 committed 10, and 14 at the end
    assert [m.step for m in progress_marks(loaded) if m.kind == "checkpoint"] == [5, 10, 14]

    # The loss curve: each step's value from the generation that trained it last.
    logged = [m for m in metrics(run) if "loss" in m]
    last = {m["step"]: m["loss"] for m in logged}
    assert len(logged) > STEPS  # steps after the checkpoint of step 5 were trained twice
    figure = loss_figure(loaded, tmp_path / "figures")
    assert figure.series["train loss"][1] == [last[s] for s in range(1, STEPS + 1)]
    table = dict(facts(loaded))
    assert table["steps"] == f"{STEPS} of {STEPS}"
    assert table["generations"] == "2"
    assert table["excluded nodes"].startswith(f"{culprit}: rank 1 on {culprit} ended with")
    assert table["faults"] == f"1: rank 1 on {culprit} (rank_exit)"
    assert table["state"].startswith("COMPLETED")
    assert table["pauses"].startswith("1, ")


def _step(step: int, t: float, loss: float, committed: int = 0, commit_step=None) -> dict:
    return {"time": t, "step": step, "loss": loss, "grad_norm": 1.0 / step, "lr": 1e-3,
            "tokens": 100 * step, "step_time_s": 0.5, "tokens_per_s": 200.0 + step,
            "mfu": 0.25, "checkpoint": {"saves_committed": committed, "last_write_s": 0.3,
                                        "last_blocked_s": 0.05, "last_commit_step": commit_step,
                                        "saves_failed": 0}}


def test_a_plain_run_s_metrics_file_with_restarts_and_a_crash(tmp_path):
    """Two restarts told only by rank 0's file (no control plane), validations, a failed save,
    a pause and a last line cut short by a crash."""
    lines = [
        _step(1, 100.0, 5.2), _step(2, 101.0, 4.2),
        # a start from scratch with no resume event (no checkpoint was committed)
        _step(1, 105.0, 5.1), _step(2, 106.0, 4.1, 1, 2),
        {"time": 106.5, "event": "eval", "message": "", "step": 2, "tokens": 200, "val_loss": 4.5,
         "perplexity": 90.0, "eval_tokens": 64},
        _step(3, 107.0, 3.5, 1, 2),
        {"time": 107.5, "event": "paused", "message": "paused after step 3", "step": 3},
        {"time": 109.5, "event": "resumed", "message": "resumed after step 3", "step": 3},
        _step(4, 110.0, 3.0, 1, 2),
        {"time": 110.5, "event": "eval", "message": "", "step": 4, "tokens": 400, "val_loss": 3.9,
         "perplexity": 49.4, "eval_tokens": 64},
        {"time": 110.8, "event": "checkpoint", "message": "checkpoint of step 4: disk full",
         "saves_committed": 1, "saves_failed": 1},
        # resumed from the checkpoint of step 2: steps 3 and 4 (and the eval at 4) again
        {"time": 115.0, "event": "resume", "message": "continuing", "step": 2},
        _step(3, 116.0, 3.4), _step(4, 117.0, 2.9),
        {"time": 117.5, "event": "eval", "message": "", "step": 4, "tokens": 400, "val_loss": 3.7,
         "perplexity": 40.4, "eval_tokens": 64},
        _step(5, 118.0, 2.5), {"time": 118.5, "step": 6, "data": {"start": 0}},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"time": 119.0, "step": 7, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)

    run = read_run(tmp_path)
    assert run.unreadable == 1
    assert [(s.step, s.loss) for s in run.steps] == [(1, 5.1), (2, 4.1), (3, 3.4), (4, 2.9),
                                                     (5, 2.5)]
    assert [(e.step, e.loss) for e in run.evals] == [(2, 4.5), (4, 3.7)]
    assert len(run.segments) == 3
    # 101 -> 106 (step 2 reached again), then 110 -> 117 (step 4 again)
    assert lost_to_restarts(run) == pytest.approx(5.0 + 7.0)
    assert [(m.kind, m.step, m.time) for m in progress_marks(run)] == [
        ("checkpoint", 2, 106.0), ("validation", 2, 106.5), ("validation", 4, 117.5)]
    found = {(m.kind, m.label) for m in marks(run)}
    assert found == {("generation", "restart 1"), ("generation", "restart 2"),
                     ("pause", "paused"), ("save_failed", "save failed (step 4)")}
    (pause,) = [m for m in marks(run) if m.kind == "pause"]
    assert (pause.time, pause.end) == (107.5, 109.5)
    assert [(s.step, s.time, s.write_s) for s in run.saves] == [(2, 106.0, 0.3)]

    figures = {f.file: f for f in draw_all(run, tmp_path / "figures")}
    assert figures["loss.png"].series["validation loss"] == ([200, 400], [4.5, 3.7])
    timeline = figures["timeline.png"]
    assert timeline.series["step"][1] == [1, 2, 1, 2, 3, 4, 3, 4, 5, 6]  # every step line
    assert "Each colour is one start of training" in timeline.caption  # three of them
    # tokens/s is 200 + step; its mean over up to 9 logged steps, within each start
    assert timeline.series["tokens/s, rolling mean"][1] == pytest.approx(
        [201.5, 201.5, 202.5, 202.5, 202.5, 202.5, 204.0, 204.0, 204.0])
    table = dict(facts(run))
    assert table["generations"] == "3" and table["steps"] == "5"  # no config: no total
    assert table["validation loss, final / best"] == "3.7000 / 3.7000 (perplexity 40.40)"
    assert table["train loss, final / best"] == "2.5000 / 2.5000"
    assert table["MFU, mean"] == "25.0%" and table["pauses"] == "1, 2.0 s in all"
    assert table["checkpoints committed"] == "1 (latest: step 2); 1 failed"
    assert table["time lost to restarts"] == "12.0 s"
    assert table["stability"] == "no loss spike, divergence, skipped step or rewind"
    assert "loss spikes" not in table and not figures["loss.png"].marks

    result = CliRunner().invoke(main, ["report", str(tmp_path), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    page = tmp_path / "r" / "index.html"
    assert result.output == f"report: {page}\n"
    _assert_pngs(page, {"timeline.png", "loss.png", "optimizer.png", "checkpoints.png"})
    assert "this run has no events.jsonl" in page.read_text()


@pytest.mark.parametrize("setup,message", [
    (lambda d: None, "is not a directory"),
    (lambda d: d.mkdir(), "has no metrics.jsonl"),
    (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"time": 1, "step": 1, "da')),
     "holds no logged step yet"),
])
def test_no_run_is_one_clear_error_line(tmp_path, setup, message):
    run_dir = tmp_path / "run"
    setup(run_dir)
    result = CliRunner().invoke(main, ["report", str(run_dir)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and message in result.output, result.output
    assert result.output.startswith(f"error: {run_dir}")


def test_the_event_mirror_carries_on_after_a_failover_without_duplicates(tmp_path):
    server = RedisServer(tmp_path / "redis")
    try:
        store = Store(server.url, "mirror")
        path = tmp_path / "run" / "events.jsonl"
        store.event("controller", "generation", "generation 0 on node0", generation=0)
        store.event("agent:node0", "launch", "ranks started", node="node0")
        leader = EventLog(store, path)
        assert leader.mirror() == 2 and leader.mirror() == 0  # nothing new: nothing written
        store.event("controller", "failure", "rank 1 died", node="node1", excluded=True)
        with open(path, "a") as f:
            f.write('{"id": "9-0", "ti')  # the old leader died mid-line
        standby = EventLog(store, path)  # a new leader reads where the file stops
        assert standby.mirror() == 1
        standby.forget()
        assert standby.mirror() == 0
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                assert line == '{"id": "9-0", "ti'
        assert [r["kind"] for r in rows] == ["generation", "launch", "failure"]
        assert rows[2]["node"] == "node1" and rows[2]["excluded"] == "1"
        assert rows[0]["actor"] == "controller" and rows[0]["generation"] == "0"
        assert abs(rows[0]["time"] - time.time()) < 60
    finally:
        server.stop()


def test_without_matplotlib_the_command_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_step(1, 100.0, 5.0)) + "\n")
    for name in [m for m in sys.modules if m.startswith(("optimus.report.", "matplotlib"))]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh, restored after the test
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output == ("error: optimus report: matplotlib is not installed — fix: pip "
                             "install 'optimus[report]'\n")


def test_the_first_steps_are_all_logged_then_every_nth_and_the_last():
    assert [s for s in range(1, 48) if logs_step(s, 10, 47)] == [
        *range(1, 11), 20, 30, 40, 47]
    assert [s for s in range(1, 6) if logs_step(s, 1, 5)] == [1, 2, 3, 4, 5]
    assert [s for s in range(1, 4) if logs_step(s, 10, 3)] == [1, 2, 3]


def test_a_slow_first_save_is_explained_from_the_data(tmp_path):
    run = Run(run_dir=tmp_path, config={"checkpoint": {"async_mode": "process"}},
              saves=[Save(50 * i, 0.0, w, 0.01) for i, w in enumerate([5.8, 0.9, 1.1, 0.8], 1)])
    assert first_save_note(run) == (
        "First save 5.8 s against a median of 0.9 s for the others: it includes starting DCP's "
        "writer process (a Python with torch, per rank), which the saves after it reuse.")
    run.config = {"checkpoint": {"async_mode": "thread"}}  # no writer process to start
    assert first_save_note(run) == "First save 5.8 s against a median of 0.9 s for the others."
    run.saves[0].write_s = 1.7  # under twice the others': nothing to explain
    assert first_save_note(run) == ""


SEQ, WEIGHTS, MIX_STEPS, BATCH = 8, [0.7, 0.3], 12, 8


def _mixture_run(rank: int, world_size: int, raw: dict) -> list[list[int]]:
    from optimus.train import train

    return train(validate_job(raw, world=world_size), keep_sample_ids=True).sample_ids


def test_a_mixture_run_s_report_shows_its_first_steps_marks_and_realised_shares(
        run_ranks, tmp_path):
    folders = []
    for name, n_tokens in (("web", 3001), ("code", 1201)):
        text = tmp_path / f"{name}.txt"
        text.write_text("".join(chr(97 + i % 26) for i in range(n_tokens - 1)))
        prepare([text], tmp_path / name)
        folders.append(tmp_path / name)
    run = tmp_path / "run"
    raw = {"name": "mix", "run_dir": str(run), "seed": 11,
           "model": {"vocab_size": 257, "dim": 32, "n_layers": 1, "n_heads": 2,
                     "max_seq_len": SEQ},
           "optim": {"steps": MIX_STEPS, "warmup_steps": 1},
           "data": {"source": "shards", "seq_len": SEQ, "batch_size": BATCH,
                    "sources": [{"path": str(f), "weight": w}
                                for f, w in zip(folders, WEIGHTS, strict=True)]},
           "eval": {"every": 6, "batches": 1, "path": str(folders[1])},
           "supervision": {"log_every": 5},
           "parallel": {"device": "cpu"},
           "checkpoint": {"interval": 4, "async_mode": "sync"}}
    (read,) = run_ranks(_mixture_run, 1, raw, timeout=180)

    rows = metrics(run)
    assert [m["step"] for m in rows if "loss" in m] == [1, 2, 3, 4, 5, 10, 12]
    page = build_report(run)
    loaded = read_run(run)
    figures = {f.file: f for f in draw_all(loaded, tmp_path / "figures")}
    timeline = figures["timeline.png"]
    assert "Each colour" not in timeline.caption  # one start of training: one colour
    ended = {m["step"]: m["time"] for m in rows if "step" in m and "event" not in m}
    evals = {m["step"]: m["time"] for m in rows if m.get("event") == "eval"}
    shown = [(m.kind, m.step, m.time) for m in timeline.marks if m.step is not None]
    assert sorted(shown, key=lambda m: (m[1], m[0])) == [
        ("checkpoint", 4, ended[4]), ("validation", 6, evals[6]), ("checkpoint", 8, ended[8]),
        ("checkpoint", 12, ended[12]), ("validation", 12, evals[12])]
    html = page.read_text()
    assert html.count("<h2>Timeline") == 1 and "<h2>Events</h2>" in html

    # The realised shares, counted independently: each id the loader gave, to its source.
    data = Mixture([TokenShards(f) for f in folders], WEIGHTS).windows(SEQ, 11)
    counts = [0, 0]
    for ids in read:
        for i in ids:
            counts[data.source_of(i)] += 1
    assert sum(counts) == MIX_STEPS * BATCH and 0 < counts[1] < counts[0]
    shares = [n / sum(counts) for n in counts]
    out = CliRunner().invoke(main, ["data", "audit", str(run), "-o", "json"])
    assert out.exit_code == 0, out.output
    audited = json.loads(out.output)["mixture"]
    assert [(m["source"], m["weight"], m["samples"]) for m in audited] == [
        (str(f), w, n) for f, w, n in zip(folders, WEIGHTS, counts, strict=True)]
    assert [m["realised"] for m in audited] == pytest.approx(shares)
    assert "<h2>Data mixture</h2>" in html
    for f, n, share in zip(folders, counts, shares, strict=True):
        assert (f"<tr><td>{f}</td><td>{WEIGHTS[folders.index(f)]:g}</td>"
                f"<td>{audited[folders.index(f)]['share']:.4f}</td><td>{n:,}</td>"
                f"<td>{share:.4f}</td></tr>") in html


def test_a_long_run_s_progress_line_is_thinned_keeping_each_start_s_last_step(
        tmp_path, monkeypatch):
    # the module read_run reads TRACE from (a test above imports the package's modules afresh)
    monkeypatch.setattr(sys.modules[read_run.__module__], "TRACE", 100)
    lines = [{"time": float(s), "step": s, "data": {}} for s in range(1, 601)]
    lines += [{"time": 1000.0 + s, "step": s, "data": {}} for s in range(500, 1001)]
    lines[0].update(_step(1, 1.0, 5.0))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    trace = read_run(tmp_path).trace
    assert len(trace) < 100
    assert trace[0] == (1.0, 1, 0) and trace[-1] == (2000.0, 1000, 1)
    assert (600.0, 600, 0) in trace  # where the first start stopped, before the restart
    for segment in (0, 1):
        steps = [s for _, s, k in trace if k == segment]
        assert steps == sorted(steps) and len(steps) > 20  # evenly spread over both
