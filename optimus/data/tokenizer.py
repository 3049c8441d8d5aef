"""Tokenizers: a built-in byte-level one and a wrapper for HF `tokenizer.json` files."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from optimus.data.errors import DataError

# End-of-document tokens we recognise in a tokenizer.json, in order of preference.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    fingerprint: str  # equal for tokenizers that map text to the same ids

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[Sequence[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; id 256 ends a document."""

    vocab_size = 257
    eos_id = 256
    fingerprint = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[Sequence[int]]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i != self.eos_id).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer loaded from a tokenizer.json file."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as e:
            raise DataError(
                "the 'tokenizers' package is not installed; run: pip install 'optimus[tokenizers]'"
            ) from e
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(f"tokenizer file {self.path} does not exist")
        try:
            self._tok = _HF.from_file(str(self.path))
        except Exception as e:
            raise DataError(f"cannot read tokenizer {self.path}: {e}") from e
        self.fingerprint = "sha256:" + hashlib.sha256(self.path.read_bytes()).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        for name in EOS_CANDIDATES:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                self.eos_id = tid
                self.eos_token = name
                break
        else:
            raise DataError(
                f"tokenizer {self.path} has no end-of-document token; "
                f"add one of {', '.join(EOS_CANDIDATES)} to its vocabulary"
            )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[Sequence[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """ "byte" for the built-in tokenizer, or a path to a tokenizer.json (or its folder)."""
    spec = str(spec)
    if spec == "byte":
        return ByteTokenizer()
    if spec.endswith(".json"):
        return HFTokenizer(spec)
    if (Path(spec) / "tokenizer.json").is_file():
        return HFTokenizer(Path(spec) / "tokenizer.json")
    raise DataError(f"unknown tokenizer {spec!r}: use 'byte' or the path to a tokenizer.json file")
