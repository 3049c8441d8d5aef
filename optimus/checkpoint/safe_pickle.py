"""Read what a checkpoint pickled without running any code it names.

Besides bare tensor bytes, DCP pickles two things into a checkpoint: `.metadata`, its index of
every entry (`pickle.dump` of a `Metadata` dataclass), and each non-tensor entry (`torch.save`
of a value: a learning rate, a tuple of betas, an RNG state, a layout string). DCP reads them
back with `pickle.load` and `torch.load(weights_only=False)`, which call whatever the pickle
names: whoever can write a checkpoint folder would run code on every rank that resumes from it.
`storage.TensorFileReader` reads both through this module instead:

- `read_metadata_file`: `.metadata` through `_MetadataUnpickler`, whose `find_class` returns
  only the types a DCP index is made of (DCP's metadata dataclasses, `torch.Size`, dtypes,
  layouts, paths) and whose REDUCE, NEWOBJ and BUILD accept only those: a pickle that names
  anything else is refused before anything is called, and none can set attributes on a class.
  The index is then checked: every entry's type, and that each names a file of the checkpoint
  folder itself (no `../`). Torch's own `weights_only` unpickler cannot read it (it stops at
  the FRAME opcode of pickle protocol 4, which DCP writes), so this is the standard library's
  pure-Python unpickler (`pickle._Unpickler`, there since Python 3.0) with those checks: about
  ten times slower than `pickle.load` (25 ms for a small model's 87 kB index).
- `load_value`: a non-tensor entry (or a tensor saved by DCP's own writer) through torch's
  `weights_only` unpickler (tensors, containers, numbers, strings: all that `training_state`
  saves, tests/test_train.py checks it).

A refusal is an `UnsafeCheckpoint`: one line naming the file and what it held.

Private torch names (present in 2.11 and 2.13; tests/test_torch_compat.py checks them):
`torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING`, the enum `TensorProperties`
pickles, and `torch.distributed.checkpoint.filesystem._StorageInfo`, each entry's place. Both are
looked up with getattr: a torch without one refuses checkpoints that name it, in one line.
`torch.serialization._get_layout` is only a name DCP's pickles hold; it maps to `_layout` here.
"""

from __future__ import annotations

import io
import pickle
import re
from collections import OrderedDict
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem, metadata

from optimus.checkpoint.manifest import CheckpointError

__all__ = ["UnsafeCheckpoint", "load_value", "read_metadata_file", "refusal"]

