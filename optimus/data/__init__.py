"""Data: tokenizers, token shards, a synthetic corpus, and the resumable sample loader."""

from optimus.data.errors import DataError
from optimus.data.loader import (
    FeistelPermutation,
    MicrobatchSampler,
    SampleOrder,
    WindowDataset,
    build_loader,
    build_source,
)
from optimus.data.prepare import prepare
from optimus.data.shards import TokenShards
from optimus.data.synthetic import SyntheticCorpus
from optimus.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataError",
    "FeistelPermutation",
    "HFTokenizer",
    "MicrobatchSampler",
    "SampleOrder",
    "SyntheticCorpus",
    "TokenShards",
    "WindowDataset",
    "build_loader",
    "build_source",
    "load_tokenizer",
    "prepare",
]
