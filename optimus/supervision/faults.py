"""Rank-side fault injection, for tests, demos and rehearsals: a rank breaks itself the way real
ones do.

- kill_rank: SIGKILLs itself before step s (a crash).
- freeze_rank: SIGSTOPs itself before step s (a frozen process: its heartbeats stop).
- stall_rank: sleeps `seconds` just before the gradient reduction of step s, in phase
  "backward", outside any collective, while its peers wait in the reduction: a slow step, or a
  hang with this rank named once the sleep outlasts the hang threshold.
- hang_rank: blocks forever in the optimizer phase of step s, as in a device sync that never
  returns (a hung device or collective kernel): its heartbeats go on, its peers wait in the
  next collective, which it never joins. With `deaf`, it also ignores SIGUSR1 (a rank stuck in
  the kernel runs no signal handler), so only py-spy gets its stack.
- nan_rank: from step s on, its loss and gradients are NaN (a bad tile).
- slow_rank: from step s on, spends `seconds` more per step computing (a straggler).
- spike: step s's whole batch (every rank's share; no `rank`) becomes random tokens, as a
  corrupt shard would feed it: a real loss spike, for the stability rules (optimus/stability.py).

The kinds are the contract's (optimus/contract/chaos.py).

Each fires only in its `generation`. Whole-node faults (`kill_node`) are carried out by the
node's agent, not here.

Faults come from the job file (`fault_injection.faults`) or, while the job runs, from an
operator (`optimus chaos hang-rank|stall-rank|nan-rank`): the agent appends those to a small
JSON file of its node, $OPTIMUS_CHAOS_FILE ({"faults": [{"id": 1, "kind": "hang_rank", "rank":
3, "generation": 2, "seconds": 0.0, "step": 57}]}, replaced atomically), which each rank stats
at the start of every step; a new entry for this rank and generation fires in that step, or in
its `step` when that is later (`--at-step`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch

from optimus.config import FaultInjectionConfig
from optimus.config.schema import Fault
from optimus.contract import chaos, env
from optimus.models import IGNORE_INDEX


class RankFaults:
    """The faults planned for this rank in this generation, fired at their points in a step."""

    def __init__(self, cfg: FaultInjectionConfig, *, rank: int, generation: int,
                 chaos_file: str | None = None):
        self.faults = [f for f in cfg.faults if (f.rank == rank or f.kind == chaos.SPIKE)
                       and f.generation == generation and f.kind != chaos.KILL_NODE]
        self.rank, self.generation = rank, generation
        self.chaos_file = chaos_file if chaos_file is not None else os.environ.get(env.CHAOS_FILE)
        self._chaos_key: tuple | None = None
        self._chaos_seen: set = set()

    def _due(self, kind: str, step: int, onward: bool = False):
        for f in self.faults:
            if f.kind == kind and (step >= f.step if onward else step == f.step):
                return f
        return None

    def step_start(self, step: int) -> None:
        self._read_chaos(step)
        if self._due("kill_rank", step):
            self._say(f"kills itself at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if self._due("freeze_rank", step):
            self._say(f"freezes at step {step}")
            os.kill(os.getpid(), signal.SIGSTOP)

    def poison(self, step: int, microbatches: list[dict], vocab_size: int) -> None:
        """spike: this step's tokens replaced by random ones (the same on every layout: drawn
        from the step number and each sample's id), padding left as it is."""
        if not self._due("spike", step):
            return
        if self.rank == 0:
            self._say(f"poisons the batch of step {step} with random tokens (spike)")
        for mb in microbatches:
            inputs, labels = mb["input_ids"], mb["labels"]
            for row, sample in enumerate(mb["sample_ids"].tolist()):
                g = torch.Generator().manual_seed(step * 1_000_003 + int(sample))
                tokens = torch.randint(vocab_size, (inputs.shape[1] + 1,), generator=g,
                                       dtype=inputs.dtype)
                inputs[row] = tokens[:-1]
                labels[row] = torch.where(labels[row] == IGNORE_INDEX, labels[row], tokens[1:])

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
        if f := self._due("hang_rank", step):
            if f.deaf:  # no stack dump on SIGUSR1 from now on
                signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            self._say(f"hangs in a device sync at step {step}"
                      + (", deaf to SIGUSR1" if f.deaf else ""))
            threading.Event().wait()  # never set

    def _read_chaos(self, step: int) -> None:
        """An operator's faults for this rank, from the agent's chaos file (one stat a step):
        each new one fires in this step."""
        if not self.chaos_file:
            return
        try:
            st = os.stat(self.chaos_file)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == self._chaos_key:
                return
            with open(self.chaos_file, "rb") as f:
                entries = json.loads(f.read()).get("faults", [])
        except (OSError, ValueError, AttributeError):
            return  # none yet, or unreadable: the next step tries again
        self._chaos_key = key
        for e in entries:
            if not isinstance(e, dict) or e.get("kind") not in chaos.RANK_FIRED:
                continue
            every = e["kind"] == chaos.SPIKE  # every rank its share of the step (no rank named)
            if e.get("rank") != (None if every else self.rank) or \
                    e.get("generation") != self.generation:
                continue
            if e.get("id") in self._chaos_seen:
                continue
            self._chaos_seen.add(e.get("id"))
            asked = e.get("step")
            if every and not (isinstance(asked, int) and asked >= step):
                self._say(f"was sent a spike for step {asked} in step {step}: too late, not "
                          "fired (the other ranks' shares would be poisoned alone)")
                continue
            at = max(step, asked) if isinstance(asked, int) and not isinstance(asked, bool) \
                else step
            self.faults.append(Fault(kind=e["kind"], step=at, rank=None if every else self.rank,
                                     generation=self.generation,
                                     seconds=float(e.get("seconds") or 0.0)))
            self._say(f"was sent {e['kind']} by an operator (chaos): it fires in step {at}")

    def _say(self, what: str) -> None:
        print(f"fault injection: rank {self.rank} {what}", file=sys.stderr, flush=True)
