"""Rank-side fault injection, for tests and demos: a rank kills or freezes itself.

Whole-node faults (`kill_node`) are carried out by the node's agent, not here.
"""

from __future__ import annotations

import os
import signal
import sys

from optimus.config import FaultInjectionConfig


def inject_faults(cfg: FaultInjectionConfig, *, rank: int, generation: int,
                  step: int) -> None:
    """Fire the faults planned for this rank, generation and step (before the step runs)."""
    for fault in cfg.faults:
        if fault.step != step or fault.generation != generation or fault.rank != rank:
            continue
        if fault.kind == "kill_rank":
            print(f"fault injection: rank {rank} kills itself at step {step}", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "freeze_rank":
            print(f"fault injection: rank {rank} freezes at step {step}", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
