"""Data: tokenizers, token shards, a synthetic corpus, and the resumable sample loader.

The loader's names load on first use (optimus/lazy.py): it imports torch, and the `optimus`
command imports `DataError` from here. `prepare` is imported from its own module
(`optimus.data.prepare`, which loads numpy): a lazy name cannot share a submodule's name.
"""

from optimus.data.errors import DataError
from optimus.lazy import lazy_names

_WHERE = {
    "FeistelPermutation": "order", "MicrobatchSampler": "loader", "SampleOrder": "order",
    "WindowDataset": "loader", "build_loader": "loader", "build_source": "loader",
    "Mixture": "mixture", "TokenShards": "shards", "SyntheticCorpus": "synthetic",
    "ByteTokenizer": "tokenizer", "HFTokenizer": "tokenizer", "load_tokenizer": "tokenizer",
}
__all__ = ["DataError", *sorted(_WHERE)]
__getattr__ = lazy_names(__name__, _WHERE)
