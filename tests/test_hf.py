"""Hugging Face export and import, against real Transformers.

Checkpoints come from real training runs on gloo ranks (tp2, ep2 x dp2, one process); the
exported folders are loaded by `transformers.AutoModelForCausalLM` and must give Optimus's
logits; imports run on parallel layouts (pp2, ep2) and must hold exactly the exported weights,
and export -> import -> export must give the same bytes.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from multiproc import run_ranks

from optimus.checkpoint import CheckpointError, latest_committed
from optimus.cli import main
from optimus.config import ModelConfig, validate_job
from optimus.data import build_loader, build_source
from optimus.data.prepare import prepare
from optimus.data.tokenizer import ByteTokenizer, HFTokenizer
from optimus.hf import choose_family, export_hf, hf_config, load_hf
from optimus.models import build_model
from optimus.train import train

MODEL = {"vocab_size": 258, "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2,
         "ffn_dim": 96, "max_seq_len": 32}
GLM = {"experts": 4, "top_k": 2, "score": "sigmoid", "shared_experts": 1, "expert_ffn_dim": 32,
       "dense_layers": 1, "balance": "bias", "bias_update_rate": 0.05}
QWEN = {"experts": 4, "top_k": 2, "score": "softmax", "expert_ffn_dim": 32, "dense_layers": 1}


def job(run_dir: Path, moe: dict | None = None, **sections) -> dict:
    raw = {"name": "hf", "run_dir": str(run_dir), "model": {**MODEL, "moe": moe or {}},
           "optim": {"steps": 3, "lr": 1e-2, "warmup_steps": 1},
           "data": {"seq_len": 32, "batch_size": 4},
           "parallel": {"device": "cpu"},
           "checkpoint": {"interval": 3, "async_mode": "thread"}}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


def _train(rank: int, world_size: int, raw: dict):
    result = train(validate_job(raw, world=world_size), keep_state=True, quiet=rank != 0)
    return result.state if rank == 0 else None


def _import_and_save(rank: int, world_size: int, raw: dict, hf_dir: str, root: str):
    """Build the job's model on this layout, fill it from `hf_dir`, save it as step 0 of
    `root`; the full weights (gathered) from every rank."""
    from optimus.checkpoint.saver import Checkpointer
    from optimus.checkpoint.state import ModelState
    from optimus.config import resolve_layout
    from optimus.parallel.plan import build_parallel_model
    from optimus.train import _full_state

    job_ = validate_job(raw, world=world_size)
    mesh = resolve_layout(job_, world_size).build_mesh("cpu")
    model = build_parallel_model(job_, mesh, torch.device("cpu"))
    load_hf(Path(hf_dir), job_.model, model.parts)
    saver = Checkpointer(root, rank=rank, world_size=world_size, mode="sync")
    saver.save(0, {"model": ModelState(model.state_view())},
               {"config": job_.model_dump(mode="json")})
    saver.close()
    return {k: v for part in model.parts for k, v in _full_state(part).items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three trained checkpoints: dense GQA on tp2 (byte-tokenized shards), GLM-style MoE on
    ep2 x dp2, Qwen-style MoE on one process; with their final full weights."""
    tmp = tmp_path_factory.mktemp("hf")
    text = tmp / "corpus.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i}: héllo wörld, " * 8}) + "\n"
                            for i in range(40)))
    prepare([text], tmp / "data")
    out = {}
    for name, moe, world, extra in (
            ("dense", None, 2, {"parallel": {"device": "cpu", "tp": 2},
                                "data": {"source": "shards", "path": str(tmp / "data")}}),
            ("glm", GLM, 2, {"parallel": {"device": "cpu", "ep": 2}}),
            ("qwen", QWEN, 1, {})):
        raw = job(tmp / name, moe, **extra)
        state = run_ranks(_train, world, raw, timeout=120)[0]
        out[name] = (raw, latest_committed(tmp / name / "checkpoints"), state)
    return out


