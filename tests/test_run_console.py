"""The console of `optimus run` (controller/cli/console.py): one line per thing that happened, in
order. A real run with validation and checkpoints, checked line by line against the metrics rank
0 wrote; a restart's rollback, replayed through a real Redis; and the incremental reader of the
metrics file, on a partial last line and on a file truncated or replaced under it."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml
from cluster import ROOT, metrics, write_job
from records import run_plan
from rich.console import Console

from controller.cli import console as console_module
from controller.cli.console import Follow, MetricsTail
from controller.store.store import Store
from optimus.checkpoint.manifest import committed_steps
from optimus.config import load_job

STEPS = 40
PROGRESS = re.compile(r"  generation (\d+), step (\d+)/(\d+)(?:, loss (\S+) at step (\d+))?, "
                      r"restarts \d+$")


def test_run_says_load_validations_commits_and_completion_once_in_order(redis_server,
                                                                         tmp_path):
    run = tmp_path / "run"
    job = write_job(tmp_path / "job.yaml", run, steps=STEPS, async_mode="sync", log_every=5)
    raw = yaml.safe_load(job.read_text())
    raw["eval"] = {"every": 10, "batches": 1}
    job.write_text(yaml.safe_dump(raw))
    out = subprocess.run([sys.executable, "-m", "controller", "run", str(job), "--nodes", "1",
                          "--ranks-per-node", "1"], cwd=ROOT,
                         env={**os.environ, "REDIS_URL": redis_server.url},
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    rows = metrics(run)

    # Validations and commits, in the order rank 0 wrote them: a step's row is written before
    # its save starts (a step's record first), so a synchronous save's commit is in the next
    # logged row, after that step's validation; the final step's commit (after the last row)
    # is the closing summary's.
    said = [line for line in lines if line.startswith(("  validation", "  checkpoint"))]
    val = {r["step"]: r["val_loss"] for r in rows if r.get("event") == "eval"}
    wrote: dict[int, float] = {}  # commit step -> its write time, from the first row saying it
    for r in rows:
        if "loss" in r and r["checkpoint"]["last_commit_step"] is not None:
            wrote.setdefault(r["checkpoint"]["last_commit_step"], r["checkpoint"]["last_write_s"])
    assert sorted(val) == [10, 20, 30, 40] and sorted(wrote) == [10, 20, 30]
    expected = []
    for step in (10, 20, 30, 40):
        expected.append(f"  validation loss {val[step]:.4f} at step {step}")
        if step in wrote:
            expected.append(f"  checkpoint step {step} committed (written in "
                            f"{wrote[step]:.1f} s)")
    assert said == expected
    assert committed_steps(run / "checkpoints") == [10, 20, 30, 40]
    assert f"latest committed checkpoint: step {STEPS} in {run / 'checkpoints'}" in lines

    # The load is said before anything generation 0 did; completion once, after all of it.
    loaded = lines.index(next(s for s in lines if s.endswith(
        "[controller] loaded: generation 0 resumed from scratch")))
    progress = [i for i, s in enumerate(lines) if PROGRESS.match(s)]
    assert loaded < min(progress + [lines.index(s) for s in said])
    done = f"all 1 ranks of generation 0 finished at step {STEPS}"
    assert [s for s in lines if done in s] == [f"job COMPLETED: {done}"]
    assert lines.index(f"job COMPLETED: {done}") > max(progress + [lines.index(said[-1])])

    # Each progress line agrees with itself and with the metrics: its loss is the logged loss
    # of a step it has reached.
    loss = {r["step"]: r["loss"] for r in rows if "loss" in r}
    for i in progress:
        gen, step, total, shown_loss, loss_step = PROGRESS.match(lines[i]).groups()
        assert (gen, total) == ("0", str(STEPS)) and int(step) <= STEPS
        if shown_loss is not None:
            assert int(loss_step) <= int(step) and shown_loss == f"{loss[int(loss_step)]:.4f}"


def test_a_restart_is_said_in_order_with_its_rollback(redis_server, tmp_path, monkeypatch):
    """Generation 1 resumes from step 10 after generation 0 logged step 25 (step 20 set aside):
    what its rank 0 logs before the controller says what it loaded waits for that line; the
    progress line then reports generation 1's loss, not generation 0's later one; and its
    commit of step 20, again, is said again."""
    monkeypatch.setattr(console_module, "PROGRESS_S", 0.0)  # a progress line every poll
    job = load_job(write_job(tmp_path / "job.yaml", tmp_path / "run", steps=STEPS))
    store = Store(redis_server.url, job.name)
    out = io.StringIO()
    follow = Follow(Console(file=out, highlight=False, markup=False, soft_wrap=True), store,
                    job)
    path = Path(job.resolved_run_dir) / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    store.update_job({"state": "RUNNING", "restarts": 0})

    def generation(gen: int) -> None:
        store.set_plan(run_plan(gen, ["node0"], issued=time.time()))

    def log(step: int, loss: float, commit: int | None = None) -> None:
        row = {"time": time.time(), "step": step, "loss": loss,
               "checkpoint": {"last_commit_step": commit, "last_write_s": 0.25}}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def said() -> list[str]:
        lines = out.getvalue().splitlines()
        out.truncate(0)
        out.seek(0)
        return [re.sub(r"^\d\d:\d\d:\d\d ", "", line) for line in lines]

    generation(0)
    log(1, 5.5)  # before the controller says what generation 0 loaded: held back
    follow.poll()
    assert said() == []
    store.event("controller", "loaded", "generation 0 resumed from scratch", generation=0,
                step="")
    log(21, 1.8, commit=20)
    log(25, 1.7, commit=20)
    follow.poll()
    assert said() == ["[controller] loaded: generation 0 resumed from scratch",
                      "  checkpoint step 20 committed (written in 0.2 s)",
                      "  generation 0, step 25/40, loss 1.7000 at step 25, restarts 0"]

    store.update_job({"restarts": 1})
    generation(1)
    log(11, 2.5)
    follow.poll()
    assert said() == []  # generation 1 has not been said to load yet: no progress either
    store.event("controller", "loaded", "generation 1 resumed from the checkpoint of step 10",
                generation=1, step=10)
    log(21, 1.9, commit=20)
    follow.poll()
    assert said() == ["[controller] loaded: generation 1 resumed from the checkpoint of step 10",
                      "  checkpoint step 20 committed (written in 0.2 s)",
                      "  generation 1, step 21/40, loss 1.9000 at step 21, restarts 1"]

    # A failed save is said as rank 0 wrote it; a snapshot note is not the console's.
    with open(path, "a") as f:
        for kind, message in (("checkpoint", "save of step 30 failed: disk full"),
                              ("snapshot", "every 2 steps")):
            f.write(json.dumps({"time": time.time(), "event": kind, "message": message}) + "\n")
    follow.poll()
    assert said() == ["  checkpoint: save of step 30 failed: disk full"]

    # The controller's end of the job is left to `optimus run`'s closing line.
    store.update_job({"state": "COMPLETED"})
    store.event("controller", "completed", "all 1 ranks of generation 1 finished at step 40")
    log(40, 1.2)
    follow.poll()
    assert said() == []


def rows_of(tail: MetricsTail) -> list[int]:
    return [row["step"] for row in tail.rows()]


def test_the_metrics_tail_keeps_a_partial_line_and_skips_what_is_not_a_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    tail = MetricsTail(path)  # from the end: an earlier run's rows are not this run's
    assert rows_of(tail) == []
    with open(path, "a") as f:
        f.write('{"step": 2}\nnot json\n[3]\n{"step": ')
    assert rows_of(tail) == [2]
    with open(path, "a") as f:
        f.write('4}\n')
    assert rows_of(tail) == [4]
    assert rows_of(MetricsTail(path, from_end=False)) == [1, 2, 4]
    assert rows_of(MetricsTail(tmp_path / "not-yet.jsonl")) == []


def test_the_metrics_tail_reads_a_truncated_or_replaced_file_from_its_start(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    tail = MetricsTail(path, from_end=False)
    assert rows_of(tail) == [1, 2, 3, 4, 5]
    path.write_text('{"step": 7}\n')  # truncated and rewritten in place, shorter
    assert rows_of(tail) == [7]
    new = tmp_path / "new.jsonl"  # replaced by another file, longer than the offset
    new.write_text("".join(json.dumps({"step": s, "pad": "x" * 40}) + "\n" for s in (8, 9)))
    os.replace(new, path)
    assert rows_of(tail) == [8, 9]


def test_the_metrics_tail_reads_a_bounded_amount_a_call(tmp_path, monkeypatch):
    monkeypatch.setattr(console_module, "MAX_READ", 64)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 41)))
    tail = MetricsTail(path, from_end=False)
    first = rows_of(tail)
    assert 0 < len(first) < 10  # ~13 bytes a row
    got = first
    for _ in range(100):
        if not (more := rows_of(tail)):
            break
        got += more
    assert got == list(range(1, 41))


def test_the_metrics_tail_drops_an_overlong_line(tmp_path, monkeypatch):
    monkeypatch.setattr(console_module, "MAX_LINE", 50)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "pad": "' + b"x" * 60)  # no end in sight
    tail = MetricsTail(path, from_end=False)
    assert rows_of(tail) == [] and tail.partial == b""
    with open(path, "ab") as f:
        f.write(b'\n{"step": 2}\n')
    assert rows_of(tail) == [2]
