"""Export a committed checkpoint as a Hugging Face model folder, one tensor at a time.

`export_hf(step_dir, out)` writes `config.json`, `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`, `generation_config.json` and the tokenizer files
(`tokenizer.py`), from a checkpoint saved on any layout: DCP reassembles each tensor from
whatever shards hold it.

It never holds the model: each Optimus tensor is read alone (a DCP load of a one-key state dict,
no process group), converted (`tensors.py`) and written, then dropped. The safetensors files
are therefore written here rather than by `safetensors.torch.save_file`, which takes every
tensor of a file at once: the format is an 8-byte header length, a JSON header (dtype, shape
and byte range of every tensor) and the bare little-endian bytes, so the header is made from
the checkpoint's metadata first and the bytes follow tensor by tensor. No timestamps anywhere:
the same checkpoint always exports to the same bytes.

The folder appears whole or not at all: it is written under a temporary name beside `out` and
renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from optimus.checkpoint.manifest import CheckpointError, verify
from optimus.checkpoint.safe_pickle import refusal
from optimus.checkpoint.storage import TensorFileReader
from optimus.checkpoint.trust import Trust, key_file_for
from optimus.config import ModelConfig
from optimus.files import fsync_path
from optimus.hf.families import Family, choose_family, hf_config
from optimus.hf.tensors import Piece, hf_shapes, pieces, to_hf
from optimus.hf.tokenizer import tokenizer_files

INDEX = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16"}
_MODEL = "model."  # the model's keys in a checkpoint: training_state's "model" entry


class _OnceReader(TensorFileReader):
    """The project's reader, with the metadata read and indexed once for all the loads: a
    large run's `.metadata` lists every chunk of every rank, too much to parse per tensor."""

    def read_metadata(self, *args, **kwargs):
        if getattr(self, "_metadata", None) is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs) -> None:
        if getattr(self, "_set_up_for", None) is not metadata:
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            self._set_up_for = metadata


class CheckpointTensors:
    """The model tensors of one checkpoint, read one at a time, without a process group."""

    def __init__(self, step_path: Path):
        self.reader = _OnceReader(step_path)
        self.entries = self.reader.read_metadata().state_dict_metadata
        self.loads: list[int] = []  # the keys each DCP load asked for (always 1)

    def meta(self, name: str) -> TensorStorageMetadata:
        md = self.entries.get(_MODEL + name)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{self.reader.path} holds no model tensor {name!r}: the "
                                  "checkpoint does not match the model config in its manifest")
        return md

    def read(self, name: str) -> torch.Tensor:
        md = self.meta(name)
        state = {_MODEL + name: torch.empty(md.size, dtype=md.properties.dtype)}
        with warnings.catch_warnings():  # "no process group, loading in one process": yes
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load(state, storage_reader=self.reader, no_dist=True)
            except CheckpointException as e:  # a refused entry: its one line
                if (refused := refusal(e)) is None:
                    raise
                raise refused from None
        self.loads.append(len(state))
        return state[_MODEL + name]


@dataclass
class _Shard:
    groups: list[tuple[Piece, list[tuple[str, tuple[int, ...]]]]] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class Exported:
    out: Path
    family: Family
    files: list[str]
    notes: list[str]
    loads: list[int]  # the tensors each checkpoint read asked for: one, every time


