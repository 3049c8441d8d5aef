"""Hugging Face export of a run trained on a mixture of prepared sources (`data.sources`).

Real `optimus data prepare`, real training (a gloo rank; an `optimus train` process for the run
with relative paths), real Transformers: the export holds the sources' tokenizer and
end-of-document id, loads with Optimus's logits, and reads relative data paths from the folder
training ran in, not from the folder the export runs in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from multiproc import run_ranks
from test_data import _hf_tokenizer
from test_hf import _logits_diff, _train, job

from optimus.checkpoint import latest_committed
from optimus.cli import main
from optimus.data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["the", "fox", "says", "hello", "world", "again", "and", "then"]
HF_EOS = 1  # "</s>" in the WordLevel tokenizer `_hf_tokenizer` writes
LAUNCHER_VARS = ("OPTIMUS_", "SLURM_", "PALS_", "PMIX_", "PMI_", "OMPI_", "TORCHELASTIC_",
                 "GROUP_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_")


def _prepare(folder: Path, out: str, tokenizer: str, shift: int) -> None:
    """`optimus data prepare` on a corpus of its own (documents differ per `shift`)."""
    text = folder / f"corpus-{shift}.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join(
        WORDS[(i + j * shift) % len(WORDS)] for j in range(40))}) + "\n" for i in range(30)))
    result = CliRunner().invoke(main, ["data", "prepare", str(text), "--out", out,
                                       "--tokenizer", tokenizer])
    assert result.exit_code == 0, result.output


def _export(step_root: Path, out: Path, *more: str):
    return CliRunner().invoke(main, ["checkpoint", "export", "latest", "--dir", str(step_root),
                                     "--format", "hf", "--out", str(out), *more])


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["byte", "hf"])
def mixture_run(request, tmp_path_factory):
    """A run trained on two sources (weights 3 and 1) prepared with one tokenizer: the byte
    tokenizer, or a Hugging Face tokenizer.json."""
    tmp = tmp_path_factory.mktemp(f"mix-{request.param}")
    spec = "byte"
    if request.param == "hf":
        pytest.importorskip("tokenizers")
        spec = str(tmp / "tokenizer.json")
        _hf_tokenizer(spec, WORDS)
    for shift, name in ((1, "web"), (3, "code")):
        _prepare(tmp, str(tmp / name), spec, shift)
    raw = job(tmp / "run", data={"source": "shards", "sources": [
        {"path": str(tmp / "web"), "weight": 3}, {"path": str(tmp / "code"), "weight": 1}]})
    state = run_ranks(_train, 1, raw, timeout=120)[0]
    return raw, latest_committed(tmp / "run" / "checkpoints"), state, spec


def test_a_mixture_exports_with_its_sources_tokenizer_and_logits(mixture_run, tmp_path,
                                                                 transformers):
    raw, step, state, spec = mixture_run
    out = tmp_path / "hf"
    result = _export(step.parent, out)
    assert result.exit_code == 0, result.output
    assert "note:" not in result.output  # nothing left out
    eos = load_tokenizer(spec).eos_id
    assert eos == (256 if spec == "byte" else HF_EOS)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    if spec != "byte":  # the very file the sources were prepared with
        assert (out / "tokenizer.json").read_bytes() == Path(spec).read_bytes()
    diff, _ = _logits_diff(transformers, out, raw, state)
    assert diff <= 1e-4
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "the fox says hello world again"
    assert hf_tok(text)["input_ids"] == load_tokenizer(spec).encode(text)
    assert hf_tok.eos_token_id == eos


@pytest.fixture(scope="module")
def relative_project(tmp_path_factory):
    """A project folder whose job names everything relative to it (data, tokenizer, run_dir),
    prepared and trained (an `optimus train` process) from inside it."""
    pytest.importorskip("tokenizers")
    project = tmp_path_factory.mktemp("project")
    (project / "tok").mkdir()
    _hf_tokenizer(project / "tok" / "tokenizer.json", WORDS)
    here = Path.cwd()
    os.chdir(project)
    try:
        for shift, name in ((1, "data/web"), (3, "data/code")):
            _prepare(project, name, "tok/tokenizer.json", shift)
    finally:
        os.chdir(here)
    raw = job(Path("runs/rel"), data={"source": "shards", "sources": [
        {"path": "data/web", "weight": 3}, {"path": "data/code", "weight": 1}]})
    (project / "job.yaml").write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    done = subprocess.run([sys.executable, "-m", "optimus", "train", "job.yaml"], cwd=project,
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return project


def _decoy(folder: Path) -> None:
    """`data/web`, `data/code` and `tok/tokenizer.json` in another folder, made with another
    tokenizer: read from there, the export would have the byte tokenizer's eos (256)."""
    folder.mkdir()
    (folder / "tok").mkdir()
    _hf_tokenizer(folder / "tok" / "tokenizer.json", ["<pad>", *WORDS])  # "</s>" is 1 too
    for shift, name in ((1, "web"), (3, "code")):
        _prepare(folder, str(folder / "data" / name), "byte", shift)