_TAMPERED = "nothing in it was run; the checkpoint is damaged or was tampered with"
# A file DCP writes into a checkpoint folder: a name, never a path (`__0_0.distcp`).
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file that holds what a checkpoint never holds (code to run, a path out)."""


def _layout(name: str) -> torch.layout:
    """What `torch.serialization._get_layout` does for a pickled layout, for layouts only."""
    found = _LAYOUTS.get(name)
    if found is None:
        raise pickle.UnpicklingError(f"no layout {name!r}")
    return found


_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
# The types whose instances the index is made of: BUILD may fill in only these.
_BUILT = tuple(t for t in (
    *(getattr(metadata, name, None) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta")),
    getattr(filesystem, "_StorageInfo", None)) if t is not None)
_CALLABLE = (*_BUILT, torch.Size, PosixPath, PurePosixPath, OrderedDict, _layout,
             *(t for t in (getattr(metadata, "_MEM_FORMAT_ENCODING", None),) if t is not None))
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(t.__module__, t.__qualname__): t for t in _CALLABLE if isinstance(t, type)},
    ("pathlib", "PosixPath"): PosixPath,  # Python 3.13 moved them to pathlib._local
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("torch.serialization", "_get_layout"): _layout,
    **{("torch", name): v for name, v in vars(torch).items()
       if isinstance(v, torch.dtype | torch.layout | torch.memory_format)},
}


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler, told which globals exist and what it may call or fill in."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise UnsafeCheckpoint(f"{self.where} names {module}.{name}, which DCP's index of a "
                                   f"checkpoint never holds: refused; {_TAMPERED}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(f"{self.where} holds a persistent id; {_TAMPERED}")

    def _callable(self, obj: Any, opcode: str) -> None:
        if not any(obj is allowed for allowed in _CALLABLE):
            raise UnsafeCheckpoint(f"{self.where}: {opcode} on a {type(obj).__name__}; "
                                   f"{_TAMPERED}")

    def load_reduce(self) -> None:
        self._callable(self.stack[-2], "REDUCE")
        super().load_reduce()

    def load_newobj(self) -> None:
        self._callable(self.stack[-2], "NEWOBJ")
        super().load_newobj()

    def load_newobj_ex(self) -> None:
        self._callable(self.stack[-3], "NEWOBJ_EX")
        super().load_newobj_ex()

    def load_build(self) -> None:
        if type(self.stack[-2]) not in _BUILT:
            raise UnsafeCheckpoint(f"{self.where}: BUILD on a {type(self.stack[-2]).__name__}; "
                                   f"{_TAMPERED}")
        super().load_build()

    def load_instance(self) -> None:  # INST and OBJ, protocol 0/1: DCP never writes them
        raise UnsafeCheckpoint(f"{self.where} builds an old-style instance; {_TAMPERED}")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.INST[0]] = load_instance
    dispatch[pickle.OBJ[0]] = load_instance


def read_metadata_file(path: Path | str) -> metadata.Metadata:
    """DCP's index of a checkpoint, read without calling anything the file names, and checked.
    FileNotFoundError when there is none (DCP then looks for a rank's own)."""
    path = Path(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        md = _MetadataUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to parse is one line
        raise UnsafeCheckpoint(f"{path} is not a DCP index ({_first_line(e)}); "
                               f"{_TAMPERED}") from None
    _check_index(md, path)
    return md


def _check_index(md: Any, path: Path) -> None:
    def bad(what: str) -> UnsafeCheckpoint:
        return UnsafeCheckpoint(f"{path} {what}; {_TAMPERED}")

    if not isinstance(md, metadata.Metadata):
        raise bad(f"holds a {type(md).__name__}, not DCP's Metadata")
    entries, storage = md.state_dict_metadata, md.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise bad("has no table of entries")
    for name, entry in entries.items():
        if not isinstance(name, str):
            raise bad(f"names an entry {name!r}")
        if isinstance(entry, metadata.TensorStorageMetadata):
            props = entry.properties
            if not (isinstance(props, metadata.TensorProperties)
                    and isinstance(props.dtype, torch.dtype) and _is_shape(entry.size)
                    and isinstance(entry.chunks, list) and all(
                        isinstance(c, metadata.ChunkStorageMetadata) and _is_shape(c.offsets)
                        and _is_shape(c.sizes) for c in entry.chunks)):
                raise bad(f"describes tensor {name} with something else than shapes and a dtype")
        elif not isinstance(entry, metadata.BytesStorageMetadata):
            raise bad(f"describes entry {name} as a {type(entry).__name__}")
    for index, info in storage.items():
        if not (isinstance(index, metadata.MetadataIndex) and _is_storage_info(info)):
            raise bad(f"places an entry as a {type(info).__name__}")
        if not _FILE_NAME.fullmatch(info.relative_path):
            raise bad(f"places {index.fqn} in {info.relative_path!r}, not a file of its folder")


def _is_shape(value: Any) -> bool:
    return isinstance(value, torch.Size | tuple) and all(
        type(n) is int and n >= 0 for n in value)


def _is_storage_info(info: Any) -> bool:
    storage_info = getattr(filesystem, "_StorageInfo", None)
    descriptors = getattr(info, "transform_descriptors", None)
    return (storage_info is not None and isinstance(info, storage_info)
            and isinstance(info.relative_path, str)
            and type(info.offset) is int and type(info.length) is int
            and info.offset >= 0 and info.length >= 0
            and (descriptors is None or (isinstance(descriptors, list | tuple)
                                         and all(isinstance(d, str) for d in descriptors))))


def load_value(data: bytes, where: str, map_location: str | None = None) -> Any:
    """A value `torch.save` wrote (a non-tensor entry, a tensor of DCP's own writer), read by
    torch's weights_only unpickler: UnsafeCheckpoint if it holds anything else."""
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - an UnpicklingError, or a malformed file
        raise UnsafeCheckpoint(f"{where} is refused by torch's weights_only unpickler "
                               f"({_first_line(e)}); {_TAMPERED}") from None


def refusal(exc: BaseException) -> CheckpointError | None:
    """The CheckpointError behind a failed DCP load (DCP wraps each rank's exception in a
    CheckpointException), so that it reads as one line; None if there is none."""
    failures = getattr(exc, "failures", None) or {}
    for rank in sorted(failures):
        failure = failures[rank]
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, CheckpointError):
            return cause
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
