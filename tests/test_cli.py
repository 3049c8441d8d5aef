"""The `optimus` command end to end: prepare data, train on it, refuse bad input in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from click.testing import CliRunner

from optimus.cli import main
from optimus.data import ByteTokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog. " * 20,
         "pack my box with five dozen liquor jugs. " * 20]


def _corpus(tmp_path: Path) -> list[Path]:
    txt = tmp_path / "a.txt"
    txt.write_text(TEXTS[0])
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": TEXTS[1]}) + "\n")
    return [txt, jsonl]


def test_prepare_then_train_on_the_shards(tmp_path):
    runner = CliRunner()
    out = tmp_path / "shards"
    prepared = runner.invoke(main, ["data", "prepare", *map(str, _corpus(tmp_path)),
                                    "--out", str(out)])
    assert prepared.exit_code == 0, prepared.output
    tok = ByteTokenizer()
    expected = tok.encode(TEXTS[0]) + [tok.eos_id] + tok.encode(TEXTS[1]) + [tok.eos_id]
    assert (f"wrote {len(expected):,} tokens of 2 documents in 2 shard(s) (uint16)"
            in prepared.output)  # one shard per input file
    tokens = np.concatenate([np.fromfile(p, dtype=np.uint16)
                             for p in sorted(out.glob("shard_*.bin"))])
    assert tokens.tolist() == expected

    job = {"name": "on-shards", "run_dir": str(tmp_path / "run"),
           "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32},
           "optim": {"steps": 3, "warmup_steps": 1},
           "data": {"source": "shards", "path": str(out), "seq_len": 32, "batch_size": 4},
           "parallel": {"device": "cpu"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    trained = runner.invoke(main, ["train", str(path)])
    assert trained.exit_code == 0, trained.output
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(s)["step"] for s in lines] == [1, 2, 3]


def test_bad_input_is_one_line_and_exit_status_2(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(main, ["data", "prepare", str(tmp_path / "nope.txt"),
                                   "--out", str(tmp_path / "o")])
    assert missing.exit_code == 2
    assert "nope.txt" in missing.output and "Traceback" not in missing.output
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "x", "data": {"source": "shards",
                                                         "path": str(tmp_path / "none")}}))
    no_data = runner.invoke(main, ["train", str(job), "--set", "parallel.device=cpu"])
    assert no_data.exit_code == 2
    assert no_data.output.startswith("error: ") and len(no_data.output.splitlines()) == 1
    assert str(tmp_path / "none") in no_data.output


def _committed(root: Path, step: int) -> Path:
    """A committed checkpoint of one small file, as list/inspect/verify read it, signed by the
    key beside its directory, as a run's own."""
    from optimus.checkpoint import commit, step_dir
    from optimus.checkpoint.trust import key_file_for, read_key

    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(step)))
    commit(path, {"step": step, "tokens": step * 100, "layout": {"dp": 1, "tp": 1, "pp": 1}},
           key=read_key(key_file_for(root), create=True))
    return path


