"""The `optimus` command end to end: prepare data, train on it, refuse bad input in one line."""

from __future__ import annotations

import json
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
