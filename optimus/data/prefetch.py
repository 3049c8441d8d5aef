"""The next step's batches already on the device when the step starts.

The loader's workers (or the trainer's own process, with none) make each microbatch; on an
accelerator the loader pins it (`pin_memory`) and `ahead()` starts its copy to the device
without a sync, one step ahead, while the device still runs the current step. So a step never
waits for `next()` nor for a copy. Only the tensors the step computes with travel; the sample
ids stay on the host, where the record of what a step read is written.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

TO_DEVICE = ("input_ids", "labels")


class DeviceBatches:
    """A step's microbatches at a time, the next step's fetched and on their way ahead."""

    def __init__(self, batches: Iterator[dict], microbatches: int, device: torch.device):
        self.microbatches, self.device = microbatches, device
        self._batches = batches
        self._next: list[dict] | None = None

    def replace(self, batches: Iterator[dict]) -> None:
        """Read from `batches` from now on (a rewind's window skipped); what was fetched ahead
        from the old iterator is dropped."""
        self._batches, self._next = batches, None

    def take(self) -> list[dict]:
        """This step's microbatches, on the device (fetched now if `ahead` did not)."""
        if self._next is None:
            self.ahead()
        step, self._next = self._next, None
        return step

    def ahead(self) -> None:
        """Fetch the next step's microbatches and start their copy to the device."""
        if self._next is None:
            self._next = [self._to_device(next(self._batches)) for _ in range(self.microbatches)]

    def _to_device(self, batch: dict) -> dict:
        """The tensors a step computes with, on the device (a CPU's are there already)."""
        return {k: v.to(self.device, non_blocking=True) if k in TO_DEVICE else v
                for k, v in batch.items()}
