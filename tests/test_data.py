"""Data subsystem: tokenizers, prepare/shards, synthetic corpus, sample order and loader."""

import hashlib
import json
import pickle

import numpy as np
import pytest
import torch

from optimus.data import (
    ByteTokenizer,
    DataError,
    FeistelPermutation,
    HFTokenizer,
    SampleOrder,
    SyntheticCorpus,
    TokenShards,
    build_loader,
    build_source,
    load_tokenizer,
)
from optimus.data.prepare import prepare

EOS = 256


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo ✓\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.decode(ids + [tok.eos_id]) == text
    assert tok.decode([0xFF]) == "\ufffd"
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def _hf_tokenizer(path, words, specials=("<unk>", "</s>")):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {w: i for i, w in enumerate([*specials, *words])}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    if "</s>" in specials:
        tok.add_special_tokens(["</s>"])
    tok.save(str(path))
    return vocab


def test_hf_tokenizer_round_trip(tmp_path):
    path = tmp_path / "tokenizer.json"
    vocab = _hf_tokenizer(path, ["hello", "world", "the", "fox"])
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 6
    assert tok.eos_id == vocab["</s>"] == 1
    ids = tok.encode("hello the world")
    assert ids == [vocab["hello"], vocab["the"], vocab["world"]]
    assert tok.decode(ids + [tok.eos_id]) == "hello the world"
    assert isinstance(load_tokenizer(str(tmp_path)), HFTokenizer)  # folder holding one


def test_hf_tokenizer_refusals(tmp_path):
    path = tmp_path / "noeos.json"
    _hf_tokenizer(path, ["a", "b"], specials=("<unk>",))
    with pytest.raises(DataError, match="no end-of-document token"):
        HFTokenizer(path)
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(DataError, match="unknown tokenizer 'gpt2'"):
        load_tokenizer("gpt2")


# ---------------------------------------------------------------- prepare / shards