def model_config(manifest: dict, step_path: Path) -> ModelConfig:
    try:
        return ModelConfig.model_validate(manifest["config"]["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{step_path}/optimus.json has no usable model config ({e}): "
                              "export it with the optimus version that wrote it") from None


def export_hf(step_path: Path | str, out: Path | str, *, max_shard_bytes: int = 5 * 10**9,
              dtype: str = "float32", overwrite: bool = False,
              trust: Trust | None = None) -> Exported:
    """Write the checkpoint in `step_path` as a Transformers model folder `out`: one the run's
    key authenticates, or that `trust` accepts (default: the key beside its directory)."""
    step_path, out = Path(step_path), Path(out)
    _check_out(out, overwrite)
    manifest, untrusted = (trust or Trust(key_file_for(step_path.parent))).manifest(step_path)
    if problems := verify(step_path, deep=False):
        raise CheckpointError(f"{step_path} is damaged: {problems[0]}; export another step")
    cfg = model_config(manifest, step_path)
    tensors = CheckpointTensors(step_path)
    family = choose_family(cfg, _bias_nonzero(cfg, tensors))
    target = DTYPES[dtype]
    shards = _plan(pieces(cfg, family), tensors, target, max_shard_bytes)
    tmp = out.with_name(f".tmp.{out.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:  # the tokenizer first: data that is gone fails the export before the weights
        eos_id, notes = tokenizer_files(manifest, cfg, step_path, tmp)
        if untrusted:
            notes = [f"{step_path} was not written by this run: {untrusted}; trusted", *notes]
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                 for i in range(len(shards))]
        weight_map = {}
        for name, shard in zip(names, shards, strict=True):
            _write_shard(tmp / name, shard, tensors, target)
            weight_map.update({hf: name for _, entries in shard.groups for hf, _ in entries})
        index = {"metadata": {"total_size": sum(s.nbytes for s in shards)},
                 "weight_map": dict(sorted(weight_map.items()))}
        _write_json(tmp / INDEX, index)
        _write_json(tmp / "config.json", hf_config(cfg, family, dtype, eos_id))
        if eos_id is not None:
            _write_json(tmp / "generation_config.json", {"eos_token_id": eos_id})
        for small in tmp.glob("*.json"):  # the shards were synced as they were written
            fsync_path(small)
        fsync_path(tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(out, family, sorted(p.name for p in out.iterdir()), notes, tensors.loads)


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file: give a directory to write the model to")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"--out {out} is not empty: give a new directory, or --overwrite "
                              "to replace what is there")


def _bias_nonzero(cfg, tensors: CheckpointTensors) -> bool:
    """Whether a softmax router's loss-free bias moved away from zero (it decides the family)."""
    m = cfg.moe
    if not (m.experts and m.balance == "bias" and m.score == "softmax"):
        return False
    return any(bool(tensors.read(f"layers.{i}.feed_forward.expert_bias").count_nonzero())
               for i in range(m.dense_layers, cfg.n_layers))


def _plan(plan: list[Piece], tensors: CheckpointTensors, target: torch.dtype,
          max_bytes: int) -> list[_Shard]:
    """Pieces into files of at most `max_bytes`, in model order. A piece never spans two files
    (its Optimus tensor is read once): one larger than `max_bytes` gets a file of its own."""
    itemsize = torch.empty((), dtype=target).element_size()
    shards = [_Shard()]
    for piece in plan:
        shape = tuple(tensors.meta(piece.ours).size) if piece.ours else piece.shape
        entries = list(zip(piece.hf, hf_shapes(piece, shape), strict=True))
        nbytes = sum(_numel(s) * itemsize for _, s in entries)
        if shards[-1].groups and shards[-1].nbytes + nbytes > max_bytes:
            shards.append(_Shard())
        shards[-1].groups.append((piece, entries))
        shards[-1].nbytes += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _write_shard(path: Path, shard: _Shard, tensors: CheckpointTensors,
                 target: torch.dtype) -> None:
    if sys.byteorder != "little":  # safetensors is little-endian; we write native bytes
        raise CheckpointError("export needs a little-endian machine")
    itemsize = torch.empty((), dtype=target).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for _, entries in shard.groups:
        for name, shape in entries:
            end = offset + _numel(shape) * itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPE[target], "shape": list(shape),
                            "data_offsets": [offset, end]}
            offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for piece, entries in shard.groups:
            converted = to_hf(piece, tensors.read(piece.ours) if piece.ours else None)
            for (name, shape), t in zip(entries, converted, strict=True):
                if tuple(t.shape) != shape:
                    raise CheckpointError(f"{name}: shape {tuple(t.shape)}, planned {shape}")
                f.write(memoryview(t.to(target).contiguous().view(-1).view(torch.uint8)
                                   .numpy()))
            del converted  # the only tensor held: gone before the next piece is read
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place (an old one, when overwriting, goes after)."""
    old = None
    if out.is_dir():
        old = out.with_name(f".old.{out.name}.{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old)
