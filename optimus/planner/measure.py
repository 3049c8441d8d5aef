"""Measure a rank's peak tensor memory over one training step, on any device, CPU included.

What is measured: the bytes of every tensor storage alive at once, at its largest during the
step: parameters, gradients, optimizer state, activations saved for backward, and transients
(all-gathered FSDP2 units, communication buffers torch allocates as tensors). That is the
quantity `torch.cuda.max_memory_allocated` reports on a GPU (bytes held by tensors, without
the allocator's cache and without the 512-byte rounding of its blocks, negligible at these
sizes), and the quantity the memory model predicts. A CPU has no caching allocator to ask, and
its resident set size counts the interpreter and libraries too, so the storages are counted
here instead.

How: a TorchDispatchMode sees every op's outputs and keeps a weak reference to each storage
(freed storages drop out when their last tensor dies); `UntypedStorage.resize_` is watched too,
as FSDP2 frees and re-allocates its unsharded parameters by resizing storage in place.
torch's own `torch.distributed._tools.mem_tracker.MemTracker` counts the same way, but it
refuses a module that runs more than once per step (every pipeline schedule with several
microbatches, and activation recompute), which is why this small tracker exists.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The real storages behind `t`: its own, or for a wrapper subclass (DTensor) its inner
    tensors'."""
    if not isinstance(t, torch.Tensor):
        return []
    if hasattr(t, "_local_tensor"):  # DTensor
        return _storages(t._local_tensor)
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [s for name in names for s in _storages(getattr(t, name))]
    if t.device.type == "meta":
        return []
    return [t.untyped_storage()]


class PeakMemory(TorchDispatchMode):
    """Live and peak bytes of tensor storages; `track` what existed before entering."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._resize = None

    def track(self, tensors: Iterable) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for storage in _storages(t):
                    self._add(storage)

    def reset_peak(self) -> None:
        self.peak = self.current

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._refs:
            self._set(key, storage.nbytes())
            return
        self._refs[key] = weakref.ref(storage, lambda _, k=key: self._drop(k))
        self._sizes[key] = 0
        self._set(key, storage.nbytes())

    def _set(self, key: int, nbytes: int) -> None:
        self.current += nbytes - self._sizes[key]
        self._sizes[key] = nbytes
        self.peak = max(self.peak, self.current)

    def _drop(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.track((out,))
        else:
            self.track(tree_flatten(out)[0])
        return out

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            result = original(storage, size)
            tracker._add(storage)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


def state_tensors(modules: Iterable[torch.nn.Module],
                  optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """What a rank holds between steps: parameters, buffers, gradients, optimizer state."""
    out = []
    for module in modules:
        for p in module.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        out.extend(module.buffers())
    if optimizer is not None:
        for state in optimizer.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


class Collectives(TorchDispatchMode):
    """How many times each collective ran, by name ("allgather", "reduce_scatter", "send").

    Every c10d collective (`dist.all_gather_into_tensor` and the like, which FSDP2, DTensor and
    the pipeline stages call) is an op of the `c10d` namespace, so a dispatch mode sees each
    call; `_allgather_base_` counts as "allgather". torch's own `CommDebugMode` counts the same
    ops, but its module tracker fails on the FSDP2-wrapped model (torch 2.13).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func.overloadpacket.__name__.strip("_").removesuffix("_base")
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