def test_every_checkpoint_command_finds_its_directory_one_way(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    none = runner.invoke(main, ["checkpoint", "list"])
    assert none.exit_code == 2 and len(none.output.splitlines()) == 1
    assert "./runs holds no run with checkpoints: give --dir CHECKPOINT_DIR or --job" \
        in none.output
    _committed(tmp_path / "runs" / "a" / "checkpoints", 3)
    _committed(tmp_path / "runs" / "a" / "checkpoints", 5)
    for args in (["list"], ["inspect"], ["verify"], ["inspect", "3"], ["inspect", "latest"]):
        found = runner.invoke(main, ["checkpoint", *args])
        assert found.exit_code == 0, found.output
        assert "checkpoints: runs/a/checkpoints (the only run under ./runs" in found.stderr
    assert "step:        3" in runner.invoke(main, ["checkpoint", "inspect", "3"]).stdout
    assert "step:        5" in runner.invoke(main, ["checkpoint", "inspect"]).stdout
    verified = runner.invoke(main, ["checkpoint", "verify"]).stdout
    assert "ok: step_000000003" in verified and "ok: step_000000005" in verified
    assert "ok: step_000000005" not in runner.invoke(main, ["checkpoint", "verify", "3"]).stdout

    # --job: the job's checkpoint.dir, relative to the current directory as in training.
    job = tmp_path / "b.yaml"
    job.write_text(yaml.safe_dump({"name": "b", "checkpoint": {"dir": "ck/{name}"}}))
    _committed(tmp_path / "ck" / "b", 7)
    by_job = runner.invoke(main, ["checkpoint", "list", "--job", str(job), "-o", "json"])
    assert by_job.exit_code == 0, by_job.output
    assert [r["step"] for r in json.loads(by_job.stdout)] == [7]  # stdout: JSON alone
    # --dir, and the older positional form, which scripts use.
    for args in (["--dir", "ck/b"], ["ck/b"]):
        listed = runner.invoke(main, ["checkpoint", "list", *args, "-o", "json"])
        assert [r["step"] for r in json.loads(listed.stdout)] == [7], listed.output
    inspected = runner.invoke(main, ["checkpoint", "inspect", "ck/b/step_000000007"])
    assert "step:        7" in inspected.stdout
    missing = runner.invoke(main, ["checkpoint", "inspect", "4", "--dir", "ck/b"])
    assert missing.exit_code == 2 and "has no checkpoint of step 4 (committed: 7)" \
        in missing.output
    both = runner.invoke(main, ["checkpoint", "list", "--dir", "ck/b", "--job", str(job)])
    assert both.exit_code == 2 and "give --dir or --job, not both" in both.output

    # Two runs: which one is not guessed; the choices are listed.
    _committed(tmp_path / "runs" / "c" / "checkpoints", 9)
    two = runner.invoke(main, ["eval", "--batches", "1"])
    assert two.exit_code == 2 and len(two.output.splitlines()) == 1
    assert ("./runs holds 2 runs with checkpoints (runs/a/checkpoints, runs/c/checkpoints)"
            in two.output)


def test_config_check_defaults_the_world_to_the_fewest_ranks_of_the_layout():
    runner = CliRunner()
    tiny = str(Path(__file__).resolve().parents[1] / "jobs" / "tiny-gpt.yaml")
    for sets, ranks, layout in (
            ([], "1 rank", "dp=1 tp=1 pp=1 ep=1"),
            (["parallel.tp=2", "parallel.pp=2"], "4 ranks", "dp=1 tp=2 pp=2 ep=1"),
            (["model.moe.experts=8", "parallel.ep=2", "parallel.tp=2"], "4 ranks",
             "dp=2 tp=2 pp=1 ep=2"),  # dp: -1 holds at least ep's ranks
            (["parallel.dp=4", "parallel.tp=2"], "8 ranks", "dp=4 tp=2 pp=1")):
        result = runner.invoke(main, ["config", "check", tiny,
                                      *(x for s in sets for x in ("--set", s))])
        assert result.exit_code == 0, result.output
        assert (f"on {ranks} (the fewest its layout runs on; --world N checks another): "
                f"{layout}") in result.output
    given = runner.invoke(main, ["config", "check", tiny, "--world", "8"])
    assert "on 8 ranks: dp=8" in given.output and "fewest" not in given.output


def test_plan_takes_the_profile_of_the_jobs_device(tmp_path):
    runner = CliRunner()
    tiny = str(Path(__file__).resolve().parents[1] / "jobs" / "tiny-gpt.yaml")
    for device, profile in (("auto", "h100-ndr"), ("cpu", "cpu"), ("xpu", "max1550-aurora")):
        result = runner.invoke(main, ["plan", tiny, "--devices", "2", "--top", "1", "-o",
                                      "json", "--set", f"parallel.device={device}"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["machine"] == profile
        assert f"machine: {profile} (for parallel.device: {device}" in result.stderr
    unknown = runner.invoke(main, ["plan", tiny, "--devices", "2", "--machine", "h200"])
    assert unknown.exit_code == 2 and len(unknown.output.splitlines()) == 1
    assert ("unknown machine profile 'h200' — fix: choose among a100-hdr, cpu, h100-ndr, "
            "max1550-aurora, max1550-supermuc") in unknown.output


def test_the_help_names_every_checkpoint_verb():
    text = CliRunner().invoke(main, ["--help"]).output
    line = next(s for s in text.splitlines() if s.strip().startswith("checkpoint"))
    assert all(verb in line for verb in ("List", "inspect", "verify", "export")), line


def test_an_operator_command_fails_at_once_where_nothing_listens(tmp_path):
    """A refused connection is final for a one-shot command: no retries for seconds."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        url = f"redis://op:secret@127.0.0.1:{s.getsockname()[1]}/0"
        for args in (["chaos", "kill-rank", "--job", "x", "--rank", "0", "--yes"],
                     ["health-check", "--job", "x"], ["job", "status", "--job", "x"],
                     ["events", "--job", "x", "--no-follow"],
                     ["node", "exclude", "node0", "--job", "x", "--yes", "--reason", "r"]):
            proc = subprocess.run([sys.executable, "-m", "controller", *args],
                                  capture_output=True, text=True, timeout=60,
                                  env={**os.environ, "REDIS_URL": url})  # not on argv: a secret
            assert proc.returncode == 2 and proc.stdout == ""
            assert proc.stderr == (f"error: nothing listens at redis://op:***@127.0.0.1:"
                                   f"{s.getsockname()[1]}/0 (connection refused); fix: give "
                                   "$REDIS_URL the URL the controller uses (`optimus run` keeps "
                                   "it in <run_dir>/control/redis.env), or start that Redis\n")