def test_relative_data_paths_are_read_from_the_folder_training_ran_in(
        relative_project, tmp_path, monkeypatch, transformers):
    project = tmp_path / "project"
    shutil.copytree(relative_project, project)  # the run's folder, moved whole
    _decoy(tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path / "elsewhere")
    out = tmp_path / "hf"
    result = _export(project / "runs" / "rel" / "checkpoints", out)
    assert result.exit_code == 0, result.output
    assert "note:" not in result.output
    tok_file = project / "tok" / "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == HF_EOS
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok("hello world")["input_ids"] == load_tokenizer(str(tok_file)).encode(
        "hello world")


def test_missing_tokenizer_or_source_fails_the_export_in_one_line(relative_project, tmp_path,
                                                                  monkeypatch):
    project = tmp_path / "project"
    shutil.copytree(relative_project, project)
    _decoy(tmp_path / "elsewhere")  # its tok/tokenizer.json is not the one: never taken
    monkeypatch.chdir(tmp_path / "elsewhere")
    checkpoints, out = project / "runs" / "rel" / "checkpoints", tmp_path / "hf"

    (project / "tok" / "tokenizer.json").unlink()
    result = _export(checkpoints, out)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.count("\n") == 1
    assert result.output.startswith("error: the data was prepared with tokenizer "
                                    "tok/tokenizer.json")
    assert f"copy the tokenizer.json the data was prepared with to {project}/tok/" \
           "tokenizer.json" in result.output
    assert not out.exists() and not list(tmp_path.glob(".tmp*"))

    shutil.rmtree(project / "data" / "code")
    result = _export(checkpoints, out)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.count("\n") == 1
    assert (f"error: data.sources[1].path is data/code: {project}/data/code holds no prepared "
            f"data") in result.output
    assert f"read from {project}, as training read it: the folder it ran in" in result.output
    assert not out.exists() and not list(tmp_path.glob(".tmp*"))


def test_with_an_absolute_checkpoint_dir_the_recorded_training_folder_is_used(
        relative_project, tmp_path, monkeypatch, transformers):
    """Training wrote its checkpoints to an absolute checkpoint.dir outside its folder: the
    folder it ran in is not in the checkpoint's path, so the manifest's `workdir` says it."""
    checkpoints = tmp_path / "store" / "ckpt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    done = subprocess.run([sys.executable, "-m", "optimus", "train", "job.yaml", "--set",
                           f"checkpoint.dir={checkpoints}", "--set", "run_dir=runs/abs"],
                          cwd=relative_project, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    _decoy(tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path / "elsewhere")
    out = tmp_path / "hf"
    # the run's key is in its run_dir, not beside this checkpoint.dir: --dir cannot find it
    result = _export(checkpoints, out, "--trust-checkpoint")
    assert result.exit_code == 0, result.output
    tok_file = relative_project / "tok" / "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == HF_EOS
