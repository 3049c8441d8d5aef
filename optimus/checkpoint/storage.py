"""DCP storage that writes tensor bytes as they are, and reads them straight back.

DCP's `FileSystemWriter` serialises every tensor with `torch.save` into a buffered file, and its
reader makes a `torch.load` of every tensor's slice before copying it into place. On a rank's
CPU that costs more than the disk: a DCP save reached 0.5-0.7x of a plain fsync'd write of the
same bytes (docs/benchmarks.md). These two classes keep DCP's planning, metadata, file naming
and resharding, and change only how bytes reach the file:

- `TensorFileWriter` writes each tensor's contiguous bytes with unbuffered `write()` calls (no
  copy, no pickling; the GIL is released while the kernel copies), one file per writer thread,
  then fsyncs. Each entry's storage record carries the descriptor `RAW` beside its offset and
  length, so a reader knows the bytes are bare.
- `TensorFileReader` reads such an entry with `readinto` directly into the tensor it loads (the
  whole chunk, contiguous, same dtype: the common case), or into a scratch tensor of the saved
  chunk's shape and dtype that is then narrowed and copied (resharding, dtype change). Entries
  without the descriptor (a checkpoint written by DCP's own writer) go through `torch.load` as
  DCP would, so both formats load.

DCP's stock reader refuses a `RAW` entry (it looks the descriptor up among its stream
extensions and finds none), rather than misreading it.

`TensorFileReader` also reads what DCP pickles without running code (safe_pickle.py): its
`.metadata`, by an unpickler that knows only DCP's index types, and every non-tensor entry, by
torch's `weights_only` unpickler, before the planner sees it. Every read is bounded by the file
it reads: an entry past a file's end, or whose length is not its tensor's, is refused before
anything is allocated for it.

The storage record class `_StorageInfo` is private to torch's filesystem module; pyproject pins
torch to 2.13.x, and the round-trip tests would catch a change.
"""

from __future__ import annotations

import io
import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from optimus.checkpoint.safe_pickle import load_value, read_metadata_file

RAW = "optimus-raw-v1"  # the descriptor of an entry whose bytes are the bare tensor


class TensorFileWriter(FileSystemWriter):
    """`FileSystemWriter` whose files hold bare tensor bytes; same constructor."""

    def _write_data(self, planner: SavePlanner, file_queue) -> Future[list[WriteResult]]:
        jobs = []
        while not file_queue.empty():
            jobs.append(file_queue.get_nowait())  # (path, storage key, items): a file each
        results: list[list[WriteResult]] = [[] for _ in jobs]
        errors: list[BaseException] = []

        def write(i: int) -> None:
            try:
                path, key, items = jobs[i]
                results[i] = self._write_file(path, key, items, planner)
            except BaseException as e:  # re-raised below, on the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=write, args=(i,), name="checkpoint-write")
                   for i in range(1, len(jobs))]
        for t in threads:
            t.start()
        if jobs:
            write(0)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        future: Future[list[WriteResult]] = Future()
        future.set_result([r for file_results in results for r in file_results])
        return future

    def _write_file(self, path: os.PathLike, key: str, items: list[WriteItem],
                    planner: SavePlanner) -> list[WriteResult]:
        results = []
        offset = 0
        with open(path, "wb", buffering=0) as f:
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    view, descriptors = data.getbuffer(), None
                else:
                    view, descriptors = _bytes_of(data), [RAW]
                _write_all(f, view)
                length = view.nbytes
                results.append(WriteResult(
                    index=item.index, size_in_bytes=length,
                    storage_data=_StorageInfo(key, offset, length, descriptors)))
                offset += length
            if self.sync_files:
                os.fsync(f.fileno())
        return results