@pytest.fixture(scope="module")
def transformers():
    """Imported only by the tests that load models (seconds of imports)."""
    return pytest.importorskip("transformers")


def _logits_diff(transformers, exported: Path, raw: dict, state: dict) -> tuple[float, object]:
    cfg = ModelConfig.model_validate(raw["model"])
    ours = build_model(cfg, seed=0)
    ours.load_state_dict(state)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return float((ours.eval()(tokens) - theirs.eval()(tokens).logits).abs().max()), theirs


def test_dense_gqa_export_loads_in_transformers_with_the_same_logits(runs, tmp_path,
                                                                    transformers):
    raw, step, state = runs["dense"]
    out = tmp_path / "llama"
    result = CliRunner().invoke(main, ["checkpoint", "export", "latest", "--dir",
                                       str(step.parent), "--format", "hf", "--out", str(out),
                                       "--max-shard-size", "100KB"])
    assert result.exit_code == 0, result.output
    assert "LlamaForCausalLM" in result.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert all(p.stat().st_size < 100_000 + 4096 for p in out.glob("model-*.safetensors"))
    diff, model = _logits_diff(transformers, out, raw, state)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads == 2 and model.config.num_attention_heads == 4
    assert diff <= 1e-4
    # The byte tokenizer, written as an exact tokenizer.json: same ids as Optimus's own.
    text = "héllo wörld — 日本語 🎉\n\tend"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(text)["input_ids"] == ByteTokenizer().encode(text)
    assert hf_tok.eos_token_id == 256 == HFTokenizer(out / "tokenizer.json").eos_id
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256


# Transformers builds Qwen2-MoE's shared expert at the zero width it is exported with.
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("name, family", [("glm", "Glm4MoeForCausalLM"),
                                          ("qwen", "Qwen2MoeForCausalLM")])
def test_moe_export_loads_as_the_matching_family_with_the_same_logits(runs, tmp_path, name,
                                                                      family, transformers):
    raw, step, state = runs[name]
    done = export_hf(step, tmp_path / name)
    assert done.family.architecture == family
    assert done.notes and "synthetic" in done.notes[0]  # no tokenizer to write
    if name == "glm":  # the loss-free bias moved, and routing depends on it
        assert state["layers.1.feed_forward.expert_bias"].count_nonzero() > 0
    diff, model = _logits_diff(transformers, tmp_path / name, raw, state)
    assert type(model).__name__ == family
    assert diff <= 1e-4
    # Streaming: every checkpoint read asked for one tensor, each model tensor read once
    # (Qwen2-MoE has no loss-free bias: it is not read).
    written = [k for k in state if name == "glm" or not k.endswith("expert_bias")]
    assert done.loads == [1] * len(written)


@pytest.mark.parametrize("moe, reason", [
    ({**QWEN, "capacity_factor": 1.25}, "drops tokens"),
    ({**QWEN, "shared_experts": 1}, "ungated shared experts"),
    ({**QWEN, "balance": "bias"}, "bias is non-zero"),
    ({**GLM, "experts": 1, "top_k": 1}, "at least 2 experts"),
])
def test_moe_without_an_exact_family_is_refused_with_its_reason(moe, reason):
    cfg = ModelConfig.model_validate({**MODEL, "moe": moe})
    with pytest.raises(CheckpointError, match=reason):
        choose_family(cfg, bias_nonzero=True)
    if moe.get("balance") == "bias" and moe["score"] == "softmax":  # zero bias: Qwen2-MoE
        assert choose_family(cfg, bias_nonzero=False).model_type == "qwen2_moe"