@pytest.fixture
def corpus_files(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("first document ✓")
    b = tmp_path / "b.jsonl"
    rows = [{"text": "second"}, {"text": "third one", "id": 3}]
    b.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    texts = ["first document ✓", "second", "third one"]
    expected = [t for s in texts for t in [*s.encode("utf-8"), EOS]]
    return [a, b], expected


def test_prepare_writes_index_and_shards(tmp_path, corpus_files):
    inputs, expected = corpus_files
    out = tmp_path / "out"
    index = prepare(inputs, out, shard_tokens=10)
    assert index == json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["vocab_size"] == 257
    assert index["eos_id"] == EOS and index["tokenizer"] == "byte"
    assert index["total_tokens"] == len(expected) == 36 and index["num_documents"] == 3
    # each input file starts its own shards: a.txt holds 19 tokens, b.jsonl 17
    assert [s["num_tokens"] for s in index["shards"]] == [10, 9, 10, 7]
    data = []
    for s in index["shards"]:
        raw = (out / s["file"]).read_bytes()
        assert hashlib.sha256(raw).hexdigest() == s["sha256"]
        data += np.frombuffer(raw, dtype="<u2").tolist()
    assert data == expected
    assert sorted(p.name for p in out.iterdir()) == [
        ".prepare.lock",
        "done",
        "index.json",
        "prepare.json",
        "shard_00000_0000.bin",
        "shard_00000_0001.bin",
        "shard_00001_0000.bin",
        "shard_00001_0001.bin",
    ]

    shards = TokenShards(out)
    assert (shards.num_tokens, shards.vocab_size, shards.eos_id) == (36, 257, EOS)
    for start, length in [(0, 36), (7, 15), (10, 10), (35, 1), (5, 0)]:
        got = shards.read(start, length)
        assert got.dtype == np.int64 and got.tolist() == expected[start : start + length]
    with pytest.raises(IndexError):
        shards.read(30, 10)
    shards.verify()
    clone = pickle.loads(pickle.dumps(shards))  # what a spawned worker would get
    assert clone._maps is None and clone.read(8, 4).tolist() == expected[8:12]


def test_prepare_forced_uint32(tmp_path, corpus_files):
    inputs, expected = corpus_files
    index = prepare(inputs, tmp_path / "out", dtype="uint32")
    assert index["dtype"] == "uint32" and len(index["shards"]) == 2  # one per input file
    raw = b"".join((tmp_path / "out" / s["file"]).read_bytes() for s in index["shards"])
    assert len(raw) == 4 * len(expected)
    assert np.frombuffer(raw, dtype="<u4").tolist() == expected
    assert TokenShards(tmp_path / "out").read(0, len(expected)).tolist() == expected


def test_prepare_large_vocab_needs_uint32(tmp_path):
    path = tmp_path / "big.json"
    vocab = _hf_tokenizer(path, [f"w{i}" for i in range(70_000)])
    doc = tmp_path / "d.txt"
    doc.write_text("w5 w69999")
    with pytest.raises(DataError, match="uint16 cannot hold the 70002 token ids"):
        prepare([doc], tmp_path / "o16", tokenizer=str(path), dtype="uint16")
    index = prepare([doc], tmp_path / "o32", tokenizer=str(path))
    assert index["dtype"] == "uint32" and index["vocab_size"] == 70_002
    got = TokenShards(tmp_path / "o32").read(0, 3).tolist()
    assert got == [vocab["w5"], vocab["w69999"], vocab["</s>"]]


def test_prepare_refusals(tmp_path, corpus_files):
    inputs, _ = corpus_files
    out = tmp_path / "out"
    with pytest.raises(DataError, match="nope.txt does not exist"):
        prepare([tmp_path / "nope.txt"], out)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match=r"x\.csv has extension '\.csv'"):
        prepare([tmp_path / "x.csv"], out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON"):
        prepare([bad], out)
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"nokey\.jsonl:3: no 'text' field"):
        prepare([nokey], out)
    body = tmp_path / "body.jsonl"
    body.write_text('{"body": "xy"}\n')
    assert prepare([body], out, text_key="body")["total_tokens"] == 3
    with pytest.raises(DataError, match="already holds prepared data"):
        prepare(inputs, out)
    with pytest.raises(DataError, match="unknown dtype"):
        prepare(inputs, tmp_path / "o2", dtype="int8")


def test_a_failed_prepare_leaves_no_index_and_overwrite_replaces_it(tmp_path, corpus_files):
    inputs, expected = corpus_files
    out = tmp_path / "out"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "' + "x" * 50 + '"}\n{"oops": 1}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        prepare([*inputs, bad], out, shard_tokens=10)
    assert not (out / "index.json").exists()  # no usable data, and no temp files left
    assert not list(out.glob("*.tmp")) and not list(out.glob("shard_00002*"))
    bad.write_text('{"text": "fixed"}\n')  # fixed in place: the run continues
    index = prepare([*inputs, bad], out, shard_tokens=10)
    assert TokenShards(out).read(0, 42).tolist() == [*expected, *b"fixed", EOS]
    assert index["num_documents"] == 4

    index = prepare(inputs[:1], out, shard_tokens=100, overwrite=True)
    assert index["total_tokens"] == 19 and len(index["shards"]) == 1
    assert sorted(p.name for p in out.glob("shard_*")) == ["shard_00000_0000.bin"]


def test_truncated_or_missing_shard_is_named(tmp_path, corpus_files):
    inputs, _ = corpus_files
    out = tmp_path / "out"
    prepare(inputs, out, shard_tokens=10)
    shard = out / "shard_00001_0000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"shard_00001_0000\.bin is truncated: 18 bytes, index "
                       "says 20"):
        TokenShards(out)
    shard.unlink()
    with pytest.raises(DataError, match=r"shard_00001_0000\.bin .* is missing"):
        TokenShards(out)
    with pytest.raises(DataError, match="index.json missing"):
        TokenShards(tmp_path)


