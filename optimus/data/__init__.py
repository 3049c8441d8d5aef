"""Data: tokenizers, token shards, a synthetic corpus, and the resumable sample loader.

The names load on first use (PEP 562): `optimus.data.errors` is imported by the `optimus`
command itself, whose operator subcommands should not pay for torch.
"""

import importlib

from optimus.data.errors import DataError

_WHERE = {
    "FeistelPermutation": "loader", "MicrobatchSampler": "loader", "SampleOrder": "loader",
    "WindowDataset": "loader", "build_loader": "loader", "build_source": "loader",
    "prepare": "prepare", "TokenShards": "shards", "SyntheticCorpus": "synthetic",
    "ByteTokenizer": "tokenizer", "HFTokenizer": "tokenizer", "load_tokenizer": "tokenizer",
}

__all__ = ["DataError", *sorted(_WHERE)]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'optimus.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"optimus.data.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