def test_a_refused_export_says_why_in_one_line_and_writes_nothing(tmp_path):
    raw = job(tmp_path, {**QWEN, "balance": "bias"})
    run_ranks(_save_fresh, 1, raw, str(tmp_path / "ckpt"), 0.05, timeout=120)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["checkpoint", "export", "0", "--dir",
                                       str(tmp_path / "ckpt"), "--format", "hf", "--out",
                                       str(out)])
    assert result.exit_code == 2
    assert "the loss-free bias is non-zero" in result.output
    assert "Exportable: moe.score: sigmoid" in result.output
    assert not out.exists() and not list(tmp_path.glob(".tmp*"))


@pytest.mark.parametrize("name, world, parallel", [("dense", 2, {"pp": 2}),
                                                   ("glm", 2, {"ep": 2})])
def test_import_on_a_parallel_layout_is_exact_and_round_trips_byte_identical(
        runs, tmp_path, name, world, parallel):
    raw, step, state = runs[name]
    first = export_hf(step, tmp_path / "first").out
    raw = {**raw, "model": {**raw["model"], "init_from": f"hf:{first}"},
           "parallel": {"device": "cpu", **parallel},
           "data": {**raw["data"], "microbatches": 2}}  # pp2 wants as many as stages
    fulls = run_ranks(_import_and_save, world, raw, str(first), str(tmp_path / "ckpt"),
                      timeout=120)
    imported = {k: v for full in fulls for k, v in full.items()}
    assert imported.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(imported[key], value), key
    second = export_hf(latest_committed(tmp_path / "ckpt"), tmp_path / "second").out
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    for f in files:
        assert (first / f).read_bytes() == (second / f).read_bytes(), f


def test_a_run_starts_from_init_from_unless_it_resumes(runs, tmp_path):
    raw, step, state = runs["dense"]
    exported = export_hf(step, tmp_path / "hf").out
    raw = job(tmp_path / "run", model={**MODEL, "init_from": f"hf:{exported}"},
              data=runs["dense"][0]["data"], optim={"steps": 1, "lr": 1e-2, "warmup_steps": 1},
              checkpoint={"interval": 1, "async_mode": "thread"})
    losses = run_ranks(_losses, 2, raw, timeout=120)[0]  # dp2: each rank fills its shards
    # The first step's loss is the imported model's on the first batch.
    job_ = validate_job(raw, world=1)
    ours = build_model(job_.model, seed=0)
    ours.load_state_dict(state)
    source = build_source("shards", path=raw["data"]["path"], vocab_size=258, seed=job_.seed)
    batch = next(iter(build_loader(source, seq_len=32, batch_size=4, microbatches=1, dp_rank=0,
                                   dp_size=1, seed=job_.seed, start_index=0, num_workers=0,
                                   prefetch_factor=2)))
    with torch.no_grad():
        want = F.cross_entropy(ours(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=-100)
    assert abs(losses[0] - float(want)) < 1e-5
    raw["optim"]["steps"] = 2  # a rerun resumes its own checkpoint: init_from is not used
    run_ranks(_losses, 2, raw, timeout=120)
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    used = [e["applied"] for e in events if e.get("event") == "init_from"]
    assert used == [True, False]


def _losses(rank: int, world_size: int, raw: dict) -> list[float]:
    return train(validate_job(raw, world=world_size)).losses


@pytest.mark.parametrize("tied", [False, True])
def test_a_llama_saved_by_transformers_imports_exactly(tmp_path, transformers, tied):
    """Not only our exports: a Transformers Llama (one file, no index, MQA, other theta and
    eps; with tied embeddings the head starts as the embedding)."""
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32,
        rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path)
    cfg = ModelConfig.model_validate({"vocab_size": 300, "dim": 64, "ffn_dim": 128,
                                      "n_layers": 2, "n_heads": 4, "n_kv_heads": 1,
                                      "max_seq_len": 32, "norm_eps": 1e-6, "rope_theta": 5e4})
    ours = build_model(cfg, seed=0).eval()
    load_hf(tmp_path, cfg, [ours])
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((ours(tokens) - theirs(tokens).logits).abs().max()) <= 1e-4


