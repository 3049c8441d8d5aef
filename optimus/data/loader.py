"""Fixed-window samples in a keyed order, cut into global batches, ranks and microbatches.

The order itself (a keyed permutation per epoch) is optimus/data/order.py.

Sample j of a source is tokens [j*seq_len, j*seq_len + seq_len + 1). Global index g reads
sample `order.sample_id(g)`. Step s takes global indices [start + s*B, start + (s+1)*B), cut
into M global microbatches of B/M contiguous indices; rank r of dp takes the r-th contiguous
slice of B/(M*dp) indices of each. So global microbatch j holds the same samples at every dp
degree (what a statistic over a global microbatch, like the MoE auxiliary loss's, needs to be
the same on every layout). The loader's state is therefore one integer: the next step's first
index.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from optimus.data.errors import DataError
from optimus.data.order import SampleOrder
from optimus.data.shards import TokenShards
from optimus.data.synthetic import SyntheticCorpus

if TYPE_CHECKING:
    from optimus.data.mixture import Mixture

class TokenSource(Protocol):
    num_tokens: int

    def read(self, start: int, length: int) -> np.ndarray: ...


class WindowDataset(Dataset):
    """Map-style dataset: item g is the window `order.sample_id(g)` of the source."""

    def __init__(self, source: TokenSource, seq_len: int, seed: int):
        self.source, self.seq_len, self.seed = source, seq_len, seed
        self.num_samples = (source.num_tokens - 1) // seq_len
        if self.num_samples < 1:
            raise DataError(
                f"the data holds {source.num_tokens} tokens, fewer than one sample of "
                f"seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len"
            )
        self.order = SampleOrder(self.num_samples, seed)

    def sample_id(self, g: int) -> int:
        return self.order.sample_id(g)

    def __getitem__(self, g: int) -> dict[str, torch.Tensor]:
        j = self.order.sample_id(g)
        tokens = torch.from_numpy(self.source.read(j * self.seq_len, self.seq_len + 1))
        return {
            "input_ids": tokens[:-1],
            "labels": tokens[1:],
            "sample_ids": torch.tensor(j, dtype=torch.long),
            "index": torch.tensor(g, dtype=torch.long),
        }


class MicrobatchSampler:
    """Stateful, infinite batch sampler: yields this rank's microbatches of global indices."""

    def __init__(
        self,
        *,
        batch_size: int,
        microbatches: int,
        dp_rank: int,
        dp_size: int,
        start_index: int = 0,
        data_key: dict[str, Any] | None = None,
    ):
        self.batch_size, self.microbatches = batch_size, microbatches
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.per_rank = batch_size // dp_size
        self.micro_size = self.per_rank // microbatches
        self.next_index = start_index  # first global index of the next step
        self.microbatch = 0  # next microbatch within that step
        self.data_key = data_key or {}  # settings a saved state must match

    def __iter__(self) -> MicrobatchSampler:
        return self

    def __next__(self) -> list[int]:
        global_micro = self.batch_size // self.microbatches
        lo = (self.next_index + self.microbatch * global_micro
              + self.dp_rank * self.micro_size)
        self.microbatch += 1
        if self.microbatch == self.microbatches:
            self.microbatch, self.next_index = 0, self.next_index + self.batch_size
        return list(range(lo, lo + self.micro_size))

    def state_dict(self) -> dict[str, Any]:
        layout = [self.batch_size, self.microbatches, self.dp_size]
        return {
            "next_index": self.next_index,
            "microbatch": self.microbatch,
            "layout": layout,
            **self.data_key,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in self.data_key.items():
            if state.get(k) != v:
                raise DataError(
                    f"the saved data state has {k}={state.get(k)!r} but this run has {k}={v!r}; "
                    "resume with the same data settings or start the data from scratch"
                )
        layout = [self.batch_size, self.microbatches, self.dp_size]
        if state["microbatch"] and state["layout"] != layout:
            raise DataError(
                "the saved data state is mid-step, so it can only resume with the same "
                f"batch_size, microbatches and dp_size {state['layout']}; save at a step boundary"
            )
        self.next_index, self.microbatch = int(state["next_index"]), int(state["microbatch"])


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise DataError(msg)


def build_loader(
    source: TokenSource | Mixture,
    *,
    seq_len: int,
    batch_size: int,
    microbatches: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    start_index: int = 0,
    num_workers: int = 0,
    prefetch_factor: int = 2,
    pin_memory: bool = False,
) -> StatefulDataLoader:
    """An infinite loader of this rank's microbatches, resumable via state_dict or start_index.
    `pin_memory` (an accelerator's rank): batches come in pinned host memory, so their copy to
    the device needs no sync (optimus/data/prefetch.py)."""
    _check(seq_len >= 1, f"seq_len must be >= 1, got {seq_len}")
    _check(microbatches >= 1, f"microbatches must be >= 1, got {microbatches}")
    _check(dp_size >= 1, f"dp_size must be >= 1, got {dp_size}")
    _check(0 <= dp_rank < dp_size, f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    _check(
        batch_size >= 1 and batch_size % (microbatches * dp_size) == 0,
        f"batch_size {batch_size} must be a positive multiple of microbatches x dp_size "
        f"= {microbatches} x {dp_size}; change batch_size or microbatches",
    )
    _check(seed >= 0, f"seed must be >= 0, got {seed}")
    _check(start_index >= 0, f"start_index must be >= 0, got {start_index}")
    _check(num_workers >= 0, f"num_workers must be >= 0, got {num_workers}")
    _check(prefetch_factor >= 1, f"prefetch_factor must be >= 1, got {prefetch_factor}")
    windows = getattr(source, "windows", None)  # a Mixture makes its own dataset
    dataset = windows(seq_len, seed) if windows else WindowDataset(source, seq_len, seed)
    sampler = MicrobatchSampler(
        batch_size=batch_size,
        microbatches=microbatches,
        dp_rank=dp_rank,
        dp_size=dp_size,
        start_index=start_index,
        data_key={"seed": seed, "seq_len": seq_len, "num_samples": dataset.num_samples,
                  **getattr(dataset, "data_key", {})},
    )
    with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch hook
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            multiprocessing_context=_worker_context() if num_workers > 0 else None,
            pin_memory=pin_memory,
        )


# Modules a loader worker needs before it reads a sample (what unpickling its dataset imports).
_WORKER_IMPORTS = ("torch", "numpy", __name__)


def _worker_context() -> multiprocessing.context.BaseContext:
    """Workers are forked from a forkserver (a single-threaded process that imported torch
    and this module once), never from the rank: a rank holds threads (its collectives', its
    heartbeat's, a checkpoint writer's, torch's thread pools) and a child forked from it
    inherits their locks and pools half-way; a worker forked from a test process that had run
    hundreds of tests died of SIGSEGV at start-up (both of a loader's workers at once). The
    server outlives the loader: an in-process restart's new loader forks from it at once.

    The preload list is the process's one forkserver's (multiprocessing has one a process):
    ours is added to what another part of the process asked for, never put in its place.
    Reading it is a private attribute of CPython's forkserver module (3.11); without it, ours
    alone."""
    ctx = multiprocessing.get_context("forkserver")
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    asked = [m for m in getattr(server, "_preload_modules", None) or [] if m != "__main__"]
    ctx.set_forkserver_preload(asked + [m for m in _WORKER_IMPORTS if m not in asked])
    return ctx


def build_source(
    kind: str | Any, *, path: str | None = None, vocab_size: int, seed: int = 0,
    sources: list | None = None,
) -> TokenSource | Mixture:
    """The job's data: "synthetic" -> SyntheticCorpus; "shards" -> TokenShards(path), or a
    Mixture of `sources` ({path, weight} each), checked against the model's vocabulary.
    `kind` may be the job's whole data section (DataConfig) instead of its `source`."""
    if not isinstance(kind, str):
        kind, path, sources = kind.source, kind.path, kind.sources
    if kind == "synthetic":
        return SyntheticCorpus(vocab_size, seed)
    if kind == "shards":
        _check(not (path and sources), "set data.path (one source) or data.sources (a "
               "mixture), not both")
        if sources:
            from optimus.data.mixture import Mixture

            return Mixture([_shards(_field(s, "path"), vocab_size) for s in sources],
                           [_field(s, "weight") for s in sources])
        _check(path is not None, "data kind 'shards' needs a path to a prepared folder")
        return _shards(path, vocab_size)
    raise DataError(f"unknown data kind {kind!r}; use 'synthetic' or 'shards'")


def _field(source, name: str):
    return source[name] if isinstance(source, dict) else getattr(source, name)


def _shards(path: str, vocab_size: int) -> TokenShards:
    shards = TokenShards(path)
    _check(
        shards.vocab_size <= vocab_size,
        f"the data in {path} was tokenized with vocab_size {shards.vocab_size}, larger "
        f"than the model's vocab_size {vocab_size}; raise the model's vocab_size to at "
        f"least {shards.vocab_size} or prepare the data with a matching tokenizer",
    )
    return shards
