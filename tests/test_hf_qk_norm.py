"""Hugging Face export and import of models with QK-norm (`model.qk_norm`), against real
Transformers: a dense model is a Qwen3, a softmax MoE a Qwen3-MoE, a sigmoid MoE a GLM-4-MoE
with `use_qk_norm: true`.

The checkpoints are fresh models whose norm weights are drawn away from one (a trained model's
are too): a q/k norm weight written without RoPE's permutation, or to the wrong head dim,
changes the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from test_hf import GLM, MODEL, QWEN, _import_and_save, _logits_diff, job

from optimus.checkpoint import CheckpointError, latest_committed
from optimus.config import ModelConfig, validate_job
from optimus.hf import choose_family, export_hf, hf_config, load_hf
from optimus.models import build_model
from optimus.models.moe import moe_layers


def _save_drawn(rank: int, world_size: int, raw: dict, root: str) -> dict:
    """A fresh model of the job with its norm weights (and loss-free biases) drawn at random,
    saved as step 0 of `root`; its state."""
    from optimus.checkpoint.saver import Checkpointer
    from optimus.checkpoint.state import ModelState

    job_ = validate_job(raw, world=world_size)
    model = build_model(job_.model, seed=job_.seed)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        for layer in moe_layers(model):
            layer.expert_bias.copy_(0.05 * torch.randn(layer.expert_bias.shape, generator=g))
    saver = Checkpointer(root, rank=rank, world_size=world_size, mode="sync")
    saver.save(0, {"model": ModelState(model)}, {"config": job_.model_dump(mode="json")})
    saver.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


CASES = {  # name: (model.moe, the family)
    "dense": ({}, "Qwen3ForCausalLM"),
    "softmax-moe": (QWEN, "Qwen3MoeForCausalLM"),
    "sigmoid-moe": (GLM, "Glm4MoeForCausalLM"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qk")
    out = {}
    for name, (moe, _) in CASES.items():
        raw = job(tmp / name, moe, model={**MODEL, "qk_norm": True, "moe": moe})
        state = run_ranks(_save_drawn, 1, raw, str(tmp / name / "ckpt"), timeout=120)[0]
        out[name] = (raw, latest_committed(tmp / name / "ckpt"), state)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_a_qk_norm_model_exports_to_its_family_with_the_same_logits(saved, tmp_path, name):
    transformers = pytest.importorskip("transformers")
    raw, step, state = saved[name]
    done = export_hf(step, tmp_path / name)
    assert done.family.architecture == CASES[name][1]
    config = json.loads((tmp_path / name / "config.json").read_text())
    if name == "sigmoid-moe":
        assert config["use_qk_norm"] is True
    assert state["layers.1.attention.q_norm.weight"].std() > 0.1  # far from ones
    diff, model = _logits_diff(transformers, tmp_path / name, raw, state)
    assert type(model).__name__ == CASES[name][1]
    assert diff <= 1e-6, diff


def test_a_qk_norm_model_imports_on_tp2_exactly_and_round_trips(saved, tmp_path):
    raw, step, state = saved["dense"]
    first = export_hf(step, tmp_path / "first").out
    raw = {**raw, "model": {**raw["model"], "init_from": f"hf:{first}"},
           "parallel": {"device": "cpu", "tp": 2}}
    fulls = run_ranks(_import_and_save, 2, raw, str(first), str(tmp_path / "ckpt"),
                      timeout=120)
    for full in fulls:  # the norms' weights are whole on each tp rank
        assert full.keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(full[key], value), key
    second = export_hf(latest_committed(tmp_path / "ckpt"), tmp_path / "second").out
    for f in sorted(p.name for p in first.iterdir()):
        assert (first / f).read_bytes() == (second / f).read_bytes(), f


def test_a_qwen3_saved_by_transformers_imports_exactly(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32,
        rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    theirs = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    theirs.save_pretrained(tmp_path)
    cfg = ModelConfig.model_validate({"vocab_size": 300, "dim": 64, "ffn_dim": 128,
                                      "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                      "max_seq_len": 32, "norm_eps": 1e-6, "rope_theta": 5e4,
                                      "qk_norm": True})
    ours = build_model(cfg, seed=0).eval()
    load_hf(tmp_path, cfg, [ours])
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((ours(tokens) - theirs(tokens).logits).abs().max()) <= 1e-6
    # The same folder into a job without QK-norm: one line naming the setting.
    plain = ModelConfig.model_validate({**cfg.model_dump(), "qk_norm": False})
    with pytest.raises(CheckpointError, match=r"holds a 'qwen3' model; this job's model "
                                              r"\(model.qk_norm: False.*'llama'"):
        load_hf(tmp_path, plain, [])


def test_families_follow_qk_norm_and_a_glm_checkpoint_says_which_setting_differs(saved):
    without = {"dense": "LlamaForCausalLM", "softmax-moe": "Qwen2MoeForCausalLM",
               "sigmoid-moe": "Glm4MoeForCausalLM"}
    for name, (moe, family) in CASES.items():
        cfg = ModelConfig.model_validate({**MODEL, "qk_norm": True, "moe": moe})
        plain = ModelConfig.model_validate({**MODEL, "moe": moe})
        assert choose_family(cfg).architecture == family, name
        assert choose_family(plain).architecture == without[name], name
        assert hf_config(plain, choose_family(plain)).get("use_qk_norm", False) is False
    raw, step, _ = saved["sigmoid-moe"]
    exported = export_hf(step, Path(step).parent / "hf").out
    plain = ModelConfig.model_validate({**raw["model"], "qk_norm": False})
    with pytest.raises(CheckpointError, match="use_qk_norm is True but the job has "
                                              "model.qk_norm = False"):
        load_hf(exported, plain, [])