def test_a_config_json_that_does_not_match_the_job_is_refused(runs, tmp_path):
    raw, step, _ = runs["dense"]
    exported = export_hf(step, tmp_path / "hf").out
    other = ModelConfig.model_validate({**MODEL, "n_kv_heads": 4})
    with pytest.raises(CheckpointError, match="num_key_value_heads is 2 but the job has "
                                              "model.n_kv_heads = 4"):
        load_hf(exported, other, [])
    moe = ModelConfig.model_validate({**MODEL, "moe": GLM})
    with pytest.raises(CheckpointError, match="holds a 'llama' model.*'glm4_moe'"):
        load_hf(exported, moe, [])
    config = hf_config(ModelConfig.model_validate(MODEL), choose_family(other))
    config["rope_parameters"]["rope_theta"] = 500000.0
    (exported / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="rope_theta is 500000.0 but the job has "
                                              "model.rope_theta = 10000.0"):
        load_hf(exported, ModelConfig.model_validate(MODEL), [])


def test_export_refuses_a_non_empty_out_and_a_step_without_its_directory(runs, tmp_path,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./runs here: a bare STEP has no default directory
    _, step, _ = runs["qwen"]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    cli = CliRunner()
    result = cli.invoke(main, ["checkpoint", "export", str(step), "--format", "hf", "--out",
                               str(tmp_path / "taken")])
    assert result.exit_code == 2
    assert "is not empty: give a new directory, or --overwrite" in result.output
    assert (tmp_path / "taken" / "x").read_text() == "mine"
    result = cli.invoke(main, ["checkpoint", "export", "2", "--format", "hf", "--out",
                               str(tmp_path / "new")])
    assert result.exit_code == 2 and "give --dir CHECKPOINT_DIR or --job" in result.output
    result = cli.invoke(main, ["checkpoint", "export", str(step), "--format", "hf", "--out",
                               str(tmp_path / "taken"), "--overwrite", "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "taken" / "x").exists()
    assert json.loads((tmp_path / "taken" / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_streams_its_peak_memory_stays_far_below_the_model(runs, tmp_path):
    big = {**job(tmp_path, None), "model": {"vocab_size": 258, "dim": 512, "n_layers": 5,
                                            "n_heads": 8, "max_seq_len": 32}}
    model_bytes = run_ranks(_save_fresh, 1, big, str(tmp_path / "big"), timeout=120)[0]
    assert model_bytes > 60e6
    growth = run_ranks(_peak_growth, 1, str(runs["qwen"][1]), str(latest_committed(
        tmp_path / "big")), str(tmp_path), timeout=120)[0]
    assert growth < model_bytes / 3, (growth, model_bytes)  # measured: ~1/7
    assert sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors")) > model_bytes


def _save_fresh(rank: int, world_size: int, raw: dict, root: str, bias: float = 0.0) -> int:
    """A freshly initialised model of the job (its loss-free biases at `bias`), saved as step 0
    of `root`; its size."""
    from optimus.checkpoint.saver import Checkpointer
    from optimus.checkpoint.state import ModelState
    from optimus.models.moe import moe_layers

    job_ = validate_job(raw, world=world_size)
    model = build_model(job_.model, seed=job_.seed)
    for layer in moe_layers(model):
        layer.expert_bias.fill_(bias)
    saver = Checkpointer(root, rank=rank, world_size=world_size, mode="sync")
    saver.save(0, {"model": ModelState(model)}, {"config": job_.model_dump(mode="json")})
    saver.close()
    return sum(v.numel() * v.element_size() for v in model.state_dict().values())


def _peak_growth(rank: int, world_size: int, tiny: str, big: str, tmp: str) -> int:
    """How far this (fresh) process's peak memory rises while it exports `big`, after a
    first export of `tiny` has run every code path once."""
    export_hf(tiny, Path(tmp) / "warm")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    export_hf(big, Path(tmp) / "out")
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
