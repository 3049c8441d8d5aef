"""Weighted mixtures of prepared sources, in an order that is a pure function of (seed, index).

Global sample indices are cut into blocks of BLOCK. In every block source s owns a fixed quota
q_s of the slots, proportional to its weight (largest remainder: the quotas add up to BLOCK
exactly). Which slots are whose is shuffled per block by a keyed permutation of the block's
positions onto the quota ranges [c_s, c_s + q_s), where c_s = q_0 + ... + q_{s-1}:

    g = b * BLOCK + p  ->  i = perm_(seed, b)(p),  s: c_s <= i < c_s + q_s,
                           n = b * q_s + (i - c_s)  (the n-th sample drawn from source s)

and source s's n-th sample is its own window order (epochs of a keyed Feistel permutation,
keyed by seed and s), so each source wraps into a new epoch on its own schedule: a small source
with a large weight is read several times over while a large one is still in its first pass.
Every step of this is O(1) in time and memory, so the order holds at any dp degree and any
resume point exactly as a single source's does. A sample's id is its window number offset by
the windows of the sources before it: ids stay unique per (source, window), as the audit needs.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from optimus.data.errors import DataError
from optimus.data.order import SampleOrder, _mix64, block_permutation
from optimus.data.shards import TokenShards

BLOCK = 1 << 16  # slots per block: weights resolve to 1 / 65536
_SOURCE_SALT = 0x50_C0DE_5EED


def quotas(weights: list[float], block: int = BLOCK) -> list[int]:
    """Integer slots per block for each weight, summing to `block` (largest remainder).

    In exact rationals: float sums differ between interpreters (Python 3.12's `sum` of floats
    compensates, 3.11's does not), and one ulp of the total moves a slot between sources."""
    total = sum(Fraction(w) for w in weights)
    exact = [Fraction(w) * block / total for w in weights]
    out = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda s: (out[s] - exact[s], s))
    for s in by_remainder[: block - sum(out)]:
        out[s] += 1
    return out


class Mixture:
    """Prepared folders with weights: what `build_source` gives for `data.sources`."""

    def __init__(self, sources: list[TokenShards], weights: list[float]):
        if not sources or len(sources) != len(weights):
            raise DataError("a mixture needs at least one source, each with a weight")
        self.sources, self.weights = sources, [float(w) for w in weights]
        first = sources[0]
        for other in sources[1:]:
            if _tokenizer(other) != _tokenizer(first):
                raise DataError(
                    f"data.sources: {first.path} was prepared with tokenizer "
                    f"{first.tokenizer!r} (vocab_size {first.vocab_size}, eos {first.eos_id}) "
                    f"but {other.path} with {other.tokenizer!r} (vocab_size "
                    f"{other.vocab_size}, eos {other.eos_id}); prepare every source with the "
                    "same tokenizer")
        self.vocab_size, self.eos_id = first.vocab_size, first.eos_id
        self.quotas = quotas(self.weights)
        for src, w, q in zip(sources, self.weights, self.quotas, strict=True):
            if q == 0:
                raise DataError(
                    f"data.sources: {src.path} has weight {w:g}, under 1/{BLOCK} of the total "
                    f"{sum(self.weights):g}, so it would never be read; raise its weight to at "
                    f"least {sum(self.weights) / BLOCK:.3g} or drop it")

    def key(self) -> list[list]:
        """What a saved data state must match: the sources and their weights, in order."""
        return [[str(src.path), w] for src, w in zip(self.sources, self.weights, strict=True)]

    def windows(self, seq_len: int, seed: int) -> MixtureDataset:
        return MixtureDataset(self, seq_len, seed)


def _tokenizer(src: TokenShards) -> tuple:
    # Folders prepared before fingerprints existed are told apart by the tokenizer they name.
    return (src.index.get("tokenizer_fingerprint", src.tokenizer), src.vocab_size, src.eos_id)


class MixtureDataset(Dataset):
    """Map-style dataset: item g is a window of the source the mixture's order gives g."""

    def __init__(self, mixture: Mixture, seq_len: int, seed: int):
        self.mixture, self.seq_len, self.seed = mixture, seq_len, seed
        self.counts = [(src.num_tokens - 1) // seq_len for src in mixture.sources]
        for src, n in zip(mixture.sources, self.counts, strict=True):
            if n < 1:
                raise DataError(
                    f"data.sources: {src.path} holds {src.num_tokens} tokens, fewer than one "
                    f"sample of seq_len + 1 = {seq_len + 1}; add data or drop the source")
        self.offsets = np.cumsum([0, *self.counts]).tolist()
        self.num_samples = self.offsets[-1]
        self.starts = np.cumsum([0, *mixture.quotas]).tolist()
        self.orders = [SampleOrder(n, _mix64(seed ^ _mix64(_SOURCE_SALT + s)))
                       for s, n in enumerate(self.counts)]
        self.data_key = {"mixture": mixture.key(), "block": BLOCK}
        self._block, self._perm = -1, None

    def locate(self, g: int) -> tuple[int, int]:
        """(source, n): global index g takes the n-th sample drawn from that source."""
        if g < 0:
            raise IndexError(f"global sample index must be >= 0, got {g}")
        b, p = divmod(g, BLOCK)
        if b != self._block:
            self._block, self._perm = b, block_permutation(self.seed, b, BLOCK)
        i = self._perm(p)
        s = bisect.bisect_right(self.starts, i) - 1
        return s, b * self.mixture.quotas[s] + i - self.starts[s]

    def sample_id(self, g: int) -> int:
        s, n = self.locate(g)
        return self.offsets[s] + self.orders[s].sample_id(n)

    def source_of(self, sample_id: int) -> int:
        return bisect.bisect_right(self.offsets, sample_id) - 1

    def __getitem__(self, g: int) -> dict[str, torch.Tensor]:
        s, n = self.locate(g)
        j = self.orders[s].sample_id(n)
        src = self.mixture.sources[s]
        tokens = torch.from_numpy(src.read(j * self.seq_len, self.seq_len + 1))
        return {
            "input_ids": tokens[:-1],
            "labels": tokens[1:],
            "sample_ids": torch.tensor(self.offsets[s] + j, dtype=torch.long),
            "index": torch.tensor(g, dtype=torch.long),
        }

    def report(self, samples: int) -> tuple[str, dict]:
        """A start-up event: each source's realised share, and how many passes over it
        `samples` samples (the whole run) make."""
        rows = []
        for src, w, q, n in zip(self.mixture.sources, self.mixture.weights,
                                self.mixture.quotas, self.counts, strict=True):
            rows.append({"path": str(src.path), "weight": w, "share": q / BLOCK, "quota": q,
                         "samples": n, "tokens": src.num_tokens,
                         "epochs": samples * q / BLOCK / n})
        parts = [f"{Path(r['path']).name} {r['share']:.4f} ({r['epochs']:.2f} epochs)"
                 for r in rows]
        message = (f"mixture of {len(rows)} sources, share of samples (passes over each in "
                   f"{samples:,} samples): " + ", ".join(parts))
        return message, {"sources": rows, "block": BLOCK}
