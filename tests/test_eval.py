"""Validation: the held-out loss is the mean cross-entropy of the same tokens on every layout.

The reference is computed here by hand, from the one-process model's weights after the same
steps, over the windows the held-out order names; each layout must reproduce it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from optimus.config import ConfigError, validate_job
from optimus.data.order import SampleOrder
from optimus.data.synthetic import SyntheticCorpus
from optimus.evaluate import held_out_source
from optimus.models import build_model
from optimus.train import train

STEPS, EVERY, BATCHES = 4, 2, 2


def base_job(tmp: str, **parallel) -> dict:
    experts = parallel.pop("experts", 0)
    return {"name": "eval", "run_dir": tmp,
            "model": {"vocab_size": 256, "dim": 64, "n_layers": 4, "n_heads": 4,
                      "n_kv_heads": 2, "ffn_dim": 128, "max_seq_len": 32,
                      "moe": {"experts": experts, "top_k": 2}},
            "optim": {"steps": STEPS, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1},
            "data": {"seq_len": 32, "batch_size": 8, "microbatches": 4},
            "eval": {"every": EVERY, "batches": BATCHES},
            "parallel": {"device": "cpu", **parallel}}


def _train(rank: int, world_size: int, raw: dict) -> dict:
    result = train(validate_job(raw, world=world_size), keep_state=world_size == 1,
                   quiet=rank != 0)
    return {"evals": [(s, e.loss, e.tokens) for s, e in result.evals],
            "losses": result.losses, "state": result.state}


def by_hand(raw: dict, state: dict) -> float:
    """Mean cross-entropy of the held-out windows, with a plain model holding `state`."""
    job = validate_job(raw, world=1)
    model = build_model(job.model, seed=job.seed)
    model.load_state_dict(state, strict=False)
    source = held_out_source(job)
    seq, n = job.data.seq_len, BATCHES * job.data.batch_size
    order = SampleOrder((source.num_tokens - 1) // seq, job.seed)
    windows = torch.stack([torch.from_numpy(source.read(order.sample_id(g) * seq, seq + 1))
                           for g in range(n)])
    with torch.no_grad():
        logits = model(windows[:, :-1])
    return float(F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()))


_one: dict = {}


def one_process(run_ranks, tmp_path_factory, experts: int = 0) -> dict:
    if experts not in _one:
        raw = base_job(str(tmp_path_factory.mktemp("one")), experts=experts)
        raw["checkpoint"] = {"interval": STEPS, "async_mode": "sync"}  # for `optimus eval`
        (_one[experts],) = run_ranks(_train, 1, raw, timeout=120)
        _one[experts]["raw"] = raw
    return _one[experts]


def test_one_process_validates_the_held_out_windows(run_ranks, tmp_path_factory):
    one = one_process(run_ranks, tmp_path_factory)
    steps = [s for s, _, _ in one["evals"]]
    assert steps == [2, 4]  # every 2 steps, the last included
    assert all(t == BATCHES * 8 * 32 for _, _, t in one["evals"])
    final = one["evals"][-1][1]
    assert final == pytest.approx(by_hand(one["raw"], one["state"]), rel=1e-6)
    # held out, not the training batches: not the loss of the last training step
    assert final != pytest.approx(one["losses"][-1], rel=1e-4)
    # the metrics file has the eval lines, with perplexity
    with open(f"{one['raw']['run_dir']}/metrics.jsonl") as f:
        lines = [json.loads(x) for x in f]
    evals = [x for x in lines if x.get("event") == "eval"]
    assert [e["step"] for e in evals] == [2, 4]
    assert evals[-1]["perplexity"] == pytest.approx(math.exp(final), rel=1e-9)
    assert evals[-1]["val_loss"] == pytest.approx(final) and "loss" not in evals[-1]


LAYOUTS = {
    "TP2xPP2": (4, {"tp": 2, "pp": 2}),
    # stages 0, 2 on one rank and 1, 3 on the other: each sends to the other in both directions
    "PP2v2-interleaved": (2, {"pp": 2, "virtual_stages": 2, "schedule": "interleaved_1f1b"}),
    "PP2v2-zero-bubble": (2, {"pp": 2, "virtual_stages": 2, "schedule": "zbv_zero_bubble"}),
    # each cp rank's loss is its slice's; the tokens are counted once a replica
    "CP2xPP2": (4, {"cp": 2, "pp": 2}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_validates_like_one_process(run_ranks, tmp_path_factory, name):
    world, parallel = LAYOUTS[name]
    one = one_process(run_ranks, tmp_path_factory)
    raw = base_job(str(tmp_path_factory.mktemp(name)), **parallel)
    ranks = run_ranks(_train, world, raw, timeout=240)
    for r in ranks:  # every rank returns the same value
        assert [(s, t) for s, _, t in r["evals"]] == [(s, t) for s, _, t in one["evals"]]
        for (_, got, _), (_, want, _) in zip(r["evals"], one["evals"], strict=True):
            assert got == pytest.approx(want, rel=2e-5), name


def test_moe_under_expert_parallel_validates_like_one_process(run_ranks, tmp_path_factory):
    one = one_process(run_ranks, tmp_path_factory, experts=4)
    raw = base_job(str(tmp_path_factory.mktemp("ep")), experts=4, ep=2)
    ranks = run_ranks(_train, 2, raw, timeout=240)
    for r in ranks:
        for (_, got, _), (_, want, _) in zip(r["evals"], one["evals"], strict=True):
            assert got == pytest.approx(want, rel=2e-5)
    assert one["evals"][-1][1] == pytest.approx(by_hand(one["raw"], one["state"]), rel=1e-6)


def test_synthetic_held_out_is_past_the_training_stream():
    corpus = SyntheticCorpus(256, seed=7)
    held = corpus.held_out()
    assert held.first_doc * corpus.doc_len >= corpus.num_tokens
    # same language (same symbols), other documents
    assert set(held.read(0, 4096).tolist()) <= set(corpus.symbols.tolist()) | {corpus.eos_id}
    assert not torch.equal(torch.from_numpy(held.read(0, 256)),
                           torch.from_numpy(corpus.read(0, 256)))


def test_config_refusals(tmp_path):
    raw = base_job(str(tmp_path))
    raw["data"].update(source="shards", path=str(tmp_path))
    with pytest.raises(ConfigError, match="eval.path"):
        validate_job(raw, world=1)
    raw = base_job(str(tmp_path))
    raw["eval"] = {"every": 0, "path": str(tmp_path)}
    with pytest.raises(ConfigError, match="only read when eval.every"):
        validate_job(raw, world=1)


def _evaluate_checkpoint(rank: int, world_size: int, path: str, overrides: list) -> float:
    from pathlib import Path

    from optimus.evaluate import evaluate_checkpoint

    result, manifest, _ = evaluate_checkpoint(Path(path), data=None, batches=BATCHES,
                                              overrides=overrides)
    assert manifest["step"] == STEPS
    return result.loss


def test_optimus_eval_of_a_checkpoint_matches_the_run_on_any_layout(run_ranks, tmp_path_factory):
    one = one_process(run_ranks, tmp_path_factory)
    root = f"{one['raw']['run_dir']}/checkpoints"
    want = one["evals"][-1][1]  # the run's own validation of its last step
    out = subprocess.run([sys.executable, "-m", "optimus", "eval", "latest", "--dir", root,
                          "--batches", str(BATCHES), "-o", "json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["step"] == STEPS and report["eval_tokens"] == BATCHES * 8 * 32
    assert report["val_loss"] == pytest.approx(want, rel=1e-6)
    assert report["perplexity"] == pytest.approx(math.exp(want), rel=1e-6)
    # resharded by DCP onto tensor parallel ranks: the same value
    for loss in run_ranks(_evaluate_checkpoint, 2, root + f"/step_{STEPS:09d}",
                          ["parallel.tp=2"], timeout=120):
        assert loss == pytest.approx(want, rel=2e-5)


def test_optimus_eval_refusals(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "optimus", "eval", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert missing.stderr.strip().startswith("error:") and "does not exist" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
