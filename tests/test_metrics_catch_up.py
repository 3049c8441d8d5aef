"""A replica that takes the metrics over from a lost writer (optimus/parallel/replica_mode.py
`roles`) writes the rows the file lacks, from the figures it kept, once each."""

from __future__ import annotations

import json

from optimus.metrics import MetricsLog, StepMetrics, last_logged_step


def _row(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=1.0 / step, grad_norm=1.0, lr=1e-3, tokens=step * 10,
                       step_time_s=0.1, tokens_per_s=100.0, mfu=None,
                       data={"start": step, "n": 1})


def _steps(path) -> list[int]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if "event" not in r]


def test_the_new_writer_writes_exactly_the_steps_the_lost_one_had_not(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lost = MetricsLog(path, 10, 1, None, 1)
    for step in (1, 2, 3):
        lost.record(_row(step))
    lost.close()
    with open(path, "a") as f:
        f.write('{"time": 1, "step": 4, "lo')  # its last line, cut by the kill
    new = MetricsLog(path, 10, 1, None, 1)
    new.enabled = False  # a member that was not writing: it keeps its rows all the same
    for step in (1, 2, 3, 4, 5):
        new.record(_row(step))
    assert last_logged_step(path) == 3
    new.enabled = True
    assert new.catch_up() == [4, 5]
    new.record(_row(6))
    new.close()
    lines = path.read_text().splitlines()
    assert lines[3] == '{"time": 1, "step": 4, "lo'  # left alone, on a line of its own
    assert [s for s in _steps_from(lines[4:])] == [4, 5, 6]
    assert last_logged_step(path) == 6


def _steps_from(lines: list[str]) -> list[int]:
    return [json.loads(line)["step"] for line in lines]


def test_no_file_or_no_gap_writes_nothing(tmp_path):
    assert last_logged_step(tmp_path / "none.jsonl") == 0
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, 10, 1, None, 1)
    log.record(_row(1))
    assert log.catch_up() == []
    log.close()
    assert _steps(path) == [1]
