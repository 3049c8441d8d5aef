"""Host copies of the training state that do not hold up the step: the staging of saves and
snapshots.

A save or a snapshot holds the state as it was at a step boundary while training goes on. Only
the optimizer's step changes that state: the next step's forward and backward read the weights
and the optimizer's moments and write neither. So the copy runs behind them, and the next
update waits for it:

    stager = Stager()                     # one per kind of copy; its host buffers are reused
    begun = stager.begin()                # training thread, at the step boundary
    staged = stager.copy(tree, begun)     # a background thread: the tree's tensors on the host
    ...the next step's forward and backward...
    stager.fence()                        # training thread, before the state changes

- `begin` records an event on the device's current (compute) stream: the step's updates may
  still be running there when the host reaches the boundary.
- `copy` has a side stream wait for that event, then copies every tensor into host memory with
  DCP's copier (`StateDictStager`: DTensors stay DTensors, and each source storage keeps its
  host copy from one stage to the next, so a copy allocates and pins nothing after the first),
  non-blocking, records an event once the last copy is queued, and waits for it.
- `fence` waits only until the copies are queued, then has the compute stream wait for that
  event: the host goes on, the device's next update starts once the copies are done.

On a CPU the streams and events are torch.cpu's, which do nothing: the copies are plain copies,
done when they are queued, and `fence` waits for that. The code is the same on every device;
what differs is chosen here once: the stream module (`torch.get_device_module`), and pinned
memory with non-blocking copies where there is a CUDA device (DCP's copier pins through CUDA).

`Stager` is also DCP's `DefaultStager`, with `stage` running `begin` on the caller's thread and
`copy` in its own thread and returning a Future, which `dcp.async_save` hands to its writer.
torch 2.11 (the GPU machines' image) closes the stager `async_save` is given after every save,
and `DefaultStager` closes its inner copier, which drops the buffers and empties its copy table
(`KeyError: <class 'type'>` on the next save, pytorch/pytorch#183413): both closes are no-ops
here, and `release()` frees.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


class Streams:
    """The device's current stream, a side stream and their events; torch.cpu's no-ops on a
    machine without an accelerator. Make it on the training thread, once the device is set."""

    def __init__(self) -> None:
        accelerator = (torch.accelerator.current_accelerator()
                       if torch.accelerator.is_available() else None)
        self.device_type = accelerator.type if accelerator is not None else "cpu"
        self.module = torch.get_device_module(self.device_type)
        self.index = None if accelerator is None else torch.accelerator.current_device_index()
        self.side = self.module.Stream()

    def mark(self) -> Any:
        """An event at the current end of the current stream (the training's)."""
        event = self.module.Event()
        event.record()
        return event

    @contextlib.contextmanager
    def side_after(self, event: Any) -> Iterator[None]:
        """Work queued inside runs on the side stream, after `event` (on any thread)."""
        if self.index is not None:  # a new thread starts on device 0
            self.module.set_device(self.index)
        self.side.wait_event(event)
        with self.module.stream(self.side):
            yield

    def record_side(self) -> Any:
        event = self.module.Event()
        event.record(self.side)
        return event

    def hold(self, event: Any) -> None:
        """The current stream's next work waits for `event`; the host does not."""
        self.module.current_stream().wait_event(event)


@dataclass
class Begun:
    """One copy: where the training stream was at the step boundary, and how far it got."""

    start: Any  # event on the training stream
    queued: threading.Event = field(default_factory=threading.Event)  # copies queued, or failed
    done: Any = None  # event on the side stream after the last copy (None: the copy failed)


class Stager(DefaultStager):
    """Copies of the state into host buffers kept from one copy to the next (pinned where there
    is a CUDA device; shared memory with `shared`, which DCP's writer process reads in place),
    on a side stream, fenced before the next update (see the top of this module)."""

    _synchronize_after_execute = False  # `stage` returns a Future: DCP waits on that

    def __init__(self, *, shared: bool = False) -> None:
        self.pinned = torch.cuda.is_available()
        super().__init__(StagingOptions(use_pinned_memory=self.pinned, use_shared_memory=shared,
                                        use_async_staging=False, use_non_blocking_copy=False))
        copier = self._state_dict_stager
        self._free_buffers = copier.close
        copier.close = lambda: None  # torch 2.11's DefaultStager calls it after every stage
        self._streams: Streams | None = None
        self._pending: Begun | None = None
        self._thread: ThreadPoolExecutor | None = None

    def begin(self) -> Begun:
        """At the step boundary, on the training thread: the state as it is now is what the
        next `copy` copies. Pending until `fence`."""
        if self._streams is None:  # made here, on the training thread, once the device is set
            self._streams = Streams()
        self._pending = Begun(self._streams.mark())
        return self._pending

    def copy(self, tree: Any, begun: Begun) -> Any:
        """`tree` with every tensor copied into this stager's host buffers, once the training
        stream reached `begun`; returns when the copies are done. On any thread; one at a time
        (the buffers are reused: a copy overwrites the previous one's)."""
        try:
            with self._streams.side_after(begun.start):
                staged = self._state_dict_stager.stage(tree, non_blocking=self.pinned)
                begun.done = self._streams.record_side()
        finally:
            begun.queued.set()
        begun.done.synchronize()
        return staged

    def fence(self) -> float:
        """Before the state changes, on the training thread: the pending copy has read it (on
        an accelerator, the device's next work waits for the copies, the host only for them to
        be queued). Returns how long the host waited; 0 with none pending."""
        begun, self._pending = self._pending, None
        if begun is None:
            return 0.0
        began = time.perf_counter()
        begun.queued.wait()
        if begun.done is not None:
            self._streams.hold(begun.done)
        return time.perf_counter() - began

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def stage(self, state_dict: Any, **kwargs: Any) -> Future:
        """DCP's entry (`dcp.async_save`, on the caller's thread): `begin` now, `copy` in this
        stager's thread; the Future holds the staged state dict."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-stage")
        begun = self.begin()
        return self._thread.submit(self.copy, state_dict, begun)

    def synchronize_staging(self) -> None:
        """DCP's older protocol: `stage` returns a Future, which DCP waits on."""

    def close(self) -> None:
        """Called by torch 2.11 after every save: the stager stays ready for the next."""

    def release(self) -> None:
        """Free the host buffers, once the copy in flight (if any) is done."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self._pending = None
        self._free_buffers()