def test_build_source(tmp_path, corpus_files):
    inputs, _ = corpus_files
    prepare(inputs, tmp_path / "out")
    assert build_source("shards", path=tmp_path / "out", vocab_size=300).num_tokens == 36
    with pytest.raises(DataError, match="vocab_size 257, larger than the model's vocab_size 100"):
        build_source("shards", path=tmp_path / "out", vocab_size=100)
    src = build_source("synthetic", vocab_size=257, seed=3)
    assert isinstance(src, SyntheticCorpus) and src.seed == 3
    with pytest.raises(DataError, match="unknown data kind 'web'"):
        build_source("web", vocab_size=257, seed=0)


# ---------------------------------------------------------------- synthetic corpus


def test_synthetic_corpus_deterministic_and_in_range():
    a, b = SyntheticCorpus(257, seed=1), SyntheticCorpus(257, seed=1)
    whole = a.read(0, 1000)
    assert np.array_equal(whole, b.read(0, 1000))
    assert np.array_equal(a.read(250, 20), whole[250:270])  # random access across documents
    assert np.array_equal(SyntheticCorpus(257, 1).read(700, 300), whole[700:])
    assert not np.array_equal(whole, SyntheticCorpus(257, seed=2).read(0, 1000))
    assert whole.dtype == np.int64 and whole.min() >= 0 and whole.max() == 256
    assert (whole[255::256] == 256).all() and np.count_nonzero(whole == 256) == 3
    assert len(np.unique(whole)) <= 17  # low entropy: a small alphabet plus eos
    far = a.read(2**40 - 10, 10)
    assert far[-1] == 256 and np.array_equal(far, b.read(2**40 - 10, 10))
    small = SyntheticCorpus(5, seed=0).read(0, 600)
    assert small.min() >= 0 and small.max() == 4
    with pytest.raises(IndexError):
        a.read(2**40 - 5, 10)


# ---------------------------------------------------------------- sample order


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_permutation_is_bijection(n):
    p = FeistelPermutation(n, key=12345)
    assert sorted(p(i) for i in range(n)) == list(range(n))


def test_order_differs_across_seeds_and_epochs():
    n = 1000
    a, b = SampleOrder(n, seed=0), SampleOrder(n, seed=1)
    epoch0 = [a.sample_id(g) for g in range(n)]
    epoch1 = [a.sample_id(g) for g in range(n, 2 * n)]
    assert sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1 and epoch0 != list(range(n))
    assert epoch0 != [b.sample_id(g) for g in range(n)]
    assert epoch0 == [SampleOrder(n, seed=0).sample_id(g) for g in range(n)]
    huge = SampleOrder(2**34, seed=0)  # O(1) memory: no table of 2**34 entries
    ids = [huge.sample_id(g) for g in range(5000)]
    assert len(set(ids)) == 5000 and min(ids) >= 0 and max(ids) < 2**34


# ---------------------------------------------------------------- loader

SEQ = 8


def _source():
    return SyntheticCorpus(257, seed=0, num_tokens=SEQ * 50 + 1)  # 50 samples: epochs wrap


def _loader(dp_rank=0, dp_size=1, seed=0, batch_size=8, microbatches=2, **kw):
    return build_loader(
        _source(),
        seq_len=SEQ,
        batch_size=batch_size,
        microbatches=microbatches,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        **kw,
    )


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _ids(batches):
    return [b["sample_ids"].tolist() for b in batches]


