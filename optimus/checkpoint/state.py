"""What a checkpoint holds: the whole training state as DCP `Stateful` objects.

`training_state(...)` returns the dict that `Checkpointer.save` and `.load_latest` take:

- "model", "optim": the weights and AdamW state of the chunks this rank holds, through
  `torch.distributed.checkpoint.state_dict` on `ParallelModel.state_view()`. Values stay sharded
  DTensors (FSDP2 over dp, TP) and the keys are the whole model's names in every layout, so each
  rank writes only its share and DCP reshards on load: a checkpoint saved at tp2 x pp2 x dp2
  loads at pp2 x dp4 or on one rank.
- "progress": step, tokens seen and the data state. The loader's state is one integer, the next
  global sample index (data order is a function of (seed, index)), kept as its own counter so a
  resume with another batch size neither skips nor repeats a sample. The learning-rate schedule
  is a pure function of the step, so the step is its position.
- "rng": each rank's torch RNG states (CPU, and the accelerator's when there is one), stored
  under a per-rank key next to the layout they were saved under. On the same layout every rank
  gets its own states back; on another layout they mean nothing (rank r holds other data and
  other shards), so they are left alone and `load_note` says so.

- "stability", added by the trainer: the spike rules' trailing history (one JSON string, the
  same on every rank; optimus/stability.py). Optional: a checkpoint without it still loads.

Nothing else carries state between steps: the loss scale does not exist (bf16/fp32), gradient
clipping and the pipeline schedules are stateless, and the optimizer's own step counters are in
its state dict.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from optimus.parallel.plan import ParallelModel
from optimus.runtime.dims import ParallelDims

# State under a key of this name holds one entry per rank. A checkpoint saved by another world
# size lacks some of those entries; the loader skips them instead of failing (see saver.py).
PER_RANK = "per_rank"
# State a checkpoint may lack (written before it existed): loaded when there, else left as it
# is. "stability": the spike rules' history (optimus/stability.py), added by the trainer.
OPTIONAL_STATE = ("stability",)
OPTIONAL = tuple(f"{name}." for name in OPTIONAL_STATE)  # their keys, flattened by DCP


# Param-group settings are stored per parameter name, not per group: pipeline stages hold
# different parameters in their groups, and DCP keeps one copy of a non-tensor value that
# several ranks save under the same key, so per-group entries would clash across stages.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelState(Stateful):
    """The weights of every chunk this rank holds, named as in the whole model."""

    def __init__(self, view: nn.Module):
        self.view = view

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.view)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.view, state_dict)


class OptimizerState(Stateful):
    """The optimizer's state and param groups, keyed by the same global parameter names."""

    def __init__(self, view: nn.Module, optimizer: torch.optim.Optimizer):
        self.view, self.optimizer = view, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.view, self.optimizer, options=_FLAT)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.view, self.optimizer, state_dict, options=_FLAT)


class Progress(Stateful):
    """How far training got: optimizer steps, tokens seen, the next global sample index.

    The trainer calls `advance(step_tokens)` after each optimizer step. `data_index` is what
    the loader takes as `start_index` on resume.
    """

    def __init__(self, batch_size: int):
        self.batch_size = batch_size  # global samples per step
        self.step = 0
        self.tokens = 0
        self.data_index = 0

    def advance(self, tokens: int) -> None:
        self.step += 1
        self.tokens += int(tokens)
        self.data_index += self.batch_size

    def meta(self) -> dict[str, int]:
        """The manifest's view of it (JSON)."""
        return {"step": self.step, "tokens": self.tokens, "data_index": self.data_index}

    def state_dict(self) -> dict[str, Any]:
        return {name: torch.tensor(value, dtype=torch.int64)
                for name, value in self.meta().items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens = int(state_dict["tokens"])
        self.data_index = int(state_dict["data_index"])


class RankRNG(Stateful):
    """This rank's RNG states, restored only under the layout that saved them.

    `apply()` sets the loaded states again: call it right before the first step after a resume
    if setup after the load drew random numbers (a DataLoader iterator draws its base seed).
    """

    def __init__(self, rank: int, layout: str):
        self.rank, self.layout = rank, layout
        self.load_note: str | None = None
        self._loaded: dict[str, torch.Tensor] | None = None

    def state_dict(self) -> dict[str, Any]:
        mine = {"cpu": torch.get_rng_state()}
        accelerator = _accelerator()
        if accelerator is not None:
            mine["accelerator"] = torch.get_device_module(accelerator).get_rng_state()
        return {"layout": self.layout, PER_RANK: {str(self.rank): mine}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["layout"]
        if saved != self.layout:
            self.load_note = (f"RNG states were saved under layout {saved}, this run is "
                              f"{self.layout}: each rank keeps the RNG it was seeded with")
            self._loaded = None
            return
        self.load_note = None
        self._loaded = state_dict[PER_RANK][str(self.rank)]
        self.apply()

    def restore(self, states: dict[str, torch.Tensor]) -> None:
        """Set this rank's own states, from an in-memory snapshot of the same layout."""
        self.load_note = None
        self._loaded = states
        self.apply()

    def apply(self) -> None:
        if self._loaded is None:
            return
        torch.set_rng_state(self._loaded["cpu"])
        accelerator = _accelerator()
        if accelerator is not None and "accelerator" in self._loaded:
            torch.get_device_module(accelerator).set_rng_state(self._loaded["accelerator"])


def _accelerator() -> str | None:
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator().type


def layout_key(layout: ParallelDims, device: torch.device | str) -> str:
    """A layout on a kind of device as one string: per-rank state restores only where this
    matches (e.g. "cpu:dp2.tp1.pp1.ep1.vs1")."""
    return f"{torch.device(device).type}:{layout.key()}"


def training_state(model: ParallelModel, optimizer: torch.optim.Optimizer, progress: Progress,
                   *, rank: int, layout: str) -> dict[str, Stateful]:
    """The dict a Checkpointer saves and loads; `layout` comes from `layout_key`."""
    view = model.state_view()
    return {
        "model": ModelState(view),
        "optim": OptimizerState(view, optimizer),
        "progress": progress,
        "rng": RankRNG(rank, layout),
    }
