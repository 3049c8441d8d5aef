"""A step's figures on their way from the device to host memory, without a sync
(optimus/step.py's figures, and the quorum's under replicas: optimus/parallel/replica_mode.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimus.runtime.memory import ACCELERATORS


class Readback:
    """A step's figures on their way to host memory: copied into one of two host buffers in
    turn (the boundary reads one step's while the next step's copy may be in flight), reused
    from step to step. On an accelerator the buffers are pinned, the copy does not sync and an
    event marks its end: `read` waits for that event only, by when the device has long finished
    the step if the next step's work was queued behind it. On a CPU the same copy is a plain
    one and there is no event to wait for."""

    def __init__(self, device: torch.device):
        self.device = device
        self.accelerated = device.type in ACCELERATORS
        self.buffers: list[torch.Tensor] = []
        self._turn = 0

    def start(self, figures: torch.Tensor) -> Pending:
        if not self.buffers or self.buffers[0].shape != figures.shape:
            self.buffers = [torch.empty(figures.shape, dtype=figures.dtype,
                                        pin_memory=self.accelerated) for _ in range(2)]
        host = self.buffers[self._turn]
        self._turn ^= 1
        host.copy_(figures, non_blocking=self.accelerated)
        event = None
        if self.accelerated:
            event = torch.Event(device=self.device.type)
            event.record()
        return Pending(host, event)


@dataclass
class Pending:
    """One step's figures in (or on their way to) host memory."""

    host: torch.Tensor
    event: object | None

    def read(self) -> list[float]:
        """The figures as Python floats: waits for the copy's event, no other sync; `tolist`
        of host memory is no device read."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
