"""Data preparation: `optimus data prepare` against the plain loop a user would write.

A corpus of `--files` gzip JSON-lines files (`--docs` documents of English-like text each) is
tokenized with a byte-level BPE tokenizer trained here on the same text (the `tokenizers`
library, as a real tokenizer.json would be). The reference reads the files one after another in
this process, tokenizes with `encode_batch` (the library's own Rust threads), appends the
end-of-document id and writes one flat uint16 file. Optimus writes its shards, per-input done
records and index, with 1 worker and with `--workers`. Both produce the same token stream
(checked), so the ratio is the cost (or gain) of Optimus's bookkeeping and its processes.

    .venv/bin/python bench/prepare.py [--files 8] [--docs 4000] [--workers 2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from optimus.data.prepare import prepare
from optimus.data.shards import TokenShards

# English-like text: frequent words and some of our own (a BPE then has merges to learn).
_TEXT = """the of and to in a is that for it as was with be by on not he this are or his from at
which but have an they you were her she there one all we their been has more training model
tokens layer pipeline checkpoint expert node"""
WORDS = _TEXT.split()


def corpus(folder: Path, files: int, docs: int, seed: int = 0) -> list[Path]:
    rng = random.Random(seed)
    paths = []
    for i in range(files):
        path = folder / f"part-{i:03d}.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            for _ in range(docs):
                words = [rng.choice(WORDS) for _ in range(rng.randint(50, 400))]
                f.write(json.dumps({"text": " ".join(words) + "."}) + "\n")
        paths.append(path)
    return paths


def tokenizer(folder: Path, sample: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"])
    with gzip.open(sample, "rt") as f:
        tok.train_from_iterator((json.loads(line)["text"] for line in f), trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def reference(files: list[Path], tok_path: Path, out: Path) -> int:
    """The plain loop: read, tokenize in batches, append eos, write one flat file."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id("<|endoftext|>")
    total = 0
    with open(out, "wb") as sink:
        for path in files:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                texts = [json.loads(line)["text"] for line in f]
            for start in range(0, len(texts), 1024):
                for enc in tok.encode_batch(texts[start:start + 1024], add_special_tokens=False):
                    ids = np.asarray([*enc.ids, eos], dtype=np.uint16)
                    ids.tofile(sink)
                    total += len(ids)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--docs", type=int, default=4000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "in").mkdir()
        files = corpus(tmp / "in", args.files, args.docs)
        tok = tokenizer(tmp, files[0])
        size = sum(p.stat().st_size for p in files)
        best: dict[str, float] = {}
        tokens = 0
        for _ in range(args.repeats):  # interleaved, best of each: the machine's drift hits all
            started = time.perf_counter()
            tokens = reference(files, tok, tmp / "reference.bin")
            best["reference"] = min(best.get("reference", 1e9), time.perf_counter() - started)
            for workers in sorted({1, args.workers}):
                out = tmp / f"optimus-{workers}"
                shutil.rmtree(out, ignore_errors=True)
                started = time.perf_counter()
                prepare(files, out, tokenizer=str(tok), workers=workers)
                name = f"optimus, {workers} worker(s)"
                best[name] = min(best.get(name, 1e9), time.perf_counter() - started)
        shards = TokenShards(tmp / f"optimus-{args.workers}")
        ref = np.fromfile(tmp / "reference.bin", dtype=np.uint16)
        same = shards.num_tokens == len(ref) and np.array_equal(
            shards.read(0, shards.num_tokens), ref)
        print(f"{args.files} files, {size / 2**20:.1f} MiB gzip, {tokens:,} tokens; "
              f"the same token stream as the reference: {same}")
        print(f"{'':28} {'seconds':>8} {'Mtokens/s':>10} {'vs reference':>13}")
        for name, seconds in best.items():
            print(f"{name:28} {seconds:8.2f} {tokens / seconds / 1e6:10.2f} "
                  f"{best['reference'] / seconds:12.2f}x")


if __name__ == "__main__":
    main()
