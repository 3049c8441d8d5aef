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

from dataclasses import dataclass

from torch import nn

from optimus.parallel.activation_checkpoint import has_moe


def apply_compile(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every block of `model.layers` in place; return how many.

    A checkpointed MoE block is compiled inside its checkpoint: its recompute replays the
    routing through context managers that torch.compile cannot trace (only dispatch modes),
    so the checkpoint stays eager around the compiled block."""
    for block in model.layers.values():
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        (inner if inner is not None and has_moe(inner) else block).compile(backend=backend)
    return len(model.layers)


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
