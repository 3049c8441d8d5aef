"""One layer's forward and backward, measured: time, bytes moved, aten ops, host reads, memory.

bench/moe.py measures each of its layers with `measure`: the MoE layer of the working tree,
the one from before (bench/moe_reference.py), a dense SwiGLU, torchtitan's MoE. A layer names
its regions, submodules whose forward is a part of it (an MoE's `experts` and `router`); the
rest of the layer is its dispatch and combine (scores, top-k, grouping the slots by expert,
gathering the rows, the weighted sum, the casts).

Bytes: a TorchDispatchMode (`Traffic`) adds up, for every aten op that moves data, the bytes
of its tensor inputs and outputs (elements x element size: a slice counts its own elements,
not its storage's). Views move nothing (the ops whose schema marks their output an alias, and
`NO_TRAFFIC`: `_unsafe_view`, uninitialised allocations). An in-place op counts its tensor as
read and as written; a gather counts its whole source. It is what each op touches at most,
the same measure before and after. Ops: every dispatched aten op, views included (on a device
each is a kernel launch or host work). Host reads: `aten._local_scalar_dense` (an `.item()`,
`int()` or `bool()` of a tensor: the host waits for the device).

Attribution, forward: by flag. While a region's forward runs, the ops it dispatches count to
it; the rest to dispatch and combine. Backward: by subtraction. Autograd runs the regions'
backward interleaved with the rest, so each region's call is replayed alone (the arguments
captured in the layer's own forward, made fresh leaves where they required grad, a fixed
random gradient of its output) and its backward's counts are taken from the layer's backward.
Time, both passes: the layer forward and backward whole, each region's call replayed alone;
dispatch and combine are the layer less its regions. (A replay's inputs are leaves, which
the layer's are not: their first gradient is kept as it comes, at most one op more a leaf.)

Memory: the peak of bytes allocated during one forward and backward above what was allocated
before it (activations, temporaries, and the weights' gradients, which the pass creates), and
what the forward leaves allocated for the backward (saved activations, the output).
`torch.cuda.max_memory_allocated` on a GPU; on a CPU the storage tracker
`optimus.planner.measure.PeakMemory` (every storage an op creates, until it is freed).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

HOST_READ = torch.ops.aten._local_scalar_dense
aten = torch.ops.aten
# Ops that move no data but whose schema does not say so (`is_view` says it of the others):
# a view by another name, and allocations left uninitialised.
NO_TRAFFIC = {aten._unsafe_view, aten.empty, aten.empty_like, aten.empty_strided,
              aten.new_empty, aten.new_empty_strided}
REST = "dispatch"  # what the regions leave: dispatch and combine
LAYER = "layer"
PASSES = ("forward", "backward")


class Traffic(TorchDispatchMode):
    """Bytes, ops and host reads of every aten op, by pass and region."""

    def __init__(self):
        super().__init__()
        self.at = ("forward", REST)
        self.bytes: Counter = Counter()
        self.ops: Counter = Counter()
        self.reads: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[self.at] += 1
        if func.overloadpacket == HOST_READ:
            self.reads[self.at] += 1
        if not func.is_view and func.overloadpacket not in NO_TRAFFIC:
            self.bytes[self.at] += sum(t.numel() * t.element_size()
                                       for t in tree_leaves((args, kwargs, out))
                                       if isinstance(t, torch.Tensor))
        return out

    @contextmanager
    def during(self, pass_: str) -> Iterator[None]:
        self.at = (pass_, REST)
        with self:
            yield

    def flag(self, name: str, inner: Callable) -> Callable:
        """`inner`, its ops counted to region `name`."""
        def flagged(*args, **kwargs):
            outer, self.at = self.at, (self.at[0], name)
            try:
                return inner(*args, **kwargs)
            finally:
                self.at = outer
        return flagged

    def total(self, kind: str, pass_: str) -> int:
        return sum(v for (p, _), v in getattr(self, kind).items() if p == pass_)


@dataclass
class Call:
    """One call of a layer or region, to run forward and backward again."""

    fn: Callable
    args: tuple
    kwargs: dict = field(default_factory=dict)
    grad: torch.Tensor | None = None  # of its output

    def fresh(self) -> tuple[tuple, dict]:
        """The arguments, each tensor that required grad a new leaf (so nothing accumulates
        into the layer's tensors, and backward stops at the call's edge)."""
        def leaf(t):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return t.detach().requires_grad_()
            return t
        return tree_map(leaf, self.args), tree_map(leaf, self.kwargs)


@dataclass
class Figures:
    """A layer's measures. Each table: pass -> part ("layer", each region, REST) -> value."""

    tokens: int
    regions: tuple[str, ...]
    seconds: dict[str, dict[str, float]]
    bytes: dict[str, dict[str, int]]
    ops: dict[str, dict[str, int]]
    reads: dict[str, dict[str, int]]
    peak_bytes: int
    held_bytes: int  # allocated at the forward's end: saved for backward, and the output
    calls: dict[str, Call]  # each region's captured call (the experts' rows and counts)

    def both(self, table: str, part: str = LAYER) -> float:
        """Forward + backward of `part` in `table` ("seconds", "bytes", "ops", "reads")."""
        return sum(getattr(self, table)[p][part] for p in PASSES)

    def share(self, pass_: str | None = None) -> float:
        """Dispatch and combine's share of the layer's time (of one pass, or both)."""
        if pass_ is None:
            return self.both("seconds", REST) / self.both("seconds")
        return self.seconds[pass_][REST] / self.seconds[pass_][LAYER]

    def per_token(self, part: str = REST, pass_: str | None = None) -> float:
        """Bytes per token of `part` (one pass, or both)."""
        n = self.both("bytes", part) if pass_ is None else self.bytes[pass_][part]
        return n / self.tokens


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(call: Call, params: list[nn.Parameter], device: torch.device,
        during: Callable[[str], object] = lambda _: nullcontext()) -> tuple[float, float]:
    """One forward and backward of `call`, timed: (forward s, backward s)."""
    args, kwargs = call.fresh()
    for p in params:
        p.grad = None
    sync(device)
    began = time.perf_counter()
    with during("forward"):
        out = call.fn(*args, **kwargs)
    sync(device)
    forward = time.perf_counter() - began
    began = time.perf_counter()
    with during("backward"):
        out.backward(call.grad)
    sync(device)
    return forward, time.perf_counter() - began


