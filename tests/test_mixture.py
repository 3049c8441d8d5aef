"""Weighted mixtures of prepared sources (`data.sources`): shares, the order as a pure function
of (seed, index), dp resharding and resume through the loader, refusals, and one real 2-rank
training run stopped and resumed on one rank."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from optimus.config import ConfigError, validate_job
from optimus.data import DataError, Mixture, TokenShards, build_loader, build_source
from optimus.data.mixture import BLOCK, quotas
from optimus.data.prepare import prepare

SEQ = 8
WEIGHTS = [0.6, 0.3, 0.1]


def _folder(tmp: Path, name: str, n_tokens: int, **kw) -> Path:
    """A prepared folder of about `n_tokens` byte tokens, its letters naming the source."""
    text = tmp / f"{name}.txt"
    text.write_text("".join(chr(97 + (i % 26)) for i in range(n_tokens - 1)))
    prepare([text], tmp / name, **kw)
    return tmp / name


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("sources")
    # a large source, a middling one, and a small one read many times over
    return [_folder(tmp, "web", 8001), _folder(tmp, "code", 2001), _folder(tmp, "wiki", 97)]


def _mixture(folders, weights=WEIGHTS) -> Mixture:
    return Mixture([TokenShards(f) for f in folders], weights)


def test_quotas_are_proportional_and_fill_the_block():
    assert quotas([1, 1, 1], 10) == [4, 3, 3]
    assert quotas([0.7, 0.2, 0.1], 7) == [5, 1, 1]
    # 0.6, 0.3, 0.1 of 65,536 are 39,321.6, 19,660.8, 6,553.6 (in the weights' exact binary
    # values the third's remainder is the larger of the two 0.6s): the same on every Python
    assert quotas(WEIGHTS) == [39321, 19661, 6554] and sum(quotas(WEIGHTS)) == BLOCK


def test_shares_match_the_weights(folders):
    data = _mixture(folders).windows(SEQ, seed=5)
    counts = Counter(data.locate(g)[0] for g in range(BLOCK))
    assert [counts[s] for s in range(3)] == quotas(WEIGHTS)  # exact over each block
    start = 7 * BLOCK + 123  # and close over any stretch: the slots are shuffled per block
    head = Counter(data.source_of(data.sample_id(g)) for g in range(start, start + 3000))
    for s, w in enumerate(WEIGHTS):
        assert abs(head[s] / 3000 - w) < 0.03, (s, head)


def test_order_is_a_pure_function_of_seed_and_index(folders):
    a, b = _mixture(folders).windows(SEQ, 5), _mixture(folders).windows(SEQ, 5)
    indices = list(range(0, 3000)) + [BLOCK - 1, BLOCK, 10**12 + 7]
    ids = [a.sample_id(g) for g in indices]
    shuffled = random.Random(0).sample(range(len(indices)), len(indices))
    assert [b.sample_id(indices[k]) for k in shuffled] == [ids[k] for k in shuffled]
    reseeded = _mixture(folders).windows(SEQ, 6)
    assert ids != [reseeded.sample_id(g) for g in indices]
    # block 0 draws samples 0..q_s - 1 of each source, each once (then block 1 the next q_s)
    assert a.counts == [1000, 250, 12] and a.num_samples == 1262
    drawn: dict[int, list[int]] = {0: [], 1: [], 2: []}
    small = []  # the windows of the small source, in block 0's order
    for g in range(BLOCK):
        s, n = a.locate(g)
        drawn[s].append(n)
        if s == 2:
            small.append(a.sample_id(g) - a.offsets[2])
    assert [sorted(n) == list(range(q)) for n, q in zip(drawn.values(), quotas(WEIGHTS),
                                                         strict=True)] == [True] * 3
    assert a.locate(BLOCK + 5)[1] >= quotas(WEIGHTS)[a.locate(BLOCK + 5)[0]]
    # and a source's n-th sample is its own order: every window once per epoch, the small
    # source reshuffled at each of its many epochs
    by_draw = [w for _, w in sorted(zip(drawn[2], small, strict=True))]
    assert sorted(by_draw[:12]) == sorted(by_draw[12:24]) == list(range(12))
    assert by_draw[:12] != by_draw[12:24] and len(by_draw) // 12 > 500


def test_items_are_windows_of_their_source_with_unique_ids(folders):
    mix = _mixture(folders)
    data = mix.windows(SEQ, 5)
    for g in (0, 1, 2, 999, 54321):
        item = data[g]
        sid = int(item["sample_ids"])
        s = data.source_of(sid)
        window = sid - data.offsets[s]
        expect = mix.sources[s].read(window * SEQ, SEQ + 1)
        assert item["input_ids"].tolist() == expect[:-1].tolist()
        assert item["labels"].tolist() == expect[1:].tolist() and int(item["index"]) == g
    assert data.offsets == [0, 1000, 1250, 1262]  # ids [0, 1262): one per (source, window)


def _loader(folders, dp_rank=0, dp_size=1, start_index=0, weights=WEIGHTS, microbatches=2,
            num_workers=0):
    return build_loader(_mixture(folders, weights), seq_len=SEQ, batch_size=8,
                        microbatches=microbatches, dp_rank=dp_rank, dp_size=dp_size, seed=5,
                        start_index=start_index, num_workers=num_workers)


def _steps(folders, dp_size, n_steps, start_index=0, num_workers=0):
    """Sample ids per step over all ranks, in global index order."""
    per_rank = []
    for r in range(dp_size):
        it = iter(_loader(folders, r, dp_size, start_index, num_workers=num_workers))
        per_rank.append([next(it)["sample_ids"].tolist() for _ in range(2 * n_steps)])
    return [sum((per_rank[r][i] for i in (2 * s, 2 * s + 1) for r in range(dp_size)), [])
            for s in range(n_steps)]


def test_dp_resharding_and_resume_read_exactly_the_uninterrupted_samples(folders):
    ref = _steps(folders, 1, 10)
    data = _mixture(folders).windows(SEQ, 5)
    assert sum(ref, []) == [data.sample_id(g) for g in range(80)]
    assert _steps(folders, 2, 10) == ref and _steps(folders, 4, 10) == ref
    assert _steps(folders, 4, 6, start_index=4 * 8) == ref[4:]  # dp 1 -> 4 at step 4
    assert _steps(folders, 2, 3, start_index=7 * 8, num_workers=2) == ref[7:]  # pickled


def test_the_saved_state_names_the_sources_and_weights(folders):
    loader = _loader(folders)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    saved = state["_index_sampler_state"]
    assert saved["mixture"] == [[str(f), w] for f, w in zip(folders, WEIGHTS, strict=True)]
    assert saved["block"] == BLOCK and saved["next_index"] == 8
    reweighted = _loader(folders, weights=[0.5, 0.4, 0.1])
    reweighted.load_state_dict(state)
    with pytest.raises(DataError, match="the saved data state has mixture="):
        next(iter(reweighted))


def test_mixture_refusals(folders, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel(vocab={"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    tok.save(str(tmp_path / "tokenizer.json"))
    other = _folder(tmp_path, "hf", 50, tokenizer=str(tmp_path / "tokenizer.json"))
    with pytest.raises(DataError, match=r"web was prepared with tokenizer 'byte' \(vocab_size "
                       r"257, eos 256\) but .*hf with .*tokenizer\.json' \(vocab_size 3, eos 1\)"):
        _mixture([folders[0], other], [1, 1])
    with pytest.raises(DataError, match=r"wiki has weight 1e-06, under 1/65536 of the total"):
        _mixture(folders, [1, 1, 1e-6])
    tiny = _folder(tmp_path, "tiny", 5)
    with pytest.raises(DataError, match=r"tiny holds 5 tokens, fewer than one sample of "
                       r"seq_len \+ 1 = 9; add data or drop the source"):
        _mixture([folders[0], tiny], [1, 1]).windows(SEQ, 0)
    raw = {"name": "m", "data": {"source": "shards", "sources": [
        {"path": str(folders[0]), "weight": 3}, {"path": str(folders[2])}]}}
    data = validate_job(raw).data
    mix = build_source(data, vocab_size=257, seed=0)
    assert isinstance(mix, Mixture) and mix.weights == [3.0, 1.0]
    with pytest.raises(DataError, match="vocab_size 257, larger than the model's vocab_size 100"):
        build_source(data, vocab_size=100)
    bad = [({"path": "x", "sources": [{"path": "y"}]}, "data.sources: is set together with "
            "data.path"),
           ({"source": "synthetic", "sources": [{"path": "y"}]}, "data.sources: is only read "
            "when data.source is `shards`"),
           ({"sources": [{"path": "y"}, {"path": "y", "weight": 2}]}, "names y more than once"),
           ({"sources": []}, "data.sources: is an empty list"),
           ({"sources": [{"path": "y", "weight": 0}]}, "greater than 0")]
    for section, match in bad:
        with pytest.raises(ConfigError, match=match):
            validate_job({"name": "m", "data": {"source": "shards", **section}})


def _train(rank: int, world_size: int, raw: dict) -> list[list[int]]:
    from optimus.train import train

    return train(validate_job(raw, world=world_size), keep_sample_ids=True,
                 quiet=rank != 0).sample_ids


def test_two_rank_training_on_a_mixture_resumes_on_one_rank(run_ranks, folders, tmp_path):
    from optimus.data.audit import audit_run

    sources = [{"path": str(f), "weight": w} for f, w in zip(folders, WEIGHTS, strict=True)]
    raw = {"name": "mix", "run_dir": str(tmp_path), "seed": 5,
           "model": {"vocab_size": 257, "dim": 32, "n_layers": 2, "n_heads": 2,
                     "max_seq_len": SEQ},
           "optim": {"steps": 4, "warmup_steps": 1},
           "data": {"source": "shards", "sources": sources, "seq_len": SEQ, "batch_size": 8},
           "parallel": {"device": "cpu"},
           "checkpoint": {"interval": 4, "async_mode": "sync"}}
    first = run_ranks(_train, 2, raw, timeout=120)  # steps 1-4 on dp=2, then saved
    raw["optim"]["steps"] = 8
    [resumed] = run_ranks(_train, 1, raw, timeout=120)  # steps 5-8 on dp=1
    data = _mixture(folders).windows(SEQ, 5)
    expect = [[data.sample_id(g) for g in range(8 * s, 8 * s + 8)] for s in range(8)]
    assert [a + b for a, b in zip(first[0], first[1], strict=True)] == expect[:4]
    assert resumed == expect[4:]
    result = audit_run(tmp_path)
    assert result.ok and (result.steps, result.end, result.generations) == (8, 64, 2)
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    mix = [e for e in events if e.get("event") == "mixture"]
    assert len(mix) == 2 and [s["quota"] for s in mix[1]["sources"]] == quotas(WEIGHTS)
    assert mix[1]["sources"][2]["epochs"] == pytest.approx(64 * 6554 / BLOCK / 12)


def test_config_check_names_the_mixture(tmp_path):
    from click.testing import CliRunner

    from optimus.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"name": "m", "data": {"source": "shards", "sources": [
        {"path": "/data/dclm", "weight": 3}, {"path": "/data/wiki", "weight": 1}]}}))
    out = CliRunner().invoke(main, ["config", "check", str(job), "--world", "2"])
    assert out.exit_code == 0, out.output
    assert "data: a mixture of 2 source(s): /data/dclm 75.0%, /data/wiki 25.0%" in out.output