def _steps(dp_size, n_steps, start_index=0, microbatches=2):
    """Sample ids per step over all ranks: global microbatch by global microbatch, each in rank
    order."""
    per_rank = [_ids(_take(_loader(r, dp_size, start_index=start_index,
                                   microbatches=microbatches), n_steps * microbatches))
                 for r in range(dp_size)]
    steps = [[] for _ in range(n_steps)]
    for i in range(n_steps * microbatches):
        for r in range(dp_size):
            steps[i // microbatches] += per_rank[r][i]
    return steps


def test_batch_contents_and_determinism():
    batches = _take(_loader(), 4)
    src = _source()
    b = batches[1]
    assert b["input_ids"].shape == b["labels"].shape == (4, SEQ)
    assert b["input_ids"].dtype == torch.long and b["index"].tolist() == [4, 5, 6, 7]
    for row, j in enumerate(b["sample_ids"].tolist()):
        window = src.read(j * SEQ, SEQ + 1)
        assert b["input_ids"][row].tolist() == window[:-1].tolist()
        assert b["labels"][row].tolist() == window[1:].tolist()
    assert _ids(batches) == _ids(_take(_loader(), 4))
    assert _ids(batches) != _ids(_take(_loader(seed=1), 4))
    first_epoch = sum(_ids(_take(_loader(batch_size=10, microbatches=1), 5)), [])
    assert sorted(first_epoch) == list(range(50))  # every sample once per epoch


def test_dp_degrees_cover_the_same_samples_in_the_same_global_microbatches():
    ref = _steps(1, 8)  # 64 samples: crosses into the second epoch
    assert _steps(2, 8) == ref and _steps(4, 8) == ref
    assert _steps(4, 8, microbatches=1) == ref
    # Rank 1 of 2, batch 8 in 2 microbatches: the second half of each global microbatch
    # (indices 0-3, then 4-7), so global microbatch j is the same 4 samples at any dp.
    ranks = _take(_loader(1, 2), 2)
    assert [b["index"].tolist() for b in ranks] == [[2, 3], [6, 7]]


def test_resume_from_start_index():
    ref = _steps(1, 10)
    assert _steps(1, 6, start_index=4 * 8) == ref[4:]
    assert _steps(4, 6, start_index=4 * 8) == ref[4:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_from_state_dict(num_workers):
    ref = _ids(_take(_loader(), 12))
    first = _loader(num_workers=num_workers)
    it = iter(first)
    head = [next(it) for _ in range(5)]  # stops mid-step: same layout resumes
    state = first.state_dict()
    resumed = _loader(num_workers=num_workers)
    resumed.load_state_dict(state)
    assert _ids(head) + _ids(_take(resumed, 7)) == ref


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_from_state_dict_at_other_dp(num_workers):
    ref = _steps(1, 7)
    states, before = [], [[] for _ in range(3)]
    for r in range(2):
        loader = _loader(r, 2, num_workers=num_workers)
        it = iter(loader)
        for s in range(3):
            before[s] += sum(_ids([next(it), next(it)]), [])
        states.append(loader.state_dict())
    same = [sorted(step) for step in ref]  # each step's samples (order: global microbatches)
    assert [sorted(step) for step in before] == same[:3]
    after = [[] for _ in range(4)]
    for r in range(4):
        loader = _loader(r, 4, num_workers=num_workers)
        loader.load_state_dict(states[0])  # every rank's state is the same integer
        for s, pair in enumerate(zip(*[iter(_take(loader, 8))] * 2, strict=True)):
            after[s] += sum(_ids(pair), [])
    assert [sorted(step) for step in after] == same[3:]


def test_sampler_state_and_refusals():
    loader = _loader(0, 2)
    _take(loader, 3)  # mid-step
    state = loader.state_dict()["_index_sampler_state"]
    assert state["next_index"] == 8 and state["microbatch"] == 1
    other = _loader(0, 4)
    other.load_state_dict(loader.state_dict())
    with pytest.raises(DataError, match="mid-step"):
        next(iter(other))
    reseeded = _loader(0, 2, seed=9)
    reseeded.load_state_dict(loader.state_dict())
    with pytest.raises(DataError, match="seed=0 but this run has seed=9"):
        next(iter(reseeded))
    with pytest.raises(DataError, match="multiple of microbatches x dp_size = 2 x 4"):
        _loader(0, 4, batch_size=12)
    with pytest.raises(DataError, match="dp_rank must be in"):
        _loader(2, 2)
    with pytest.raises(DataError, match="fewer than one sample"):
        build_loader(
            SyntheticCorpus(257, 0, num_tokens=SEQ),
            seq_len=SEQ,
            batch_size=1,
            microbatches=1,
            dp_rank=0,
            dp_size=1,
            seed=0,
        )