class TensorFileReader(FileSystemReader):
    """`FileSystemReader` that also reads `TensorFileWriter`'s bare entries, and runs no code a
    checkpoint's pickles name."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's `.metadata` (a rank's own `__<rank>.metadata` with `rank=`), read by the
        restricted unpickler instead of `pickle.load`, once per checkpoint."""
        rank = kwargs.get("rank")
        cache = self.__dict__.setdefault("_metadata", {})
        if rank not in cache:
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            cache[rank] = read_metadata_file(Path(self.path) / name)
        metadata = cache[rank]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._metadata = {}

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        # (name, chunk offsets) -> (chunk sizes, dtype) of every saved tensor chunk
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Size, torch.dtype]] = {}
        for name, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[name, tuple(chunk.offsets)] = (chunk.sizes,
                                                               md.properties.dtype)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        for relative_path, items in per_file.items():
            items.sort(key=lambda it: self.storage_data[it.storage_index].offset)
            with open(self.fs.concat_path(self.path, relative_path), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                for item in items:
                    info: _StorageInfo = self.storage_data[item.storage_index]
                    if info.offset + info.length > size:
                        raise ValueError(f"{relative_path} ends before byte "
                                         f"{info.offset + info.length} (truncated)")
                    if item.type == LoadItemType.BYTE_IO:
                        value = load_value(_read_exactly(f, info, bytearray(info.length)),
                                           f"{relative_path}: {item.storage_index.fqn}")
                        planner.load_bytes(item, _saved(value))
                    elif _is_raw(info.transform_descriptors):
                        self._read_raw(f, info, item, planner)
                    else:  # written by DCP's own writer
                        self._read_pickled(f, info, item, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_raw(self, f, info: _StorageInfo, item, planner: LoadPlanner) -> None:
        sizes, dtype = self._chunks[item.storage_index.fqn, tuple(item.storage_index.offset)]
        if math.prod(sizes) * dtype.itemsize != info.length:
            raise ValueError(f"{info.relative_path} at {info.offset}: {info.length} bytes "
                             f"saved for a {list(sizes)} {dtype} chunk")
        target = planner.resolve_tensor(item).detach()
        whole = (all(o == 0 for o in item.storage_offsets)
                 and tuple(item.lengths) == tuple(sizes))
        if whole and target.dtype == dtype and target.is_contiguous() and target.is_cpu:
            _read_exactly(f, info, _bytes_of(target))
        else:
            chunk = torch.empty(sizes, dtype=dtype)
            _read_exactly(f, info, _bytes_of(chunk))
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths,
                                                      strict=True)):
                chunk = chunk.narrow(dim, start, length)
            target.copy_(chunk)
        planner.commit_tensor(item, target)

    def _read_pickled(self, f, info: _StorageInfo, item, planner: LoadPlanner) -> None:
        f.seek(info.offset)
        data = self.transforms.transform_load_stream(
            item, info.transform_descriptors or (), io.BytesIO(f.read(info.length))).read()
        tensor = load_value(data, f"{info.relative_path}: {item.storage_index.fqn}", "cpu")
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths,
                                                  strict=True)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def _saved(value: Any) -> io.BytesIO:
    """A value the weights_only unpickler accepted, saved again by torch.save: what the
    planner's `load_bytes` reads (DCP's with `torch.load(weights_only=False)`) is then what
    this process wrote, whatever the checkpoint held."""
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    return stream


def _is_raw(descriptors: Sequence[str] | None) -> bool:
    return bool(descriptors) and list(descriptors) == [RAW]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    t = tensor.detach()
    if not t.is_cpu:
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _write_all(f, view: memoryview) -> None:
    """Unbuffered write() may write less than asked (large writes, signals): loop."""
    done = 0
    while done < view.nbytes:
        done += f.write(view[done:])


def _read_exactly(f, info: _StorageInfo, into) -> Any:
    view = memoryview(into).cast("B")
    if view.nbytes != info.length:
        raise ValueError(f"{info.relative_path} at {info.offset}: {info.length} bytes saved, "
                         f"{view.nbytes} expected")
    f.seek(info.offset)
    done = 0
    while done < info.length:
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{info.relative_path} ends before byte "
                             f"{info.offset + info.length} (truncated)")
        done += n
    return into
