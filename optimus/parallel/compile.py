"""Regional torch.compile: each transformer block on its own, and the loss.

Compiling block by block, not the whole model, is what keeps compile time flat in depth: the
blocks run the same code, so dynamo traces one and the others reuse its graph (their weights
are inputs, not constants). It also leaves FSDP2's hooks, the pipeline's stage boundaries and
tensor parallelism's redistributions outside the compiled regions, where they run eagerly.

Applied after tensor parallelism and activation checkpointing (so a checkpointed block's
recompute is compiled with it) and before FSDP2, in place (`Module.compile`): parameter names,
and with them checkpoints, stay those of the uncompiled model.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from optimus.parallel.activation_checkpoint import has_moe

log = logging.getLogger(__name__)

BROKEN_AGE_S = 60.0  # an empty kernel library this old is no compile in progress
_swept = False


def apply_compile(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every block of `model.layers` in place; return how many.

    A checkpointed MoE block is compiled inside its checkpoint: its recompute replays the
    routing through context managers that torch.compile cannot trace (only dispatch modes),
    so the checkpoint stays eager around the compiled block."""
    global _swept
    if backend == "inductor" and not _swept:
        _swept = True
        drop_broken_kernels()
    keep_eager()
    for block in model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        (inner if inner is not None and has_moe(inner) else block).compile(backend=backend)
    return len(model.layers)


def keep_eager() -> None:
    """Mark the model code's eager-only functions (`EAGER_ONLY` of a models module) as never
    traced: dynamo breaks the graph at each and runs it as Python. Marked here, where compiling
    has imported dynamo anyway, rather than decorated where defined (which would import it in
    every rank). A module's calls look the name up when they run, so they get the mark."""
    import torch

    from optimus.models import moe

    for name in moe.EAGER_ONLY:
        fn = getattr(moe, name)
        if not getattr(fn, "_optimus_eager", False):
            marked = torch.compiler.disable(fn)
            marked._optimus_eager = True
            setattr(moe, name, marked)


def inductor_cache() -> Path:
    """Where inductor keeps its compiled kernels: TORCHINDUCTOR_CACHE_DIR, else its default."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # an older layout of torch's private modules
        import getpass
        import tempfile

        return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path(
            tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    return Path(cache_dir())


def drop_broken_kernels(cache: Path | None = None, older_than_s: float = BROKEN_AGE_S) -> list:
    """Remove the empty kernel libraries (`<key>/<name>.so` of 0 bytes, older than
    `older_than_s`) in inductor's cache; return their paths.

    Inductor builds a kernel's library in place, under the graph's key: a rank killed while
    its compiler wrote one (a fault in the first steps, a stop) leaves an empty file there,
    and every later compile of that graph on the host loads it and fails ("file too short"),
    so every later generation would fail the same way. Without it inductor builds the library
    again. Younger empty files may be another rank's compile in progress: left alone."""
    root = inductor_cache() if cache is None else cache
    now, dropped = time.time(), []
    try:
        found = list(root.glob("*/*.so"))
    except OSError:
        return dropped
    for path in found:
        try:
            stat = path.stat()
            if stat.st_size == 0 and now - stat.st_mtime > older_than_s:
                path.unlink()
                dropped.append(path)
        except OSError:  # gone meanwhile (another rank's sweep), or not ours to remove
            continue
    if dropped:
        log.warning("removed %d empty kernel librar%s that a killed compile left in "
                    "inductor's cache (%s); they are built again", len(dropped),
                    "y" if len(dropped) == 1 else "ies", root)
    return dropped


@dataclass
class CompileStats:
    """What dynamo has done in this process: graphs made, and seconds spent compiling."""

    graphs: int
    seconds: float

    @staticmethod
    def now() -> CompileStats:
        from torch._dynamo.utils import calculate_time_spent, counters

        return CompileStats(int(counters["stats"]["unique_graphs"]),
                            calculate_time_spent().get("total_wall_time", 0.0))


class CompileLog:
    """Says in the run's log when dynamo compiled: the first steps' compile time, and any
    later recompile, which a steady run should not have (it would cost the compile again and
    hints at a shape or type that changes from step to step)."""

    def __init__(self, log) -> None:
        self.log, self.last = log, CompileStats.now()

    def after_step(self, step: int) -> None:
        now = CompileStats.now()
        if now.graphs > self.last.graphs:
            graphs, seconds = now.graphs - self.last.graphs, now.seconds - self.last.seconds
            self.log.event("compile", f"step {step}: {graphs} graph(s) compiled in "
                           f"{seconds:.1f} s", step=step, graphs=graphs, seconds=seconds)
        self.last = now
