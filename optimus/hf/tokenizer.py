"""The tokenizer files of an exported model, from the data the run trained on.

The manifest's job config names the data: `data.path`, or the folders of a `data.sources`
mixture. They are found where training found them (`training_folder`) and opened as training
opened them (`build_source`, which also checks that a mixture's sources share one tokenizer and
fit the model's vocabulary). Prepared shards name the tokenizer they were made with (their
`index.json`):
- a `tokenizer.json`: copied as it is, with a `tokenizer_config.json` naming its eos token;
- the built-in byte tokenizer: an equivalent `tokenizer.json` is written (byte-level BPE with
  no merges: each UTF-8 byte b is the token b, and `<|endoftext|>` is id 256), which encodes and
  decodes every text as `ByteTokenizer` does — except that a text containing the literal string
  `<|endoftext|>` gets the end-of-document id for it, as with any tokenizer's special tokens;
- synthetic data: there is no tokenizer (the ids are the data); a note says so.
Data or a tokenizer.json that is no longer there fails the export with where it was looked for:
a model folder without its tokenizer and end-of-document id is not one to hand on. Only a
missing `tokenizers` package is a note (the weights and the eos id still export).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from optimus.checkpoint.manifest import CheckpointError
from optimus.config import JobConfig
from optimus.data.errors import DataError
from optimus.data.loader import build_source
from optimus.data.prepare import INDEX_NAME
from optimus.data.shards import TokenShards
from optimus.data.tokenizer import HFTokenizer

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


def tokenizer_files(manifest: dict, cfg, step_path: Path,
                    out: Path) -> tuple[int | None, list[str]]:
    """Write the tokenizer files of checkpoint `step_path` into `out`; returns (eos id or
    None, notes for the user). Raises CheckpointError when the data's tokenizer is gone."""
    config = manifest.get("config", {})
    if config.get("data", {}).get("source") != "shards":
        return cfg.vocab_size - 1, [
            "no tokenizer: the run trained on synthetic tokens (data.source: synthetic); the "
            f"end-of-document id is {cfg.vocab_size - 1}"]
    shards, base = trained_on(config, cfg.vocab_size, step_path, manifest.get("workdir"))
    eos_id = shards[0].eos_id
    try:
        import tokenizers  # noqa: F401  (writing and reading a tokenizer.json need it)
    except ImportError:
        return eos_id, ["no tokenizer files: the 'tokenizers' package is not installed; "
                        "pip install 'optimus[hf]'"]
    if shards[0].tokenizer == "byte":
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        eos = BYTE_EOS
    else:
        path, eos = _find_tokenizer(shards, base)
        shutil.copyfile(path, out / "tokenizer.json")
    _write(out / "tokenizer_config.json", _tokenizer_config(eos, cfg.max_seq_len))
    return eos_id, []


def trained_on(config: dict, vocab_size: int, step_path: Path,
               workdir: str | None = None) -> tuple[list[TokenShards], Path | None]:
    """The prepared folders a run trained on, opened as training opened them; and the folder
    training ran in (None: unknown, relative paths are read from this process's)."""
    data, base = config.get("data", {}), training_folder(config, step_path, workdir)
    given = [("data.path", data["path"], None)] if data.get("path") else [
        (f"data.sources[{i}].path", s.get("path"), s.get("weight"))
        for i, s in enumerate(data.get("sources") or [])]
    if not given:
        raise CheckpointError(f"{step_path}/optimus.json names no data.path or data.sources "
                              "for its shards: export it with the optimus version that wrote it")
    found = []
    for key, path, weight in given:
        here = Path(path) if base is None else base / path  # an absolute path stays itself
        if not (here / INDEX_NAME).is_file():
            raise CheckpointError(_gone(key, path, here, base))
        found.append({"path": str(here), "weight": weight})
    try:
        if data.get("path"):
            source = build_source("shards", path=found[0]["path"], vocab_size=vocab_size)
        else:
            source = build_source("shards", sources=found, vocab_size=vocab_size)
    except DataError as e:
        raise CheckpointError(f"the data {step_path} was trained on cannot give its tokenizer: "
                              f"{e}") from None
    return getattr(source, "sources", [source]), base


def training_folder(config: dict, step_path: Path, workdir: str | None = None) -> Path | None:
    """The folder training ran in, where the job's relative paths start; None when the
    checkpoint cannot tell. Training wrote this checkpoint into its `checkpoint.dir`, read
    from that same folder: when the dir is relative, stripping it from the checkpoint's place
    gives the folder (also when the whole run folder was moved since). Otherwise the folder
    the manifest recorded (`workdir`), while it still exists."""
    recorded = Path(workdir) if isinstance(workdir, str) and Path(workdir).is_absolute() \
        and Path(workdir).is_dir() else None
    try:
        root = Path(os.path.normpath(JobConfig.model_validate(config).resolved_checkpoint_dir))
    except (ValueError, KeyError, IndexError):  # an older config; a `{...}` it cannot fill
        return recorded
    parts = () if str(root) == "." else root.parts
    if root.is_absolute() or ".." in parts:
        return recorded
    for here in (Path(os.path.abspath(step_path.parent)), step_path.parent.resolve()):
        if len(parts) < len(here.parts) and here.parts[len(here.parts) - len(parts):] == parts:
            return Path(*here.parts[:len(here.parts) - len(parts)])
    return recorded


def _gone(key: str, given: str, here: Path, base: Path | None) -> str:
    what = (f"{key} is {given}: {here} holds no prepared data ({INDEX_NAME} missing) any more, "
            "and the export takes the tokenizer and end-of-document id from it")
    if Path(given).is_absolute():
        return f"{what}; put the prepared folder back at {here} and export again"
    if base is not None:
        return (f"{what} (read from {base}, as training read it: the folder it ran in); put "
                f"the prepared folder back at {here} and export again")
    return (f"{what} (a relative path, read from this command's folder: the checkpoint is not "
            "under the relative checkpoint.dir training wrote it to, so the folder training "
            "ran in is unknown); run the export from the folder training ran in")


def _find_tokenizer(shards: list[TokenShards], base: Path | None) -> tuple[Path, str]:
    """The tokenizer.json the data was prepared with, and the name of its eos token.

    `optimus data prepare` records the tokenizer path it was given, relative to a folder it
    does not record: a relative one is looked for from the folder training ran in, then from
    this command's, and taken only if it is the file the data was made with (the fingerprint
    prepare recorded; for older data, the same eos id)."""
    tried: list[Path] = []
    for src in shards:
        spec = Path(src.tokenizer)
        if not src.tokenizer.endswith(".json"):
            spec = spec / "tokenizer.json"
        for path in ([base / spec] if base is not None else []) + [spec.absolute()]:
            if path in tried:
                continue
            tried.append(path)
            try:
                tok = HFTokenizer(path) if path.is_file() else None
            except DataError:  # not a tokenizer.json: not the one either
                continue
            if tok is None or tok.eos_id != src.eos_id:
                continue
            if src.index.get("tokenizer_fingerprint", tok.fingerprint) == tok.fingerprint:
                return path, tok.eos_token
    raise CheckpointError(
        f"the data was prepared with tokenizer {shards[0].tokenizer}, and that tokenizer.json "
        f"is not there any more (looked for {', '.join(map(str, tried))}, and took none that "
        "differs from the file the data was made with): copy the tokenizer.json the data was "
        f"prepared with to {tried[0]} and export again")
