"""Rank-side fault injection, for tests and demos: a rank breaks itself the way real ones do.

- kill_rank: SIGKILLs itself before step s (a crash).
- freeze_rank: SIGSTOPs itself before step s (a frozen process: its heartbeats stop).
- stall_rank: sleeps `seconds` just before the gradient reduction of step s, in phase
  "backward", while its peers wait in the reduction (a hung collective).
- hang_rank: blocks forever in the optimizer phase of step s, as in a device sync that never
  returns (a hung device): its heartbeats go on, its step stays behind.
- nan_rank: from step s on, its loss and gradients are NaN (a bad tile).
- slow_rank: from step s on, spends `seconds` more per step computing (a straggler).

Each fires only in its `generation`. Whole-node faults (`kill_node`) are carried out by the
node's agent, not here.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

from optimus.config import FaultInjectionConfig


class RankFaults:
    """The faults planned for this rank in this generation, fired at their points in a step."""

    def __init__(self, cfg: FaultInjectionConfig, *, rank: int, generation: int):
        self.faults = [f for f in cfg.faults
                       if f.rank == rank and f.generation == generation and f.kind != "kill_node"]
        self.rank = rank

    def _due(self, kind: str, step: int, onward: bool = False):
        for f in self.faults:
            if f.kind == kind and (step >= f.step if onward else step == f.step):
                return f
        return None

    def step_start(self, step: int) -> None:
        if self._due("kill_rank", step):
            self._say(f"kills itself at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("freeze_rank", step):
            self._say(f"freezes at step {step}")
            os.kill(os.getpid(), signal.SIGSTOP)

    def after_backward(self, step: int, params, loss: torch.Tensor) -> None:
        """Before the gradient reduction: stall, or turn this tile's numbers into NaN."""
        if f := self._due("stall_rank", step):
            self._say(f"stalls {f.seconds:g} s before the gradient reduction of step {step}")
            time.sleep(f.seconds)
        if self._due("nan_rank", step, onward=True):
            if step == self._due("nan_rank", step, onward=True).step:
                self._say(f"produces NaN from step {step} on")
            loss.fill_(float("nan"))
            for p in params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
                    break

    def in_optimizer(self, step: int) -> None:
        if f := self._due("slow_rank", step, onward=True):
            time.sleep(f.seconds)
        if self._due("hang_rank", step):
            self._say(f"hangs in a device sync at step {step}")
            threading.Event().wait()  # never set

    def _say(self, what: str) -> None:
        print(f"fault injection: rank {self.rank} {what}", file=sys.stderr, flush=True)