@contextmanager
def patched(regions: dict[str, nn.Module], wrap: Callable[[str, Callable], Callable]):
    """Each region's forward replaced by `wrap(name, forward)` while inside."""
    saved = {name: m.__dict__.get("forward") for name, m in regions.items()}
    for name, m in regions.items():
        m.forward = wrap(name, m.forward)
    try:
        yield
    finally:
        for name, m in regions.items():
            if saved[name] is None:
                del m.forward
            else:
                m.forward = saved[name]


def capture(calls: dict[str, Call]) -> Callable[[str, Callable], Callable]:
    """A `patched` wrap that keeps each region's first call and its output's shape."""
    def wrap(name: str, inner: Callable) -> Callable:
        def captured(*args, **kwargs):
            out = inner(*args, **kwargs)
            if name not in calls:
                calls[name] = Call(inner, args, kwargs, grad=out.detach())  # its shape
            return out
        return captured
    return wrap


@contextmanager
def peak_memory(device: torch.device, existing: list[torch.Tensor]) -> Iterator[dict]:
    """{"peak": bytes} once left: the peak allocated inside above what was allocated before;
    {"now": f} inside: f() what is allocated now above that. On a CPU the tracker is told of
    the `existing` tensors (the weights, the input): a view of them is not a new storage."""
    from optimus.planner.measure import PeakMemory

    box: dict = {}
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        box["now"] = lambda: torch.cuda.memory_allocated(device) - base
        yield box
        sync(device)
        box["peak"] = torch.cuda.max_memory_allocated(device) - base
    else:
        tracker = PeakMemory()
        tracker.track(existing)
        base = tracker.current
        box["now"] = lambda: tracker.current - base
        with tracker:
            yield box
        box["peak"] = tracker.peak - base


def random_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t.shape, generator=g).to(t.device, t.dtype)


