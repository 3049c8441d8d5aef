"""The tokenizer files of an exported model, from what the run trained on.

The manifest's job config names the data; prepared shards name the tokenizer they were made
with (their `index.json`):
- a `tokenizer.json`: copied as it is, with a `tokenizer_config.json` naming its eos token;
- the built-in byte tokenizer: an equivalent `tokenizer.json` is written (byte-level BPE with
  no merges: each UTF-8 byte b is the token b, and `<|endoftext|>` is id 256), which encodes and
  decodes every text as `ByteTokenizer` does — except that a text containing the literal string
  `<|endoftext|>` gets the end-of-document id for it, as with any tokenizer's special tokens;
- synthetic data: there is no tokenizer (the ids are the data); a note says so.
Whatever cannot be written is a note the CLI prints, never a failed export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

BYTE_EOS = "<|endoftext|>"


def _byte_chars() -> list[str]:
    """The printable character byte-level BPE stands each byte for (GPT-2's convention):
    printable Latin-1 bytes are themselves, the others take code points from 256 on, in
    order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_tokenizer_json() -> str:
    """A `tokenizer.json` equal to Optimus's ByteTokenizer (needs the `tokenizers` package)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOS, special=True)])
    return tok.to_str(pretty=True)


def _tokenizer_config(eos: str, max_len: int) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
            "model_max_length": max_len, "clean_up_tokenization_spaces": False}


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def tokenizer_files(manifest: dict, cfg, out: Path) -> tuple[int | None, list[str]]:
    """Write the tokenizer files into `out`; returns (eos id or None, notes for the user)."""
    data = manifest.get("config", {}).get("data", {})
    if data.get("source") != "shards":
        return cfg.vocab_size - 1, [
            "no tokenizer: the run trained on synthetic tokens (data.source: synthetic); the "
            f"end-of-document id is {cfg.vocab_size - 1}"]
    index_path = Path(str(data.get("path"))) / "index.json"
    try:
        index = json.loads(index_path.read_text())
        spec, eos_id = str(index["tokenizer"]), int(index["eos_id"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, [f"no tokenizer files: cannot read the data's {index_path} ({e}); copy "
                      "the tokenizer.json the data was prepared with next to the model"]
    try:
        if spec == "byte":
            (out / "tokenizer.json").write_text(byte_tokenizer_json())
            eos = BYTE_EOS
        else:
            eos = _copy_tokenizer(spec, eos_id, out)
    except ImportError:
        return eos_id, ["no tokenizer files: the 'tokenizers' package is not installed; "
                        "pip install 'optimus[hf]'"]
    except (OSError, ValueError) as e:
        return eos_id, [f"no tokenizer files: {e}"]
    _write(out / "tokenizer_config.json", _tokenizer_config(eos, cfg.max_seq_len))
    return eos_id, []


def _copy_tokenizer(spec: str, eos_id: int, out: Path) -> str:
    """Copy the data's tokenizer.json; the name of its eos token."""
    from tokenizers import Tokenizer

    path = Path(spec)
    if not spec.endswith(".json"):
        path = path / "tokenizer.json"
    if not path.is_file():
        raise OSError(f"the data was prepared with tokenizer {spec}, and {path} is not there "
                      "any more; copy it next to the model as tokenizer.json")
    eos = Tokenizer.from_file(str(path)).id_to_token(eos_id)
    if eos is None:
        raise ValueError(f"{path} has no token {eos_id}, the data's end-of-document id")
    shutil.copyfile(path, out / "tokenizer.json")
    return eos