class Case:
    """One layer under measure: its counts, its timed runs, its regions' replays."""

    def __init__(self, layer: nn.Module, x: torch.Tensor, regions: dict[str, nn.Module]):
        self.layer, self.regions, self.device = layer, regions, x.device
        self.params = list(layer.parameters())
        self.call = Call(layer, (x.detach().requires_grad_(),), grad=random_like(x, 1))
        self.tokens = x.shape[0] * x.shape[1]
        self.calls: dict[str, Call] = {}
        self.times: dict[str, list[tuple[float, float]]] = {LAYER: [], **{r: [] for r in regions}}
        self.tables = {kind: {p: {} for p in PASSES} for kind in ("bytes", "ops", "reads")}
        self.peak = self.held = 0

    def count(self) -> None:
        """The layer once, its ops counted by region (forward) and in all (backward)."""
        traffic = Traffic()

        def during(pass_: str):
            if pass_ == "backward":  # what the forward left: saved for backward, the output
                self.held = memory["now"]()
            return traffic.during(pass_)

        existing = [*self.layer.parameters(), *self.layer.buffers(), *self.call.args]
        with peak_memory(self.device, existing) as memory, \
                patched(self.regions, traffic.flag):
            run(self.call, self.params, self.device, during)
        self.peak = memory["peak"]
        for kind, table in self.tables.items():
            for p in PASSES:
                table[p][LAYER] = traffic.total(kind, p)
                table[p].update({r: 0 for r in self.regions})
            table["forward"].update({r: getattr(traffic, kind)[("forward", r)]
                                     for r in self.regions})

    def time(self, capture_calls: bool = False) -> None:
        with patched(self.regions, capture(self.calls)) if capture_calls else nullcontext():
            self.times[LAYER].append(run(self.call, self.params, self.device))

    def count_regions(self) -> None:
        """Each region's captured call alone, its backward counted."""
        for seed, (name, c) in enumerate(self.calls.items(), start=2):
            c.grad = random_like(c.grad, seed)
            alone = Traffic()
            run(c, self.params, self.device, alone.during)
            for kind, table in self.tables.items():
                table["backward"][name] = alone.total(kind, "backward")

    def time_regions(self) -> None:
        for name, c in self.calls.items():
            self.times[name].append(run(c, self.params, self.device))

    def figures(self) -> Figures:
        seconds = {p: {part: min((t[i] for t in times), default=0.0)
                       for part, times in self.times.items()} for i, p in enumerate(PASSES)}
        for table in (seconds, *self.tables.values()):
            for p in PASSES:
                table[p][REST] = table[p][LAYER] - sum(table[p][r] for r in self.regions)
        self.layer.zero_grad(set_to_none=True)
        return Figures(tokens=self.tokens, regions=tuple(self.regions), seconds=seconds,
                       peak_bytes=self.peak, held_bytes=self.held, calls=self.calls,
                       **self.tables)


def measure(layers: dict[str, tuple[nn.Module, dict[str, nn.Module]]], x: torch.Tensor,
            repeat: int, warmup: int = 0, optional: tuple[str, ...] = ()
            ) -> tuple[dict[str, Figures], dict[str, str]]:
    """Each `layer(x)` (name -> (layer, its regions)) forward and backward: counted once
    (bytes, ops, host reads, memory), then timed `repeat` times (the shortest: on a shared
    machine interference only adds), after `warmup` untimed runs; each region the same,
    alone. The layers take turns, run by run, and each layer's regions run right after it, so
    that a machine's changing load falls on all alike.
    A layer in `optional` that fails is left out, and why returned: (figures, failures)."""
    cases = {name: Case(layer, x, regions) for name, (layer, regions) in layers.items()}
    failed: dict[str, str] = {}

    def each(step: Callable[[Case], None]) -> None:
        for name, case in list(cases.items()):
            try:
                step(case)
            except Exception as e:
                if name not in optional:
                    raise
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                del cases[name]

    for _ in range(warmup):
        each(lambda c: run(c.call, c.params, c.device))
    each(Case.count)
    each(lambda c: c.time(capture_calls=True))
    each(Case.count_regions)
    for _ in range(repeat):
        each(lambda c: (c.time(), c.time_regions()))
    return {name: case.figures() for name, case in cases.items()}, failed


def counted(layer: nn.Module, x: torch.Tensor) -> Traffic:
    """One forward and backward of `layer(x)`, counted (no regions: all of it `REST`)."""
    traffic = Traffic()
    call = Call(layer, (x.detach().requires_grad_(),), grad=random_like(x, 1))
    run(call, list(layer.parameters()), x.device, traffic.during)
    return traffic


def best_of(fn: Callable[[], object], device: torch.device, n: int) -> float:
    """The shortest of `n` timed calls, after one untimed."""
    fn()
    times = []
    for _ in range(n):
        sync(device)
        began = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - began)
    return min(times)


def gemm_rate(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, grouped_mm: Callable,
              n: int) -> float:
    """The grouped GEMM's rate (rows `x` grouped by `counts`, times stacked `w`) over one
    dense matmul's of the same FLOPs (`x` times one [in, out] matrix), forward."""
    dense = w[0].detach().clone()
    with torch.no_grad():
        grouped_s = best_of(lambda: grouped_mm(x, w, counts), x.device, n)
        dense_s = best_of(lambda: x @ dense, x.device, n)
    return dense_s / grouped_s
